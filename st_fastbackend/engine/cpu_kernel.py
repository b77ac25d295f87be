"""Our one C++ kernel: exact-softmax attention over a whole packed batch on x86-64 CPUs with AVX-512, in fp32, and
in bf16 where the CPU has AMX (csrc/attention.cpp). It replaces the SDPA loop (engine/attention.py) for attention
without a prefix, unattended tokens or a window that cuts: one parallel region per layer instead of one per run of
equal lengths, q.k and p.v through PyTorch's own cpublas::brgemm (oneDNN), the softmax in fp32 (eval/RESULTS.md,
"2026-12-06 — one attention kernel per layer on the CPU").

Built at first use by torch.utils.cpp_extension (a C++ compiler and ninja), cached under TORCH_EXTENSIONS_DIR and
keyed by the source, this PyTorch and this CPU's flags (it is built with -march=native). Where it cannot be built
the SDPA loop runs, after one warning that says why; ST_FASTBACKEND_CPU_KERNEL=0 turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "attention.cpp"
BLOCK = 64  # query rows per q.k product: 32 to 128 measured within 5% of each other
FLAGS = ["-O3", "-march=native", "-fopenmp", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]


def dtypes() -> tuple[torch.dtype, ...]:
    """What the kernel runs here: fp32 where PyTorch runs its AVX-512 kernels (ATEN_CPU_CAPABILITY may lower them),
    bf16 too where the CPU has AMX tiles for it."""
    if os.environ.get("ST_FASTBACKEND_CPU_KERNEL") == "0" or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return ()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return (torch.float32, torch.bfloat16) if amx and bf16 else (torch.float32,)


def attention_for(dtype: torch.dtype) -> Callable | None:
    """attention(q, k, v, out, cu_seqlens, scale, causal, block) for `dtype` here, or None."""
    return _build() if dtype in dtypes() else None


@functools.cache
def _build() -> Callable | None:
    from torch.utils import cpp_extension

    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + _cpu_flags().encode()).hexdigest()[:12]
    try:
        module = cpp_extension.load(
            f"st_fastbackend_attention_{key}", [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"]
        )
    except Exception as error:  # no compiler, no ninja, a PyTorch without these headers
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        logger.warning("The CPU attention kernel could not be built (%s); attention runs through SDPA", reason)
        return None
    return module.attention


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), part of the build's key: a cache shared by machines never hands one a
    binary built for another's instructions."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""
