"""Make the pinned SGLang import and run on a CPU-only torch.

Two gaps exist on PyPI for CPU machines (measured on this project's CPU machines):
- PyPI's torchvision is a CUDA build; it fails to import next to CPU torch because the op schemas
  `torchvision::nms` / `torchvision::qnms` are missing. We define the schemas just before torchvision
  loads. Text models never call them.
- `sgl_kernel` has no CPU wheel. The CPU engine imports it but, for Llama/Qwen on `torch_native`,
  calls only `assign_req_to_token_pool_cpu`, which we provide in torch. Every other name resolves to
  a callable that raises, so an unexpected kernel call fails loudly instead of silently.

This module is activated from a `.pth` file so that SGLang's spawned scheduler and detokenizer
processes get it too (a monkeypatch in the launcher would never reach them). It installs a meta path
finder and does nothing else until `torchvision` or `sgl_kernel` is imported. It never shadows a real
install: with a CUDA torch it stays inert, and a real `sgl_kernel` is always preferred.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import types
import warnings
from pathlib import Path

PTH_NAME = "sgl_memory_cpu_compat.pth"
_DISABLE_ENV = "SGLMEMORY_NO_CPU_COMPAT"


def _torch_is_cpu_build() -> bool:
    import torch

    return torch.version.cuda is None and torch.version.hip is None and not torch.cuda.is_available()


def _real_spec(name: str, path=None):
    for finder in sys.meta_path:
        if isinstance(finder, _CompatFinder):
            continue
        find = getattr(finder, "find_spec", None)
        spec = find(name, path) if find else None
        if spec is not None:
            return spec
    return None


def register_torchvision_schemas() -> None:
    import torch

    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # already defined: a real CPU torchvision, or an earlier import attempt


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Write each request's newly allocated slots into its row of the slot map.

    Request i receives out_cache_loc[o_i : o_i + n_i] at positions [start_i, end_i), where
    n_i = end_i - start_i and o_i is the sum of the previous requests' n.
    """
    del pool_len  # the row stride is implicit in req_to_token's shape
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


class _MissingKernel:
    """A kernel (or a namespace of kernels, like `scalar_types`) that sgl_kernel would provide."""

    def __init__(self, qualname: str):
        self.__qualname__ = self.__name__ = qualname

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _MissingKernel(f"{self.__qualname__}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.__qualname__} is a CUDA/AMX kernel from sgl_kernel, which has no CPU build here; "
            "sgl-memory's CPU stub cannot run it. Use --attention-backend torch_native or sgl_memory_cpu."
        )


class _StubModule(types.ModuleType):
    """`sgl_kernel` or one of its submodules: every attribute is a raising kernel."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _MissingKernel(f"{self.__name__}.{attr}")


class _StubLoader(importlib.abc.Loader):
    """Loads the `sgl_kernel` stub: a package whose every attribute is a raising kernel, except
    `assign_req_to_token_pool_cpu`, ours in torch."""

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so `import sgl_kernel.x.y` resolves to stubs as well
        module.__version__ = "0.0.0+sgl_memory_cpu_stub"
        module.SGL_MEMORY_STUB = True
        return module

    def exec_module(self, module):
        if module.__name__ == "sgl_kernel":
            module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu


class _CompatFinder(importlib.abc.MetaPathFinder):
    """The meta path finder: registers the op schemas torchvision lacks before it loads next to a
    CPU torch, and serves the `sgl_kernel` stub where no real `sgl_kernel` is installed."""

    def __init__(self):
        self._cpu = None

    def _is_cpu(self) -> bool:
        if self._cpu is None:
            self._cpu = _torch_is_cpu_build()
        return self._cpu

    def find_spec(self, name, path=None, target=None):
        root = name.partition(".")[0]
        if root == "torchvision" and name == root and self._is_cpu():
            register_torchvision_schemas()
            return None  # the normal finders import the real torchvision
        if root == "sgl_kernel":
            parent = sys.modules.get("sgl_kernel")
            if name != root and not getattr(parent, "SGL_MEMORY_STUB", False):
                return None
            if name == root and (_real_spec(name, path) is not None or not self._is_cpu()):
                return None
            return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        return None


# SGLang modules that the CPU engine never uses warn at import that they need a GPU: three lines
# per process, nine on every start of a CPU server (they cannot fire on a GPU machine)
GPU_ONLY_WARNINGS = ("Only CUDA, .* support", "Triton is not supported on current platform")


def activate() -> None:
    """Install the finder once per process (called from the .pth)."""
    if os.environ.get(_DISABLE_ENV) == "1":
        return
    for message in GPU_ONLY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    if not any(isinstance(f, _CompatFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CompatFinder())


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def install_pth() -> Path:
    """Write the .pth into this interpreter's site-packages (idempotent)."""
    path = pth_path()
    line = "import sgl_memory.cpu_compat as _sgl_memory_cpu_compat; _sgl_memory_cpu_compat.activate()\n"
    if not path.exists() or path.read_text() != line:
        path.write_text(line)
    return path


if __name__ == "__main__":
    print(install_pth())
