"""Agents on sgl-memory: real multi-turn tool-using agents through the public OpenAI API, every
method on the same tasks, accuracy next to system cost (the IntentKV paper's metrics).

    python -m bench.agent --workload bfcl --methods plain 'full cache' 'intentkv-*' --budgets 512 --limit 2

Modules: `loop.py` (one decision through /v1/chat/completions, its costs, token ids, the KV-memory
window, future-action labels), `bfcl.py` (BFCL v4 multi-turn through the pinned `bfcl-eval`
package: tasks, back-ends, checker), `bcp.py` (the BrowseComp-Plus-shaped search workload: corpus,
BM25 with frozen results, judges), `mcp_server.py` (its tools over MCP), `run.py` (methods,
servers, resumable runs, aggregation, table, plot).

Trace format (`agent_<workload>.traces.jsonl`, one JSON object per line, per method and task):
- `workload`, `model`, `method`, `fields` (the `sgl_memory` request field, null for plain SGLang),
  `task`, `category`;
- `messages`: the conversation as the agent last sent it plus its final reply (OpenAI chat format;
  the tools offered are BFCL's docs, reproducible from the task id);
- `steps`: per decision, `turn`, `step`, `calls` ([name, arguments] as the model emitted them),
  `text`, `executed` (BFCL call strings run) and `results`, `next_calls` (the next five calls'
  [name, arguments]: the future-action labels), the step's `metrics` (`sgl_memory` object) and
  costs (`prompt_tokens`, `cached_tokens`, `output_tokens`, `peak_request_tokens`, `live_kv_tokens`,
  `raw_kv_reads`, `eff_kv_reads`, `latency_s`), `finish_reason`, `prefix` (how many of
  `messages` the step's request held: the decision point a teacher-forced replay starts from), and
  `token_ids`: the prompt's ids as the server tokenised them, stored after the ones it shares with the
  previous step's prompt (`shared` ids, then `prompt`; `loop.prompt_token_ids` rebuilds them all),
  and the `output` ids the model generated;
- BFCL: `decoded` (per turn, per step, the call strings the checker replays), `reason`
  (non-completion: null, `turn_cap`, `overflow`, `error`), `error`, `valid` and `error_type` (BFCL's
  verdict);
- BCP: `prediction`, `gold`, `reason` (null, `turn_cap`, `overflow`, `error`, `empty`), `error`,
  `match` (the normalised match), `judge` (with `--judge llm`: BCP's grader fields
  `extracted_final_answer`, `reasoning`, `correct`), `valid` (the verdict used), `f1`.
"""
