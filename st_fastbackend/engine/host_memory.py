"""How the process's C allocator treats the engine's freed activations on the CPU.

glibc's malloc gives a freed block above its mmap threshold (128 KiB, raised as such blocks are freed, to 32 MiB at
most) back to the system at once, and trims its heap's top past twice that. A pack's activations (MiniLM: 2 to 30 MB
each; int8 products add passes of their own) were then mapped again, and faulted in page by page, at every layer:
for 160 Wikipedia paragraphs ~1.1 million page faults in fp32 (2.1 s instead of 1.7) and ~400,000 in int8 (~40% of
its time) (eval/RESULTS.md, 2026-12-02). With the thresholds below, freed activations stay in the process for the
next pass, up to TRIM_BYTES of them (mallopt(3)); resident memory over 1,200 server-like calls grew 3 MiB more
(MiniLM) and 22 MiB more (the small Mistral).
"""

from __future__ import annotations

import ctypes
import functools
import platform

MMAP_BYTES, TRIM_BYTES = 256 << 20, 512 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


@functools.cache
def keep_freed_memory() -> None:
    """Once per process, when a model is set up on the CPU: glibc's thresholds above for the whole process (every
    model in it gains, plain sentence-transformers' too; its resident memory can stay up to TRIM_BYTES above what
    it uses). Nothing elsewhere (musl, macOS, Windows)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)
