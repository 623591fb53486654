"""The learned pruner head (IntentKV Phase 2) without a server: at initialisation it ranks exactly
as the rule scorer while gradients reach it, the features and the residual form of eq. 4-5 against
a direct computation, the ablation switches, and its file: round trip and refusal of another backbone."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config

from sgl_memory.intent import scorers
from sgl_memory.intent.head import EPS, HeadError, HeadShape, PrunerHead, backbone_spec, find_head
from sgl_memory.intent.sessions import unit_rows

L, H, KVH, D = 3, 4, 2, 16


def inputs(
    seed: int, n: int = 40, m: int = 6, head: PrunerHead | None = None, ablation: str = "none"
) -> scorers.ScoringInputs:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, KVH, D, generator=g) * 3 for _ in range(L)]
    query = [torch.randn(m, KVH, D, generator=g) * 3 for _ in range(L)]
    q_mean = torch.randn(L, H, D, generator=g)
    return scorers.ScoringInputs(
        layer_keys=lambda: iter(keys),
        positions=torch.arange(n),
        q_mean=q_mean,
        q_window=torch.zeros(0),
        memory=unit_rows(torch.randn(L, H, D, generator=g)),
        keep=n // 3,
        seed=seed,
        sinks=4,
        kernel=7,
        query_keys=lambda: iter(query),
        head=head,
        ablation=ablation,
    )


def trained(seed: int) -> PrunerHead:
    """A head whose output projection is no longer zero (as after training)."""
    head = PrunerHead(HeadShape(D))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.out.weight.copy_(torch.randn(head.out.weight.shape, generator=g))
        head.out.bias.fill_(0.3)
        head.gain.fill_(0.8)
        head.memory_proj.weight.add_(0.1 * torch.randn(head.memory_proj.weight.shape, generator=g))
    return head


@pytest.mark.parametrize("seed", range(8))
def test_a_fresh_head_keeps_exactly_the_rule_scorers_set(seed):
    x = inputs(seed, head=PrunerHead(HeadShape(D)))
    want = scorers.select(scorers.get("memory").score(x), x.keep)
    got = scorers.select(scorers.get("learned").score(x), x.keep)
    assert torch.equal(got, want)


def test_near_ties_of_the_rule_stay_ordered_through_the_log():
    rule = torch.tensor([0.25, 0.25 + 2**-25, 0.25, 0.25 - 2**-25])  # distinct float32 shares one ulp apart
    score = PrunerHead(HeadShape(D)).score(rule, torch.zeros(4, D), torch.zeros(D), None)
    assert torch.equal(
        torch.argsort(score, descending=True, stable=True), torch.argsort(rule, descending=True, stable=True)
    )


def test_gradients_reach_the_head_at_initialisation():
    head = PrunerHead(HeadShape(D))
    keys = torch.randn(40, D)
    score = head.score(torch.full((40,), 1 / 40), keys, torch.randn(D), torch.randn(6, D))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(score.float(), (torch.arange(40) % 3 == 0).float())
    loss.backward()
    assert head.out.weight.grad.abs().sum() > 0 and head.out.bias.grad.abs().sum() > 0


def test_the_score_is_the_log_prior_plus_the_clipped_gain_times_the_mlp():
    head = trained(1)
    with torch.no_grad():
        head.gain.fill_(5.0)  # past the clip
    g = torch.Generator().manual_seed(2)
    keys, memory, context = torch.randn(10, D, generator=g), torch.randn(D, generator=g), torch.randn(5, D, generator=g)
    rule = torch.softmax(torch.randn(10, generator=g), 0)
    with torch.no_grad():
        got = head.score(rule, keys, memory, context)
        # eq. 5 features, the cross-attention readout, the MLP: written out here
        m = head.memory_proj.weight @ memory
        f = head.norm_features(torch.cat([keys, m.expand(10, D), keys * m], -1))
        kv = head.norm_context(context)
        c = head.cross(head.to_query(f)[None], kv[None], kv[None])[0][0]
        mlp = head.out(torch.nn.functional.gelu(head.hidden(torch.cat([f, c], -1)))).squeeze(-1)
        want = torch.log(rule.double() * 10 + EPS) + head.shape.gain_clip * mlp.double()
    # The head computes in float32 and its cross-attention takes another kernel than this
    # need_weights=True call: over 300 initialisations they differ by up to 4e-6 (scores of
    # magnitude ~5, where a float32 ulp is 5e-7); a wrong term of the formula moves them by O(0.1).
    assert torch.allclose(got, want, atol=2e-5)


def test_the_ablations():
    head = trained(3)
    base = inputs(4, head=head)
    learned = scorers.get("learned")
    full = learned.score(base)
    # residual off: Phase 1's ranking exactly
    off = learned.score(inputs(4, head=head, ablation="residual"))
    assert torch.equal(scorers.select(off, base.keep), scorers.select(scorers.get("memory").score(base), base.keep))
    # cross-attention off: the query keys are not read
    no_x = learned.score(inputs(4, head=head, ablation="x_attn"))
    blind = inputs(4, head=head, ablation="x_attn")
    blind.query_keys = lambda: iter([torch.full((6, KVH, D), 1e3)] * L)
    assert torch.equal(no_x, learned.score(blind)) and not torch.equal(no_x, full)
    # memory off: the current query stands for QueryMemory, in the prior too
    mem = inputs(4, head=head, ablation="memory")
    prior = torch.log(scorers.rule_score(mem, unit_rows(mem.q_mean)).double() * 40 + EPS)
    assert not torch.equal(learned.score(mem), full)
    zero = inputs(4, head=PrunerHead(HeadShape(D)), ablation="memory")
    assert torch.allclose(learned.score(zero), prior)


def test_a_head_file_round_trips_and_another_backbone_is_refused(tmp_path):
    qwen = Qwen2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, vocab_size=100
    )
    spec = backbone_spec(qwen)
    assert spec["head_dim"] == D
    head = trained(5)
    path = tmp_path / "head.safetensors"
    head.save(path, spec)
    loaded = PrunerHead.load(path, spec)
    x = inputs(6, head=head)
    y = inputs(6, head=loaded)
    assert torch.equal(scorers.get("learned").score(x), scorers.get("learned").score(y))
    assert find_head(str(path), spec) is not None
    other = backbone_spec(
        Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=100)
    )
    with pytest.raises(HeadError, match="num_hidden_layers"):
        PrunerHead.load(path, other)
    (tmp_path / "junk.safetensors").write_bytes(b"not a head")
    with pytest.raises(HeadError):
        PrunerHead.load(tmp_path / "junk.safetensors", spec)
    assert math.isfinite(float(head.clipped_gain().detach()))
    with pytest.raises(HeadError):
        find_head(str(tmp_path / "missing.safetensors"), spec)
    assert find_head("", other) is None  # no shipped head was trained for this backbone


def test_the_head_shipped_for_the_default_model_loads_and_is_trained():
    from transformers import AutoConfig

    from sgl_memory import models

    spec = backbone_spec(AutoConfig.from_pretrained(models.model_dir(models.DEFAULT_MODEL)))
    head = find_head("", spec)
    assert head is not None, "no head ships for the default model"
    assert head.out.weight.abs().sum() > 0 and head.out.bias.abs().sum() > 0  # not the untrained head
    assert float(head.clipped_gain().detach()) != 0.0
    small = backbone_spec(AutoConfig.from_pretrained(models.model_dir("smollm2-135m-instruct")))
    assert find_head("", small) is None  # it serves its own backbone only
