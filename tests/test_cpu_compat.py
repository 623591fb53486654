"""The CPU work-arounds: they activate in fresh interpreters (as SGLang's spawned children are),
and step aside for a real sgl_kernel."""

import os
import subprocess
import sys
import textwrap

import torch

from sgl_memory import cpu_compat


def run_py(code, env_extra=None, cwd=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=cwd
    )


def test_assign_req_to_token_pool_matches_elementwise_reference():
    g = torch.Generator().manual_seed(0)
    pool_len = 64
    req_to_token = torch.zeros(8, pool_len, dtype=torch.int32)
    rows = torch.tensor([5, 0, 3])
    starts = torch.tensor([0, 10, 63])
    ends = torch.tensor([7, 30, 64])
    total = int((ends - starts).sum())
    out = torch.randint(1, 10_000, (total,), generator=g, dtype=torch.int64)

    expected = req_to_token.clone()
    k = 0
    for r, s, e in zip(rows.tolist(), starts.tolist(), ends.tolist()):
        for pos in range(s, e):
            expected[r, pos] = int(out[k])
            k += 1
    cpu_compat.assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, out, pool_len)
    assert torch.equal(req_to_token, expected)


def test_pth_is_installed_in_this_environment():
    assert cpu_compat.pth_path().is_file()


def test_fresh_interpreter_gets_stub_sgl_kernel_and_importable_torchvision():
    r = run_py(
        """
        import sgl_kernel, torchvision
        from sgl_kernel.scalar_type import scalar_types
        assert sgl_kernel.SGL_MEMORY_STUB
        assert callable(sgl_kernel.assign_req_to_token_pool_cpu)
        try:
            sgl_kernel.silu_and_mul(1)
        except NotImplementedError as e:
            print("raised:", e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "raised: sgl_kernel.silu_and_mul is a CUDA/AMX kernel" in r.stdout


def test_without_the_workaround_torchvision_does_not_import():
    # Shows the work-around is what makes the CUDA torchvision import next to CPU torch.
    r = run_py("import torchvision", {"SGLMEMORY_NO_CPU_COMPAT": "1"})
    assert r.returncode != 0 and "torchvision::nms" in r.stderr


def test_a_real_sgl_kernel_is_never_shadowed(tmp_path):
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    (pkg / "ops.py").write_text("X = 1\n")
    r = run_py(
        "import sgl_kernel, sgl_kernel.ops; "
        "print(sgl_kernel.REAL, sgl_kernel.ops.X, hasattr(sgl_kernel, 'SGL_MEMORY_STUB'))",
        {"PYTHONPATH": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "1", "False"]
