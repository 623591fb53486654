"""The suite's servers, and the pool that starts them: no test module starts a server of its own.

A server is named by what makes it different (model, launch flags, memory config, environment);
`CATALOGUE` lists every one the suite uses, with the reason it is its own. Everything a test can
choose per request (a pruning budget or scorer, `top_k`, `recompute`, memory mode, SentenceKV's
overrides, a tenant of its own) it chooses per request on a shared server.

A test asks for a server through its fixture (`<name>_server`, made by conftest.py for every
name), and the pool plans from what the collected tests ask for, each test's fixture closure:

- it orders the tests so that those of one server run together (`ORDER`; tests that start no
  server first; a test marked `server(ends=NAME)` after every other test of that server);
- it starts a server when the first test that needs it is set up, and the next server the run
  will need beside it while fewer than `MAX_LIVE` are up (a start is mostly imports on one core,
  so it overlaps with the tests running on the other);
- it stops a server once no test left needs it, and a server a test stopped itself (a restart, a
  kill) is started again if a later test needs it, counted as another start;
- it refuses to start a server for a test that is not marked `server` (so `-m "not server"`
  starts nothing, and an unmarked server test fails loudly instead of slowing the unit tier).

At the end it reports the starts, their seconds, and each module's wall time (conftest.py).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench import harness
from sgl_memory import cpu_dtype, models
from sgl_memory.core.config import SessionSources, to_yaml
from sgl_memory.intent.settings import IntentConfig
from sgl_memory.keep.settings import KeepConfig
from sgl_memory.memart.settings import MemArtConfig
from sgl_memory.persist.settings import PersistConfig
from sgl_memory.sentencekv.settings import SentenceKVConfig

TEST_MODEL = "smollm2-135m-instruct"
# The dtype a server started without --dtype computes in: the launcher's choice for this CPU, or
# SGLMEMORY_DTYPE's (a whole suite run in one dtype). A persisted session restores exactly when
# the store keeps the pool's own dtype.
SERVER_DTYPE = cpu_dtype.choose().dtype
EXACT_QUANT = {"bfloat16": "bf16", "float32": "fp32"}[SERVER_DTYPE]
# A test server's KV pool unless its spec sets another size. The launcher's default sizes it from
# free RAM (about 55k tokens, 2.4 GB for the test model in float32): zero-filling that takes seconds
# of every start and RAM the server beside it may need; no test prompt comes near this.
POOL_TOKENS = 16384
# The 8-bit servers' pool in bytes: what POOL_TOKENS of the test model take in bf16, which holds
# twice the tokens at one byte a value
FP8_POOL_BYTES = 360 << 20
# Servers up at once beside the suite, those still starting included: a 0.5B server in float32
# takes 4-6 GB of the machine's 24, and two starts share its two cores.
MAX_LIVE = 2
# An AVX2-only CPU as torch and oneDNN see one when told to use no more: the launcher picks float32
# there by itself (tests/test_server_e2e.py checks it), so the float32 servers run as on such a CPU.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@dataclass(frozen=True)
class Spec:
    """One server of the suite. `config` is its memory config, `{dir}` standing for the server's
    own directory (its session store, traces, the files `prepare` writes before the start)."""

    why: str  # what it serves, and why it cannot be another server of the catalogue
    model: str = TEST_MODEL
    config: str = ""
    flags: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # set in the server's environment
    unset: tuple[str, ...] = ()  # removed from it
    plain: bool = False  # plain SGLang, our plugin not loaded: a reference
    prefix: tuple[str, ...] = ()  # before the command (a resource limit)
    dir_of: str | None = None  # runs in another server's directory (a restart on its store)
    prefetch: bool = True  # False: started only when a test asks for it (after something the test does)
    prepare: Callable[[Path], None] | None = None

    def command(self, directory: Path) -> tuple[list[str], dict]:
        env = {k: v for k, v in os.environ.items() if k not in self.unset} | dict(self.env)
        flags = list(self.flags)
        if not any(f.split("=")[0] in ("--max-total-tokens", "--kv-pool-bytes") for f in flags):
            flags += ["--max-total-tokens", str(POOL_TOKENS)]
        if self.plain:
            path = models.model_dir(self.model)
            command, plain_env = harness.plain_sglang(
                path, *harness.cpu_flags(path, "torch_native", POOL_TOKENS), *flags
            )
            return command, env | {k: plain_env[k] for k in ("SGLANG_USE_CPU_ENGINE", "SGLANG_PLUGINS")}
        # the session store a config leaves to its default (`plain`, `qwen`: the user's cache
        # directory) is the server's own, never the user's
        env["XDG_CACHE_HOME"] = str(directory / "cache")
        if self.config:
            (directory / "memory.yaml").write_text(self.config.replace("{dir}", str(directory)))
            flags = ["--memory-config", str(directory / "memory.yaml"), *flags]
        return [*self.prefix, *harness.our_command(self.model, *flags)], env


def _zero_head(directory: Path) -> None:
    """The learned pruner head as initialised, no training (intent's zero-init residual: it must keep
    the rule scorer's sets), for the float32 server's `intent.head`."""
    from transformers import AutoConfig

    from sgl_memory.intent.head import HeadShape, PrunerHead, backbone_spec

    spec = backbone_spec(AutoConfig.from_pretrained(models.model_dir(TEST_MODEL)))
    PrunerHead(HeadShape(spec["head_dim"])).save(directory / "zero_head.safetensors", spec)


# KV memory as the block-counting tests use it: 16-token blocks cut by tokens alone, placed alone,
# reused as placed (the tests that compare placed KV with its original ask for a repair by request)
BLOCKS = MemArtConfig(enabled=True, block_size=16, cut="tokens", unit="block", placed_tokens=0, recompute="none")
# Every mechanism on, in the dtype the launcher picks for this CPU. Intent's budget is above any
# test prompt (a test that prunes asks for its budget); SentenceKV's is the section's default.
ALL = to_yaml(
    IntentConfig(enabled=True, budget=100000, query_tail=16),
    replace(BLOCKS, top_k=4),
    PersistConfig(enabled=True, dir="{dir}/store", quant=EXACT_QUANT),
    SentenceKVConfig(enabled=True),
    sessions=SessionSources(tenant_header=True),
)


# The float32 references' server: intent with the rule scorer, its zero-init learned head and
# training traces; memory placed after the system message (KEEP's questions); KEEP with its
# traces; persistence (the memory entries survive a restart); the entries' grouping thresholds.
def fp32_config(
    budget: int = 4096, scorer: str = "memory", window: int = 0, plugins: tuple[str, ...] = (), raw: dict | None = None
) -> str:
    """The float32 servers' config, with a server's own intent budget and scorer, memory window, and
    plugin sections."""
    return to_yaml(
        IntentConfig(
            enabled=True,
            budget=budget,
            scorer=scorer,
            query_tail=16,
            sinks=4,
            budget_floor=32,
            budget_ceiling=512,
            head="{dir}/zero_head.safetensors",
            trace_dir="{dir}/intent-traces",
        ),
        replace(BLOCKS, top_k=8, placement="after_system", static_after=2, group_threshold=0.3, window=window),
        KeepConfig(enabled=True, trace_dir="{dir}/keep-traces"),
        PersistConfig(enabled=True, dir="{dir}/store", quant="fp32"),
        plugins=plugins,
        raw=raw,
    )


def tp_config(**persist: object) -> str:
    """The TP test's session at TP 1 and 2 (float32), with a server's own persistence settings."""
    return to_yaml(
        IntentConfig(enabled=True, budget=128, query_tail=16),
        PersistConfig(enabled=True, dir="{dir}/store", **persist),
        replace(BLOCKS, top_k=4, placement="after_system"),
        KeepConfig(enabled=True),
    )


TP_FLAGS = ("--dtype", "float32")
# One core per rank (the launcher's default split): an inherited binding would put both on one.
# And the CPU's own instruction set where a run emulates an AVX2-only CPU (AVX2_ONLY): at TP 2 the
# emulation crashes SGLang's vocab-parallel embedding on the first request (an index out of range
# from its torch.compile'd masked lookup; it runs with TORCHDYNAMO_DISABLE=1, and it crashes the same
# at d936d1e, before the pool). Taken for the emulation's (it limits torch's kernels, not the code
# inductor builds for this machine); no real AVX2-only CPU was at hand to check.
TP_UNSET = ("SGLANG_CPU_OMP_THREADS_BIND", *AVX2_ONLY)

CATALOGUE: dict[str, Spec] = {
    "plain": Spec(
        "the README's default way: our launcher, no memory config, so persistence on in the user's cache "
        "directory (end to end, hardening, the dtype report, the agent-ready default)"
    ),
    "all": Spec(
        "every mechanism on in one server, in the launcher's dtype: composed, memory, persistence, SentenceKV, "
        "determinism, replicas; tenants from x-tenant-id, the Responses API's store, one served model name "
        "for the router; the tree's integrity checked before every batch (SGLMEMORY_CHECK_INTEGRITY)",
        config=ALL,
        flags=("--enable-metrics", "--enable-response-store", "--served-model-name", "m"),
        env={"SGLMEMORY_CHECK_INTEGRITY": "1"},
    ),
    "fp32": Spec(
        "float32 references (transformers forwards, plain SGLang, the attention backend), as on an AVX2-only "
        "CPU: intent, KEEP, the memory entries",
        config=fp32_config(),
        flags=("--enable-metrics",),
        env=AVX2_ONLY,
        unset=(cpu_dtype.ENV,),
        prepare=_zero_head,
    ),
    "sglang": Spec(
        "plain SGLang (torch_native attention, float32): the reference our server must equal",
        plain=True,
        flags=("--dtype", "float32"),
    ),
    # the agent benchmark's sections (bench/agent/run.py; tests/test_agent.py checks them)
    "qwen": Spec(
        "the default model: the agent harness, its smoke tests, KV memory's default unit (lines)",
        model=models.DEFAULT_MODEL,
        config=to_yaml(IntentConfig(enabled=True, budget_floor=16), MemArtConfig(enabled=True), harness.PERSIST_OFF),
    ),
    "qwen_tp1": Spec(
        "the default model in float32 at TP 1: the TP test's reference (every head on one rank), and a "
        "session restored from disk in the default format (Q8; no warm tier: a restore reads the file)",
        model=models.DEFAULT_MODEL,
        config=tp_config(warm_bytes=0),
        flags=(*TP_FLAGS, "--tp-size", "1"),
        unset=TP_UNSET,
    ),
    "qwen_tp2": Spec(
        "tensor parallelism 2 (SmolLM2's 9 heads do not split in two); an exact store, which restores bit for bit",
        model=models.DEFAULT_MODEL,
        config=tp_config(quant="fp32"),
        flags=(*TP_FLAGS, "--max-total-tokens", "4096", "--tp-size", "2"),
        unset=TP_UNSET,
    ),
    "paged": Spec(
        "page size 16 (intent, memory and KEEP refuse pages): persistence's faults on an exact store with no "
        "warm tier and a small pool (eviction), SentenceKV at page size 16; prefills in chunks of 1,024 tokens "
        "(SGLang's CPU default, 4,096, is over this pool: a chunked prefill racing restores); the tree's "
        "integrity checked before every batch (SGLMEMORY_CHECK_INTEGRITY)",
        config=to_yaml(
            PersistConfig(enabled=True, dir="{dir}/store", quant=EXACT_QUANT, warm_bytes=0),
            SentenceKVConfig(enabled=True),
        ),
        flags=("--max-total-tokens", "3008", "--page-size", "16", "--chunked-prefill-size", "1024"),
        env={"SGLMEMORY_CHECK_INTEGRITY": "1"},
    ),
    "paged_limited": Spec(
        "a server started on the store of the paged one after it was killed mid-write, under a "
        "3 MB file-size limit (a full disk: a full block's file of this model is 5.9 MB in bf16)",
        config=to_yaml(PersistConfig(enabled=True, dir="{dir}/store", quant="bf16")),
        prefix=("prlimit", "--fsize=3000000", "--"),
        dir_of="paged",
        prefetch=False,
    ),
    "fp8": Spec(
        "an 8-bit KV pool (--kv-cache-dtype fp8_e4m3; a pool's dtype is fixed at its start), sized in bytes "
        "(--kv-pool-bytes), every mechanism on it: persistence with no warm tier (a restore reads the file into "
        "the 8-bit pool), intent pruning, KV memory placed after the system message, KEEP, SentenceKV; the "
        "tree's integrity checked before every batch (SGLMEMORY_CHECK_INTEGRITY)",
        config=to_yaml(
            IntentConfig(enabled=True, budget=100000, query_tail=16),
            replace(BLOCKS, top_k=4, placement="after_system"),
            KeepConfig(enabled=True),
            PersistConfig(enabled=True, dir="{dir}/store", warm_bytes=0),
            SentenceKVConfig(enabled=True),
        ),
        flags=("--kv-cache-dtype", "fp8_e4m3", "--kv-pool-bytes", str(FP8_POOL_BYTES)),
        env={"SGLMEMORY_CHECK_INTEGRITY": "1"},
    ),
    "pressure": Spec(
        "intent as the capacity lever, set as an operator sets it (`intent.when: pressure`), with persistence, on "
        "a pool a few prompts fill (1,536 tokens): a session served whole before the tree evicts, pruned after; "
        "the other intent servers prune always, and filling their pools takes a minute of prefill",
        config=to_yaml(
            IntentConfig(enabled=True, when="pressure", budget=64, budget_mode="history", query_tail=16),
            PersistConfig(enabled=True, dir="{dir}/store", quant=EXACT_QUANT),
        ),
        flags=("--max-total-tokens", "1536"),
    ),
}
CATALOGUE["int8"] = replace(
    CATALOGUE["fp8"],
    why="our int8 KV pool (--kv-cache-dtype int8: codes and a scale per token and head) with every mechanism on "
    "it, as `fp8` has SGLang's; in float32 (an AVX2-only CPU's choice, where the pool quarters the bytes a token "
    "takes), where KV memory copied out as values and placed back is the pool's own bytes again",
    flags=("--kv-cache-dtype", "int8", "--kv-pool-bytes", str(FP8_POOL_BYTES)),
    env={"SGLMEMORY_CHECK_INTEGRITY": "1", **AVX2_ONLY},
)
# A second process of a configuration, with a store of its own: a restart (sessions copied into its
# store, as a server that never saw them finds them on disk), the second replica behind the router,
# the second of two fresh servers.
CATALOGUE["all_b"] = replace(CATALOGUE["all"], why="a second server like `all`: restarts, replicas, determinism")
CATALOGUE["fp32_b"] = replace(
    CATALOGUE["fp32"],
    why="a second float32 server: the memory entries' restart, and what needs a setting of its own: "
    "memory.window (clients that resend the whole history), the toy plugin mechanism, the fuzzed request surface",
    # the toy's section as text: importing its class would register it in every test process
    config=fp32_config(
        96, "memory_pool", window=128, plugins=("toy_mechanism",), raw={"toy": {"enabled": True, "max_note": 8}}
    ),
    env=AVX2_ONLY
    | {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))},
)
CATALOGUE["qwen_tp2_b"] = replace(
    CATALOGUE["qwen_tp2"],
    why="the TP 2 server restarted on a copy of its store",
    flags=(*CATALOGUE["qwen_tp2"].flags, "--enable-metrics"),
    prefetch=False,
)

# The order the server tests run in, a group per server (a test runs with the first server it uses).
ORDER = (
    "qwen",
    "qwen_tp1",
    "qwen_tp2",
    "qwen_tp2_b",
    "sglang",
    "fp32",
    "fp32_b",
    "all",
    "all_b",
    "paged",
    "paged_limited",
    "plain",
    "fp8",
    "int8",
    "pressure",
)
assert set(ORDER) == set(CATALOGUE)


def fixture_name(name: str) -> str:
    return f"{name}_server"


def run_order(uses: list[frozenset[str]], ends: list[set[str]], order: tuple[str, ...] = ORDER) -> list[int]:
    """The order to run the collected tests in, as indices into the collection: grouped by the first
    server of `order` each uses (tests that use none first), the collection's order within a group;
    a test that ends a server (`server(ends=NAME)`) right after the last other test using it, and
    one that ends "*" last of all."""
    rank = {name: i for i, name in enumerate(order)}
    run = sorted(range(len(uses)), key=lambda i: (min((rank[n] for n in uses[i]), default=-1), i))
    for i in [i for i in run if ends[i]]:
        run.remove(i)
        users = [k for k, j in enumerate(run) if uses[j] & ends[i]]
        run.insert(users[-1] + 1 if users and "*" not in ends[i] else len(run), i)
    return run


@dataclass
class Start:
    name: str
    seconds: float  # spawn to /health
    waited: float  # of those, how long a test waited for it (the rest overlapped with tests)
    why: str  # first use, ahead (started while other tests ran), again (a test had stopped it)


class Pool:
    """Starts and stops the catalogue's servers for one test run (module docstring)."""

    def __init__(self, base: Path, catalogue: Mapping[str, Spec] = CATALOGUE, spawn=harness.spawn):
        self.base, self.catalogue, self.spawn = base, catalogue, spawn  # spawn(command, log, env) -> harness.Starting
        self.live: dict[str, harness.Server] = {}
        self.starting: dict[str, tuple[harness.Starting, bool]] = {}  # name -> (its start, started ahead of its test)
        self.needs: list[frozenset[str]] = []  # per test in run order, the servers it uses
        self.modules: list[str] = []  # per test in run order, its module
        self.index = -1  # the test being run
        self.marked = False  # whether that test is marked `server`
        self.started_once: set[str] = set()
        self.failed: dict[str, str] = {}  # name -> why its start failed (not tried again)
        self.starts: list[Start] = []
        self.left_alive: list[tuple[str, list]] = []  # processes a stop had to kill

    # --- planning ---------------------------------------------------------------------------------

    def plan(self, tests: list[tuple[str, frozenset[str]]]) -> None:
        """The run's tests in order: (module, the servers it uses)."""
        self.modules = [module for module, _ in tests]
        self.needs = [needs for _, needs in tests]

    def next_use(self, name: str, after: int) -> int | None:
        return next((i for i in range(after + 1, len(self.needs)) if name in self.needs[i]), None)

    # --- a test's life (conftest.py's hooks) ------------------------------------------------------

    def enter(self, index: int, marked: bool) -> None:
        self.index, self.marked = index, marked
        self._ahead(index)

    def leave(self, index: int) -> None:
        for name in list(self.live) + list(self.starting):
            if self.next_use(name, index) is None:
                self._stop(name)
        self._ahead(index + 1)

    def _ahead(self, first: int) -> None:
        """Start the servers the tests from `first` on need, in their order, while fewer than
        MAX_LIVE are up."""
        while len(self.live) + len(self.starting) < MAX_LIVE:
            upcoming = (
                (i, n)
                for i in range(max(first, 0), len(self.needs))
                for n in sorted(self.needs[i])
                if n not in self.live and n not in self.starting and self.catalogue[n].prefetch
            )
            i, name = next(upcoming, (None, None))
            if name is None:
                return
            self._spawn(name, ahead=i > self.index)

    # --- servers ---------------------------------------------------------------------------------

    def directory(self, name: str) -> Path:
        spec = self.catalogue[name]
        path = self.base / (spec.dir_of or name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _spawn(self, name: str, ahead: bool = False) -> None:
        """`ahead`: for a later test than the current one."""
        spec, directory = self.catalogue[name], self.directory(name)
        if spec.prepare is not None and name not in self.started_once:
            spec.prepare(directory)
        command, env = spec.command(directory)
        log = directory / f"{name}.{sum(s.name == name for s in self.starts)}.log"
        self.starting[name] = (self.spawn(command, log, env), ahead)

    def get(self, name: str) -> harness.Server:
        """The live server `name`, started (and waited for) if it is not up. A server the current
        test's fixtures do not name (asked for in the middle of a module: a restart) counts as used
        by the module's later tests: a module fixture may hold it for them."""
        if name not in self.catalogue:
            raise KeyError(f"no server {name!r} in tests/servers.py's catalogue")
        if 0 <= self.index < len(self.needs) and name not in self.needs[self.index]:
            for i in range(self.index + 1, len(self.needs)):
                if self.modules[i] == self.modules[self.index]:
                    self.needs[i] = self.needs[i] | {name}
        if not self.marked:
            raise RuntimeError(
                f"a test not marked `server` asked for server {name!r}: mark it (pytest.mark.server), so "
                "that `-m 'not server'` leaves it out, or do not start a server for it"
            )
        if name in self.failed:
            raise RuntimeError(f"server {name!r} failed to start earlier in this run:\n{self.failed[name]}")
        if name in self.live:
            if self.live[name].proc.poll() is None:
                return self.live[name]
            self._stop(name)  # it died under an earlier test (which failed for it): the next ones get a new one
        if name not in self.starting:
            self._make_room(name)
            self._spawn(name)
        starting, ahead = self.starting.pop(name)
        waiting = time.monotonic()
        try:
            server = starting.ready()
        except Exception as exc:
            starting.abandon()
            self.failed[name] = str(exc)[-4000:]
            raise
        server.dir = self.directory(name)
        why = "again" if name in self.started_once else "ahead" if ahead else "first use"
        self.starts.append(Start(name, server.start_seconds, time.monotonic() - waiting, why))
        self.started_once.add(name)
        self.live[name] = server
        return server

    def start_ahead(self, name: str) -> None:
        """Start `name` now without waiting for it, where it fits under MAX_LIVE: a test that will ask
        for it later (a restart after its current work) lets that work hide the start."""
        if name not in self.live and name not in self.starting and len(self.live) + len(self.starting) < MAX_LIVE:
            self._spawn(name, ahead=True)

    def _make_room(self, name: str) -> None:
        """Stop what the current test does not use until a start fits under MAX_LIVE."""
        current = self.needs[self.index] if 0 <= self.index < len(self.needs) else frozenset()
        while len(self.live) + len(self.starting) >= MAX_LIVE:
            spare = [n for n in [*self.starting, *self.live] if n not in current]
            if not spare:
                raise RuntimeError(
                    f"server {name!r} would be the {MAX_LIVE + 1}th up: this test uses {sorted(current)}"
                )
            self._stop(max(spare, key=lambda n: self.next_use(n, self.index) or len(self.needs)))

    def stop(self, which: str | harness.Server) -> list:
        """A test is done with a server before its module is (it restarts it, or reaps a server it
        killed): stop it now; the module's later tests no longer count as its users, and a later
        module that uses it starts it again. Returns the processes a SIGTERM left alive (killed)."""
        name = which if isinstance(which, str) else next((n for n, s in self.live.items() if s is which), None)
        if name is None:  # stopped already
            return []
        module = self.modules[self.index] if 0 <= self.index < len(self.modules) else None
        for i in range(self.index + 1, len(self.needs)):
            if self.modules[i] == module:
                self.needs[i] = self.needs[i] - {name}
        return self._stop(name)

    def _stop(self, name: str) -> list:
        if name in self.starting:
            self.starting.pop(name)[0].abandon()
            return []
        server = self.live.pop(name, None)
        if server is None:
            return []
        alive = harness.stop(server)
        if alive:
            self.left_alive.append((name, alive))
        return alive

    @staticmethod
    def copy_sessions(source: harness.Server, target: harness.Server, *tenants: str | None) -> None:
        """The tenants' session files from `source`'s store into `target`'s, where a server that never
        held those sessions finds them on disk, as a server restarted on the same store would."""
        from sgl_memory.persist.layout import digest

        for tenant in tenants:
            name = digest("tenant", tenant or "")
            shutil.copytree(source.dir / "store" / name, target.dir / "store" / name, dirs_exist_ok=True)

    def close(self) -> None:
        for name in list(self.starting) + list(self.live):
            self._stop(name)

    # --- the report --------------------------------------------------------------------------------

    def report(self) -> list[str]:
        total = sum(s.seconds for s in self.starts)
        waited = sum(s.waited for s in self.starts)
        lines = [f"server starts: {len(self.starts)}, {total:.0f} s in all, {waited:.0f} s of it waited for by tests"]
        lines += [f"  {s.name:14} {s.seconds:6.1f} s  waited {s.waited:6.1f} s  ({s.why})" for s in self.starts]
        lines += [f"  stopping {name} left processes alive (killed): {alive}" for name, alive in self.left_alive]
        return lines
