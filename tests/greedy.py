"""Two greedy continuations of one prompt, computed in other summation orders (a radix hit against a
cold prefill, one attention implementation against another), compared as the compute dtype allows:
token for token and in log-probability until they part, and where they part only at a tie to
rounding (both rank the two tokens within a margin that rounding can cross)."""

from __future__ import annotations

# per compute dtype: (how far a chosen token's log-probability may move, the top-2 margin that may
# flip either way). float32 differs by rounding alone. In bf16 a logit of ~16 moves in steps of
# 0.125: the test model's memory-mode answer parted, a radix hit against its cold prefill, at a
# margin of one step (0.125 cold, 0.0625 hit) after log-probabilities 0.018 apart (an AMX Xeon).
TOLERANCE = {"float32": (2e-3, 2e-3), "bfloat16": (0.1, 0.25)}
REQUEST = {"return_logprob": True, "top_logprobs_num": 2}  # what a response needs for `parted_at`


def parted_at(ours: dict, ref: dict, dtype: str, context: str = "") -> int | None:
    """Where two /generate responses (asked with REQUEST) part, None if nowhere; asserts that
    their chosen tokens' log-probabilities agree until then and that the parting is a tie to
    rounding on both."""
    logprob_tol, tie = TOLERANCE[dtype]
    a, b = ours["output_ids"], ref["output_ids"]
    part = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lp_a = [lp for lp, *_ in ours["meta_info"]["output_token_logprobs"][:part]]
    lp_b = [lp for lp, *_ in ref["meta_info"]["output_token_logprobs"][:part]]
    assert max((abs(x - y) for x, y in zip(lp_a, lp_b)), default=0) < logprob_tol, (context, lp_a, lp_b)
    if part == len(a) == len(b):
        return None
    assert part < min(len(a), len(b)), (context, a, b)  # one stopped where the other went on: not a tie
    for out in (ours, ref):
        top = out["meta_info"]["output_top_logprobs"][part]
        assert {t for _, t, *_ in top} == {a[part], b[part]} and abs(top[0][0] - top[1][0]) < tie, (context, top)
    return part
