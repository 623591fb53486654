"""The forward-path and output-path hooks of the patch set (patches/hooks.yaml): each one hands
SGLang's objects to the part of sgl-memory that owns the behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

from sgl_memory.core import capture, metrics, prometheus
from sgl_memory.core.request import FIELD
from sgl_memory.engine import integrity, runtime

if TYPE_CHECKING:
    from sgl_memory.engine.radix_cache import SglMemoryRadixCache

# What GET /sgl_memory/sessions pages and GET /sgl_memory/integrity reports: each is asked of the
# scheduler as SGLang's internal-state request whose rid is this key, and answered under it
SESSIONS_KEY = "sgl_memory_sessions"
INTEGRITY_KEY = "sgl_memory_integrity"


def capture_hook(layer, q, k, v, forward_batch, *args, **kwargs):
    """BEFORE hook on RadixAttention.forward: the layer's inputs to the mechanisms' capture subscribers."""
    composed = runtime.composition()
    if composed is not None and composed.subscribers:
        capture.feed(composed.subscribers, layer, q, k, v, forward_batch)
    return None


def shift_positions_hook(forward_batch, *args, **kwargs):
    """AFTER hook on ForwardBatch.init_new: requests whose KV a layout re-packed run at position +
    shift (Mechanism.position_shift), whatever the attention backend."""
    composed = runtime.composition()
    if composed is None or not composed.shifts_positions or not forward_batch.rids:
        return None
    if forward_batch.forward_mode.is_decode():
        lens = [1] * len(forward_batch.rids)
    else:
        lens = forward_batch.extend_seq_lens_cpu or forward_batch.extend_seq_lens.tolist()
    start = 0
    for rid, n in zip(forward_batch.rids, lens):
        shift = composed.position_shift(rid)
        if shift:
            forward_batch.positions[start : start + n] += shift
        start += n
    return None


def meta_info_hook(original, manager, meta_info, state, customized_info, index, finish_reason):
    """AROUND hook on TokenizerManager.update_request_meta_info: our metrics become one object
    (SGLang would accumulate them as a list) and feed the aggregates."""
    ours = customized_info.get(FIELD)
    rest = {k: v for k, v in customized_info.items() if k != FIELD}
    if rest:
        original(manager, meta_info, state, rest, index, finish_reason)
    if ours is not None and ours[index]:
        reported = ours[index][-1]
        meta_info[FIELD] = reported
        if str(meta_info.get("id", "")).startswith(HEALTH_CHECK_RID_PREFIX):
            # SGLang's /health generates one token: a probe (a router's, a load balancer's), not a request served
            return
        metrics.STATS.record(meta_info.get("id"), reported, meta_info)
        prometheus.record_request(reported, meta_info)


def request_level_key_hook(original, streamer, key):
    """AROUND hook on SchedulerOutputStreamer.is_request_level_customized_info_key: our metrics are
    sent once, when the request finishes, not sliced per token."""
    return key == FIELD or original(streamer, key)


def stream_finish_hook(result, accumulator, *args, req, **kwargs):
    """AFTER hook on the stream accumulator's accept: SGLang sends a streamed request's
    request-level info with its first chunk only, before our metrics exist (they are attached when
    the request finishes); so the finishing chunk of a streamed request carries them."""
    ours = (req.customized_info or {}).get(FIELD)
    if not ours or not req.stream or not req.finished() or not accumulator.rids or accumulator.rids[-1] != req.rid:
        return None
    column = accumulator.customized_info.setdefault(FIELD, [[] for _ in accumulator.output_ids[:-1]])
    if len(column) < len(accumulator.output_ids):
        column.append([])
    column[-1] = ours
    return None


def describe_sessions(tree: SglMemoryRadixCache) -> list[dict]:
    """Every session the tree holds, least recently used first: its tenant, id and last use,
    and what each mechanism says of its state (Mechanism.describe_session): sizes, no contents."""
    out = []
    for (tenant, session_id), used, states in tree.sessions.snapshot():
        row = {"tenant": tenant or None, "session_id": session_id, "last_use": round(used, 3)}
        out.append(row | tree.composition.describe_session(states))
    return out


def sessions_state_hook(result, scheduler, recv_req=None, *args, **kwargs):
    """AFTER hook on the scheduler's get_internal_state: for a request named SESSIONS_KEY the
    sessions its tree holds, described (describe_sessions), for the HTTP side's inspector; for one
    named INTEGRITY_KEY the tree's integrity problems and the per-request state left by requests
    that ended (integrity.py). SGLang's
    internal-state request is the one channel from the HTTP process to the scheduler that answers;
    SGLang's own askers (GET /server_info, polled by routers) name nothing and pay for neither walk."""
    ask = getattr(recv_req, "rid", None)
    tree = runtime.tree()
    state = getattr(result, "internal_state", None)
    if ask not in (SESSIONS_KEY, INTEGRITY_KEY) or tree is None or tree.disable or not isinstance(state, dict):
        return result
    if ask == SESSIONS_KEY:
        state[SESSIONS_KEY] = describe_sessions(tree)
    else:
        state[INTEGRITY_KEY] = integrity.check(tree, integrity.row_owners(scheduler)) + integrity.request_state(
            tree, integrity.in_flight(scheduler)
        )
    return result
