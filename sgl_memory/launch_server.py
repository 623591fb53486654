"""`python -m sgl_memory.launch_server`: SGLang's server with sgl-memory switched on.

Takes every `sglang.launch_server` flag unchanged, plus:
  --model NAME          a catalogue model (fetched on first use) or a path; default: the embedded
                        default model. `--model-path` works as in SGLang.
  --memory-config FILE  sgl-memory YAML config (see configs/example.yaml).

On a machine without a GPU it fills in the CPU defaults the user did not set: CPU engine,
`--device cpu`, `--attention-backend sgl_memory_cpu` (ours, see sgl_memory/attention), no graph
capture, no overlap schedule, no warm-up, sleep when idle, and a `--max-total-tokens` sized from
free RAM. It always selects the `sgl_memory` radix-cache backend
unless told otherwise, and the tool-call parser of the model family.

All launching stays under `if __name__ == "__main__"`: SGLang's spawned children re-import this
module as `__mp_main__`, and a launcher that ran at import time would start the server again in each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from sgl_memory import config as memory_config
from sgl_memory import models

KV_POOL_RAM_FRACTION = 0.15
KV_POOL_MIN_TOKENS = 8192
KV_POOL_MAX_TOKENS = 131072


def _has_flag(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def kv_bytes_per_token(model_path: Path) -> int:
    cfg = json.loads((model_path / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * layers * kv_heads * head_dim * 2  # K and V, bf16


def default_max_total_tokens(model_path: Path) -> int:
    """SGLang sizes the pool like GPU memory on CPU (13 GB, 40 s start); size it from free RAM."""
    import psutil

    budget = psutil.virtual_memory().available * KV_POOL_RAM_FRACTION
    tokens = int(budget // kv_bytes_per_token(model_path))
    return max(KV_POOL_MIN_TOKENS, min(KV_POOL_MAX_TOKENS, tokens))


def build_argv(argv: list[str]) -> tuple[list[str], memory_config.MemoryConfig]:
    """Our flags out, SGLang's defaults for this machine in; returns SGLang's argv and our config."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", "--model-path", dest="model", default=models.DEFAULT_MODEL)
    parser.add_argument("--memory-config", default=None)
    ours, rest = parser.parse_known_args(argv)

    from sgl_memory import radix_cache
    from sgl_memory.attention import cpu_backend

    cfg = memory_config.load(ours.memory_config)
    radix_cache.check_config(cfg)  # the tree checks again where it is built; here it fails before start-up
    if ours.memory_config:
        os.environ[memory_config.CONFIG_ENV] = str(Path(ours.memory_config).resolve())

    model_path = models.resolve(ours.model)
    out = ["--model-path", str(model_path), *rest]

    def default(flag: str, *value: str) -> None:
        if not _has_flag(out, flag):
            out.extend([flag, *value])

    default("--radix-cache-backend", radix_cache.BACKEND_NAME)
    spec = models.MODELS.get(ours.model)
    if spec and spec.tool_call_parser:
        default("--tool-call-parser", spec.tool_call_parser)
    default("--enable-cache-report")
    if not _has_gpu():
        default("--device", "cpu")
        default("--attention-backend", cpu_backend.BACKEND_NAME)
        # SGLang switches graph capture off by name for torch_native only; our backend has none either
        default("--cuda-graph-backend-decode", "disabled")
        default("--cuda-graph-backend-prefill", "disabled")
        default("--max-total-tokens", str(default_max_total_tokens(model_path)))
        default("--disable-overlap-schedule")
        default("--skip-server-warmup")
        # an idle scheduler otherwise busy-polls a whole core: half of a 2-core machine
        default("--sleep-on-idle")
    return out, cfg


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from sgl_memory import cpu_compat

    # The .pth carries the CPU work-arounds into SGLang's spawned processes; heal it if missing.
    cpu_compat.install_pth()
    cpu_compat.activate()
    if not _has_gpu():
        # Read by SGLang at import time, so it must be set before anything imports sglang.
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    try:
        sglang_argv, _ = build_argv(argv)
    except (memory_config.ConfigError, models.FetchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    print("sgl-memory: sglang " + " ".join(sglang_argv), file=sys.stderr, flush=True)
    server_args = prepare_server_args(sglang_argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
