"""glibc's mmap threshold, fixed (sgl_memory/allocator.py): freed memory blocks of KV memory's size
go back to the system. A process makes and frees one 256 KiB tensor (glibc raises its threshold past
it), then keeps small tensors between 400 blocks of 256 KiB that it frees: with the dynamic
threshold the blocks came from the heap and their 100 MB stay in the process; with the threshold
fixed they were mapped and go back."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, torch
from sgl_memory.core.allocator import fix_mmap_threshold
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
torch.empty(64 << 10)  # 256 KiB made and freed
base = rss()
big, small = [], []
for _ in range(400):
    big.append(torch.ones(64 << 10))  # 256 KiB, touched
    small.append(torch.ones(16))  # kept between them
del big
print((rss() - base) >> 20)
"""


def kept_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_freed_blocks_go_back_to_the_system_with_the_threshold_fixed():
    plain, fixed = kept_mib("plain"), kept_mib("fixed")
    assert plain > 50, f"the dynamic threshold kept only {plain} MiB: the test no longer shows the effect"
    assert fixed < 16, f"{fixed} MiB of freed blocks stayed in the process"
