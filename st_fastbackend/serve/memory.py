"""Handing memory freed after a burst back to the system. glibc keeps freed memory in its arenas for reuse
(the tokenizer's thread and the worker's each have their own), so a server's RSS stays at its peak long
after the burst; malloc_trim(0) returns every arena's free pages (glibc >= 2.8). Elsewhere a no-op."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)


def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


_TRIM = _malloc_trim()
if _TRIM is None:
    logger.debug("No malloc_trim in this C library: memory freed after a burst stays with the allocator")


def release_memory() -> None:
    if _TRIM is not None:
        _TRIM(0)
