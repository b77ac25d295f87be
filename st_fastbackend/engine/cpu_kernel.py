"""Our one C++ kernel: exact-softmax attention in bf16 over a packed batch, on CPUs with AMX
(csrc/amx_attention.cpp). It replaces the SDPA loop where attention runs in bf16 (a bf16 model, or an fp32
model whose products run in bf16): one parallel region per layer instead of one per run of equal lengths, q.k
and p.v on AMX tiles through PyTorch's own cpublas::brgemm (oneDNN), the softmax in fp32 with its
probabilities rounded to bf16 as PyTorch's flash kernel rounds them (eval/RESULTS.md, "2026-12-06").

Built at first use by torch.utils.cpp_extension (a C++ compiler and ninja; cached under TORCH_EXTENSIONS_DIR,
keyed by the source, this PyTorch and this CPU's flags since it is built with -march=native). Where it cannot
be built the SDPA loop runs, with one warning saying why; ST_FASTBACKEND_CPU_KERNEL=0 turns it off.
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

SOURCE = Path(__file__).with_name("csrc") / "amx_attention.cpp"
BLOCK = 64  # query rows per q.k product: 32-128 measured within 5% of each other
FLAGS = ["-O3", "-march=native", "-fopenmp", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]


def amx_capable() -> bool:
    """AMX tiles with bf16 and PyTorch's AVX-512 kernels in use (ATEN_CPU_CAPABILITY may lower them)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return amx and bf16 and torch.backends.cpu.get_cpu_capability() == "AVX512"


@functools.cache
def amx_attention() -> Callable | None:
    """attention(q, k, v, out, cu_seqlens, scale, causal, block), or None where it is off or cannot be built."""
    if os.environ.get("ST_FASTBACKEND_CPU_KERNEL") == "0" or not amx_capable():
        return None
    from torch.utils import cpp_extension

    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + _cpu_flags().encode()).hexdigest()[:12]
    try:
        module = cpp_extension.load(
            f"st_fastbackend_amx_attention_{key}", [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"]
        )
    except Exception as error:  # no compiler, no ninja, a PyTorch without these headers
        logger.warning("The AMX attention kernel could not be built (%s); attention runs through SDPA", error)
        return None
    return module.attention


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), part of the build's key: a cache shared by machines never hands one a
    binary built for another's instructions."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
