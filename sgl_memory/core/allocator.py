"""glibc's allocator, told to give large blocks back to the system.

glibc serves an allocation of at least M_MMAP_THRESHOLD bytes with a mapping of its own, unmapped
on free. By default the threshold is dynamic: freeing such a chunk raises it to the chunk's size
(up to 32 MiB), and from then on blocks of that size come from the heap and the per-thread arenas,
where freed memory mostly stays with the process. KV memory makes and frees such blocks all the
time (a block's keys and values, 100 KB to 1 MB each; pools dropped and rebuilt under
`memory.pool_bytes`), and the scheduler's RSS kept climbing with the pools at their cap. Setting
the threshold explicitly turns the adjustment off. Measured by `scripts/soak.py` (docs/security.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 << 10  # glibc's default starting value, kept fixed


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fix this process's mmap threshold at `nbytes`; False where the C library has no mallopt
    (not glibc) or refuses."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, nbytes))
    if not done:
        logger.warning("mallopt(M_MMAP_THRESHOLD, %d) refused: freed memory blocks may stay in the process", nbytes)
    return done
