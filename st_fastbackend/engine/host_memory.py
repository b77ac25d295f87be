"""How the process's C allocator treats the engine's freed activations on the CPU, and handing freed memory back.

glibc's malloc gives a freed block above its mmap threshold (128 KiB, raised as such blocks are freed, to 32 MiB at
most) back to the system at once, and gives back the free top of its heap once that passes twice the threshold. A
pack's activations (megabytes each; int8 products add passes of their own) were then mapped again, and faulted in
page by page, at every layer: a visible part of an fp32 pass and a large one of an int8 pass (eval/RESULTS.md,
"2026-12-02 05:10 — int8 products"; its figures, and the resident memory the thresholds cost a server, in
"2026-12-02 06:28–07:14"). With the thresholds below (mallopt(3)) a freed block of up to MMAP_BYTES stays in the
heap for the next pass, and a heap's free top is given back only past TRIM_BYTES.

A thread other than the main one allocates from an arena of its own made of 64 MiB heaps: there a block of 64 MiB or
more is still mapped at each allocation.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)
MMAP_BYTES, TRIM_BYTES = 256 << 20, 512 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
# How a user sets glibc's malloc for a process: theirs is kept.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def keep_freed_memory() -> None:
    """Once per process, at the first pack run on a CPU: glibc's thresholds above for the whole process (every model
    in it gains, plain sentence-transformers' too). Not where the environment sets glibc's malloc itself
    (USER_SETTINGS, or glibc.malloc tunables in GLIBC_TUNABLES), and nothing elsewhere (musl, macOS, Windows)."""
    libc = _glibc()
    if libc is None:
        return
    if any(name in os.environ for name in USER_SETTINGS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return
    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)


def release_memory() -> None:
    """Every arena's free pages back to the system (malloc_trim(0), glibc >= 2.8), what the thresholds above keep
    included: the server calls it once a burst has ended, so its resident memory does not stay at the burst's peak
    (glibc keeps freed memory in its arenas, and the tokenizer's thread and the worker's each have their own).
    Nothing elsewhere."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (Linux); None elsewhere (musl, macOS, Windows)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        logger.debug("Not glibc: its malloc thresholds are not set, and memory freed after a burst stays allocated")
        return None
    return ctypes.CDLL(None)
