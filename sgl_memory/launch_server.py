"""`python -m sgl_memory.launch_server`: SGLang's server with sgl-memory switched on.

Takes every `sglang.launch_server` flag unchanged, plus:
  --model NAME          a catalogue model (fetched on first use) or a path; default: the embedded
                        default model. `--model-path` works as in SGLang.
  --memory-config FILE  sgl-memory YAML config (see configs/example.yaml). Without one the server
                        runs every section's defaults: session persistence on (agent-ready), the
                        other mechanisms off.
  --plain               every mechanism off, persistence included: SGLang's own behaviour.
  --kv-pool-bytes SIZE  the KV pool's memory (2GiB, 512MiB, 1.5G, or bytes): the tokens it holds
                        at the KV dtype become SGLang's `--max-total-tokens`, which wins when given
                        (sgl_memory/kv_pool.py). Default on CPU: 15% of free RAM, at most 2 GiB.
  --kv-cache-dtype int8 beside SGLang's values: our pool of 8-bit codes with a scale per token and
                        head (engine/int8_pool.py), read by our CPU attention backend; CPU only.

On a machine without a GPU it fills in the CPU defaults the user did not set: CPU engine,
`--device cpu`, the compute dtype the CPU runs fastest (sgl_memory/cpu_dtype.py: bf16 with AMX or
AVX512-BF16, else float32), `--attention-backend sgl_memory_cpu` (ours, see sgl_memory/attention), no graph
capture, no overlap schedule, no warm-up, sleep when idle, and a KV pool sized from free RAM.
It always selects the `sgl_memory` radix-cache backend
unless told otherwise, and the tool-call parser of the model family.

All launching stays under `if __name__ == "__main__"`: SGLang's spawned children re-import this
module as `__mp_main__`, and a launcher that ran at import time would start the server again in each.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from sgl_memory.core import composition
from sgl_memory.core import config as memory_config
from sgl_memory import cpu_dtype, kv_pool, models


def _has_flag(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _without_flag(argv: list[str], name: str) -> list[str]:
    """argv with every `name v` and `name=v` taken out."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def _flag_value(argv: list[str], name: str) -> str | None:
    """The value of `name` in argv (`--flag v` or `--flag=v`), the last one winning; None if absent."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


# SGLang's CPU engine places each tensor-parallel rank's threads by this ("0-3|4-7": rank 0 on
# cores 0-3, rank 1 on 4-7); unset, it asks for one NUMA node per rank, which most hosts lack
THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


class LaunchError(ValueError):
    """A server this machine cannot run as asked."""


def cpu_thread_binding(tp_size: int, cores: list[int]) -> str:
    """THREADS_BIND_ENV for `tp_size` ranks: `cores` (sorted, this process's) in equal shares, one
    per rank, each written as ranges ("0-3,8-11")."""
    share = len(cores) // tp_size
    if share == 0:
        raise LaunchError(f"--tp-size {tp_size} needs a CPU core per rank; this process may use {len(cores)}")

    def ranges(run: list[int]) -> str:
        starts = [c for i, c in enumerate(run) if i == 0 or run[i - 1] != c - 1]
        ends = [c for i, c in enumerate(run) if i == len(run) - 1 or run[i + 1] != c + 1]
        return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in zip(starts, ends))

    return "|".join(ranges(cores[r * share : (r + 1) * share]) for r in range(tp_size))


def build_argv(argv: list[str]) -> tuple[list[str], memory_config.MemoryConfig]:
    """Our flags out, SGLang's defaults for this machine in; returns SGLang's argv and our config.
    On CPU the dtype choice is exported (CHOICE_ENV) for /sgl_memory/info and the start-up log."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", "--model-path", dest="model", default=models.DEFAULT_MODEL)
    parser.add_argument("--memory-config", default=None)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--kv-pool-bytes", default=None)
    ours, rest = parser.parse_known_args(argv)
    if ours.plain and ours.memory_config:
        raise LaunchError("--plain serves with every mechanism off; it takes no --memory-config")

    from sgl_memory.engine import radix_cache
    from sgl_memory.engine.attention import cpu_backend

    cfg = memory_config.plain() if ours.plain else memory_config.load(ours.memory_config)
    composition.check(cfg)  # the tree checks again where it is built; here it fails before start-up
    # SGLang's child processes read the config from these (memory_config.from_env); none inherited
    os.environ.pop(memory_config.CONFIG_ENV, None)
    os.environ.pop(memory_config.PLAIN_ENV, None)
    if ours.memory_config:
        os.environ[memory_config.CONFIG_ENV] = str(Path(ours.memory_config).resolve())
    if ours.plain:
        os.environ[memory_config.PLAIN_ENV] = "1"

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
    tokens_asked = _flag_value(out, "--max-total-tokens")
    kv_dtype = _flag_value(out, "--kv-cache-dtype")
    if kv_dtype == kv_pool.INT8:  # ours: SGLang's flag has no such value; its pool holds the compute dtype's
        out = _without_flag(out, "--kv-cache-dtype")
        backend = _flag_value(out, "--attention-backend")
        if _has_gpu() or backend not in (None, cpu_backend.BACKEND_NAME):
            raise LaunchError(
                f"--kv-cache-dtype int8 is read by the CPU attention backend ({cpu_backend.BACKEND_NAME}) only;"
                " on a GPU, SGLang's fp8_e4m3 or fp8_e5m2"
            )
    if not _has_gpu():
        choice = cpu_dtype.choose(_flag_value(out, "--dtype"))
        if kv_dtype not in (None, "auto"):
            choice = dataclasses.replace(choice, kv_cache_dtype=kv_dtype)
        os.environ[cpu_dtype.CHOICE_ENV] = choice.to_json()
        default("--dtype", choice.dtype)
        default("--device", "cpu")
        default("--attention-backend", cpu_backend.BACKEND_NAME)
        # SGLang switches graph capture off by name for torch_native only; our backend has none either
        default("--cuda-graph-backend-decode", "disabled")
        default("--cuda-graph-backend-prefill", "disabled")
        pool = kv_pool.choose(model_path, choice.kv_cache_dtype, ours.kv_pool_bytes, tokens_asked)
        default("--disable-overlap-schedule")
        default("--skip-server-warmup")
        # an idle scheduler otherwise busy-polls a whole core: half of a 2-core machine
        default("--sleep-on-idle")
        tp_size = int(_flag_value(out, "--tp-size") or _flag_value(out, "--tensor-parallel-size") or 1)
        if tp_size > 1 and not os.environ.get(THREADS_BIND_ENV):
            os.environ[THREADS_BIND_ENV] = cpu_thread_binding(tp_size, sorted(os.sched_getaffinity(0)))
    else:
        os.environ.pop(cpu_dtype.CHOICE_ENV, None)  # SGLang chooses on a GPU; no stale choice inherited
        # SGLang sizes a GPU's pool from its free memory unless told the bytes
        asked = ours.kv_pool_bytes is not None or tokens_asked is not None
        pool = kv_pool.choose(model_path, kv_dtype or "auto", ours.kv_pool_bytes, tokens_asked) if asked else None
    if pool is not None:
        default("--max-total-tokens", str(pool.tokens))
    kv_pool.export(pool)
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
        sglang_argv, cfg = build_argv(argv)
    except (
        memory_config.ConfigError,
        models.FetchError,
        cpu_dtype.DtypeError,
        kv_pool.PoolSizeError,
        LaunchError,
    ) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    for announced in (cpu_dtype.announced(), kv_pool.announced()):
        if announced is not None:
            print(announced.log_line(), file=sys.stderr, flush=True)
    print("sgl-memory: sglang " + " ".join(sglang_argv), file=sys.stderr, flush=True)
    server_args = prepare_server_args(sglang_argv)
    try:  # SGLang has resolved the page size (a backend may raise it): refuse before anything starts
        composition.check(cfg, server_args.tp_size, server_args.page_size or 1)
    except memory_config.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
