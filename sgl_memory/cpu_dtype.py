"""The compute dtype a CPU server runs in, chosen from what the CPU does fast.

bf16 is only fast where the CPU multiplies bf16 in hardware (AMX or AVX512-BF16, which oneDNN uses
for torch's matmuls). Elsewhere torch converts every bf16 operand to float32 first: on an AVX2-only
EPYC the default model's MLP matmul ran 6.3x slower in bf16 than in float32, and a whole server
several times slower (bench/results/cpu_dtype.md). So the launcher picks bf16 where the hardware
has it and float32 otherwise, unless the user said which (`--dtype`, or `SGLMEMORY_DTYPE` for
every server this environment starts, e.g. a test run forced to one dtype).

The KV cache follows the compute dtype (SGLang's `--kv-cache-dtype auto`): a float32 server keeps a
float32 pool. Decode on these CPUs is bound by reading the weights (2 GB a step for the 0.5B model
in float32), not its KV (60 MB at 2.5k tokens), the pool's size comes from a share of free RAM
either way, and a bf16 pool under float32 compute would round every key and value it stores, so
the float32 references (KEEP's full prefill, IntentKV's masked forward, an exact session restore)
would hold only approximately. The benchmark measures what a bf16 pool would save.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

ENV = "SGLMEMORY_DTYPE"  # forces the dtype of every server started from this environment
CHOICE_ENV = "SGLMEMORY_DTYPE_CHOICE"  # the launcher's choice, as JSON, for /sgl_memory/info
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of bf16 matmul in hardware
# torch's capabilities with 512-bit kernels; below them (AVX2, DEFAULT) its bf16 elementwise
# kernels convert through float32 whatever oneDNN does (ATEN_CPU_CAPABILITY lowers it)
WIDE_CAPABILITIES = ("AVX512", "AVX512_BF16", "AMX")
ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32", "float": "float32"}


class DtypeError(ValueError):
    """SGLMEMORY_DTYPE names no dtype."""


@dataclass(frozen=True)
class DtypeChoice:
    """What the server computes in and why; `source` is `auto`, `--dtype` or `SGLMEMORY_DTYPE`."""

    dtype: str
    kv_cache_dtype: str
    source: str
    reason: str
    cpu_capability: str = ""
    bf16_flags: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def log_line(self) -> str:
        return f"sgl-memory: compute dtype {self.dtype}, KV cache {self.kv_cache_dtype} ({self.source}: {self.reason})"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def bf16_flags(flags: set[str]) -> list[str]:
    """Which of the bf16-in-hardware flags the CPU has."""
    return sorted(f for f in BF16_FLAGS if f in flags)


def choose_auto(capability: str, flags: set[str]) -> DtypeChoice:
    """bf16 where the CPU multiplies it in hardware and torch runs its wide kernels, else float32."""
    have = bf16_flags(flags)
    if have and capability in WIDE_CAPABILITIES:
        reason = f"the CPU has {' and '.join(have)} (torch capability {capability}): bf16 matmuls run in hardware"
        dtype = "bfloat16"
    elif have:
        reason = (
            f"the CPU has {' and '.join(have)} but torch runs {capability} kernels: bf16 would convert through float32"
        )
        dtype = "float32"
    else:
        reason = f"no AMX or AVX512-BF16 (torch capability {capability}): bf16 would convert through float32"
        dtype = "float32"
    return DtypeChoice(dtype, dtype, "auto", reason, capability, have)


def choose(
    given: str | None = None, env: dict | None = None, capability: str | None = None, flags: set[str] | None = None
) -> DtypeChoice:
    """The dtype a CPU server runs in: `given` (the user's `--dtype`) first, then SGLMEMORY_DTYPE,
    then the CPU's choice. A value neither names nor aliases (`auto` for SGLang's own choice
    from the model's config, `half`, ...) passes through as given."""
    env = os.environ if env is None else env
    capability = cpu_capability() if capability is None else capability
    flags = cpu_flags() if flags is None else flags
    have = bf16_flags(flags)
    if given is not None:
        return DtypeChoice(given, given, "--dtype", "given on the command line", capability, have)
    forced = env.get(ENV, "").strip()
    if forced and forced != "auto":
        if forced not in ALIASES:
            raise DtypeError(f"{ENV}={forced!r}: allowed values are auto, {', '.join(sorted(ALIASES))}")
        return DtypeChoice(ALIASES[forced], ALIASES[forced], ENV, f"{ENV}={forced}", capability, have)
    return choose_auto(capability, flags)


def announced() -> DtypeChoice | None:
    """The choice the launcher of this server made (None for a server it did not start)."""
    raw = os.environ.get(CHOICE_ENV)
    return DtypeChoice(**json.loads(raw)) if raw else None
