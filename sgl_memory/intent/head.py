"""The learned residual pruner head (IntentKV Phase 2: paper section 3.3, Appendices B and H).

    score_i = log(n * rule_i + eps) + clip(gain) * g([f_i ; c_i])                 (eq. 4)

- rule_i: the Phase-1 rule score (eq. 3, scorers.rule_score with QueryMemory), a softmax share over
  the n candidates. The paper adds the residual to it directly; here it is added in log space
  (our choice: a share is of order 1/n, so a direct sum would let the residual swamp it or vanish
  with n). The log is strictly increasing and taken in float64, where distinct float32 shares stay
  distinct, so the ranking, hence the kept set, is the rule's while g is zero.
- f_i = [k_i ; m ; k_i * m] (eq. 5): the candidate's post-RoPE key averaged over layers and heads
  (the mean over GQA-expanded heads equals the mean over KV heads), the QueryMemory averaged over
  layers and heads through a learned projection (identity at initialisation; training keeps it
  near unit norm, eq. 8's last term), and their product. Means keep f at 3 x head_dim whatever the depth or the head
  count: one topology serves every backbone with that head dim, but its weights serve one.
- c_i (eq. 6): multi-head cross-attention with f_i as the query and the keys of the live query
  positions (the request's latest message, averaged over layers and heads) as keys and values.
- g: a two-layer GELU MLP whose output projection is zero-initialised, weight and bias; the gain
  starts at 1 (a zero gain with a zero output would be a saddle with no gradient) and is clipped to
  [-gain_clip, gain_clip] at inference.

The paper's hidden width, head count, gain clip and eps were lost in extraction: they are this
module's arguments, stored with the weights.

Ablations (Appendix B), chosen at inference on the same weights: `memory` (the current query's
mean replaces QueryMemory, in the rule score and in f), `x_attn` (c = 0), `residual` (gain 0: Phase 1).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

ABLATIONS = ("none", "memory", "x_attn", "residual")
EPS = 1e-6  # inside the log of n * rule: a share of 0 stays finite


@dataclass(frozen=True)
class HeadShape:
    """The sizes of a pruner head: the backbone's head dim, the MLP's hidden width, the
    cross-attention's width and heads, and the clip of the gain."""

    head_dim: int
    hidden: int = 128
    width: int = 64  # the cross-attention's width
    heads: int = 4
    gain_clip: float = 2.0


def backbone_spec(hf_config) -> dict:
    """What a head's weights depend on: the features are this backbone's keys and queries."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = text.num_attention_heads
    return {
        "model_type": text.model_type,
        "num_hidden_layers": text.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", heads),
        "hidden_size": text.hidden_size,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "vocab_size": text.vocab_size,
    }


class HeadError(ValueError):
    """A head file that cannot serve this model (another backbone, a bad file)."""


class PrunerHead(nn.Module):
    """The learned residual pruner head: each candidate's score, the rule's share plus the clipped
    gain times the residual g([f ; c]) (eq. 4-6 in the module docstring)."""

    def __init__(self, shape: HeadShape):
        super().__init__()
        d = shape.head_dim
        self.shape = shape
        self.norm_features = nn.LayerNorm(3 * d)
        self.norm_context = nn.LayerNorm(d)
        self.memory_proj = nn.Linear(d, d, bias=False)
        nn.init.eye_(self.memory_proj.weight)
        self.to_query = nn.Linear(3 * d, shape.width)
        self.cross = nn.MultiheadAttention(shape.width, shape.heads, kdim=d, vdim=d, batch_first=True)
        self.hidden = nn.Linear(3 * d + shape.width, shape.hidden)
        self.out = nn.Linear(shape.hidden, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        self.gain = nn.Parameter(torch.tensor(1.0))

    def residual(
        self, keys: torch.Tensor, memory: torch.Tensor, context: torch.Tensor | None, ablation: str = "none"
    ) -> torch.Tensor:
        """g([f ; c]) [n] for candidate keys [n, D] (mean over layers and heads), the memory [D]
        (the same mean) and the query positions' keys [m, D] (None or empty: no cross-attention)."""
        m = self.memory_proj(memory.float())
        f = self.norm_features(torch.cat([keys.float(), m.expand(keys.shape[0], -1), keys.float() * m], dim=-1))
        if ablation == "x_attn" or context is None or not context.numel():
            c = f.new_zeros(f.shape[0], self.shape.width)
        else:
            kv = self.norm_context(context.float()).unsqueeze(0)
            c, _ = self.cross(self.to_query(f).unsqueeze(0), kv, kv, need_weights=False)
            c = c.squeeze(0)
        return self.out(nn.functional.gelu(self.hidden(torch.cat([f, c], dim=-1)))).squeeze(-1)

    def clipped_gain(self) -> torch.Tensor:
        return self.gain.clamp(-self.shape.gain_clip, self.shape.gain_clip)

    def score(
        self,
        rule: torch.Tensor,
        keys: torch.Tensor,
        memory: torch.Tensor,
        context: torch.Tensor | None,
        ablation: str = "none",
    ) -> torch.Tensor:
        """Eq. 4 [n] float64: the rule share `rule` [n] (already computed with the ablation's memory)
        and the residual."""
        prior = torch.log(rule.double() * rule.numel() + EPS)
        if ablation == "residual":
            return prior
        return prior + (self.clipped_gain() * self.residual(keys, memory, context, ablation)).double()

    # --- files ----------------------------------------------------------------------------------

    def save(self, path: str | Path, spec: dict, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        meta = {"shape": json.dumps(asdict(self.shape)), "backbone": json.dumps(spec, sort_keys=True), **(extra or {})}
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, spec: dict | None) -> PrunerHead:
        """The head in `path`; a HeadError if it was trained for another backbone than `spec`."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            shape = HeadShape(**json.loads(meta["shape"]))
            trained_for = json.loads(meta["backbone"])
        except (OSError, KeyError, ValueError, TypeError, SafetensorError) as exc:
            raise HeadError(f"{path} is not a pruner head file ({exc})") from None
        if spec is not None and trained_for != spec:
            diff = {
                k: (trained_for.get(k), spec.get(k))
                for k in sorted(set(trained_for) | set(spec))
                if trained_for.get(k) != spec.get(k)
            }
            raise HeadError(f"{path} was trained for another backbone: (head, served) {diff}")
        head = cls(shape)
        try:
            head.load_state_dict(tensors)
        except RuntimeError as exc:
            raise HeadError(f"{path} does not match its own shape: {exc}") from None
        return head.eval()


def layer_head_mean(per_layer) -> torch.Tensor:
    """The mean over layers and heads of per-layer tensors [n, heads, D] -> [n, D], float32."""
    total, count = None, 0
    for t in per_layer:
        m = t.float().mean(dim=1)
        total = m if total is None else total + m
        count += 1
    return total / count


HEADS = Path(__file__).parent / "heads"  # the heads that ship with the package, one per backbone


def find_head(path: str, spec: dict | None) -> PrunerHead | None:
    """The head at `path` (a HeadError if it cannot serve this backbone), or with no path the
    shipped head trained for this backbone, None if none is."""
    if path:
        return PrunerHead.load(Path(path).expanduser(), spec)
    for file in sorted(HEADS.glob("*.safetensors")):
        try:
            return PrunerHead.load(file, spec)
        except HeadError:
            continue
    return None
