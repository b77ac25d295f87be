"""Our C++ kernels for x86-64 CPUs with AVX2 or AVX-512 (csrc/): exact-softmax attention over a whole packed batch
in fp32, and in bf16 where the CPU has bf16 dot products (csrc/attention.cpp), and the passes around int8 products
(csrc/quantize.cpp, engine/quantize.py). Attention replaces the SDPA loop (engine/attention.py) for attention
without a prefix, unattended tokens or a window that cuts: one parallel region per layer instead of one per run of
equal lengths, q.k and p.v through PyTorch's own cpublas::brgemm (oneDNN), the softmax in fp32 (eval/RESULTS.md,
"2026-12-06 — one attention kernel per layer on the CPU").

Built at first use by torch.utils.cpp_extension (a C++ compiler and ninja; ~30 s), cached under TORCH_EXTENSIONS_DIR
(default ~/.cache/torch_extensions) in a folder keyed by the sources, this PyTorch and Python, this CPU's flags and
the build's (-march=native, PyTorch's vector width here: AVX2 or AVX512). Where it cannot be built the SDPA loop
and PyTorch's own int8 passes run, after one warning that says why; ST_FASTBACKEND_CPU_KERNEL=0 turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from st_fastbackend.engine import onednn

logger = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).with_name("csrc").glob("*.cpp")))
BLOCK = 64  # query rows per q.k product: 32 to 128 measured within 5% of each other
STALE_LOCK_SECONDS = 600
FLAGS = ["-O3", "-march=native", "-fopenmp"]
CAPABILITIES = ("AVX2", "AVX512")  # PyTorch's vector widths the kernel is built for


@functools.cache
def dtypes() -> tuple[torch.dtype, ...]:
    """What the kernel runs here: fp32 where PyTorch runs its AVX2 or AVX-512 kernels (ATEN_CPU_CAPABILITY may lower
    them), bf16 too where they are AVX-512 and the CPU has bf16 dot products (AVX512-BF16 or AMX: oneDNN's brgemm
    runs bf16 on either; MiniLM's attention over 256 paragraphs 1.4x as fast as in fp32 on a Zen 4 without AMX).
    Read once per process (attention asks at every layer)."""
    if os.environ.get("ST_FASTBACKEND_CPU_KERNEL") == "0" or _capability() not in CAPABILITIES:
        return ()
    return (torch.float32, torch.bfloat16) if _capability() == "AVX512" and onednn.native_bf16() else (torch.float32,)


def attention_dtype(dtype: torch.dtype, products: torch.dtype) -> torch.dtype | None:
    """The dtype the kernel takes attention in for a model in `dtype` whose products run in `products`: the
    products' where it runs them, else the model's (bf16 products of an fp32 model where it runs fp32 only:
    attention stays fp32), else None."""
    return next((t for t in (products, dtype) if t in dtypes()), None)


def attention_for(dtype: torch.dtype | None) -> Callable | None:
    """attention(q, k, v, out, cu_seqlens, scale, causal, block, bf16) whose products run in `dtype` here, or None
    (bf16: of bf16 tensors, or of fp32 ones rounded as they are read)."""
    module = _build() if dtype in dtypes() else None
    return None if module is None else module.attention


def int8_passes() -> ModuleType | None:
    """The module whose quantize_static, quantize_rows and dequantize run the passes around int8 products, where it
    is built here; else None."""
    return _build() if dtypes() else None


@functools.cache
def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    sources = {path.name: path.read_bytes() for path in SOURCES}
    flags = [*FLAGS, f"-DCPU_CAPABILITY={_capability()}", f"-DCPU_CAPABILITY_{_capability()}"]
    identity = b"".join(sources.values()) + f"{torch.__version__} {sys.version} {_cpu_flags()} {flags}".encode()
    name = f"st_fastbackend_kernels_{hashlib.sha256(identity).hexdigest()[:12]}"
    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for file, source in sources.items():  # one path for every checkout: ninja rebuilds where a path changes
            if not (folder / file).exists() or (folder / file).read_bytes() != source:
                (folder / file).write_bytes(source)
        _clear_stale_lock(folder / "lock")
        module = cpp_extension.load(
            name, [str(folder / file) for file in sources], extra_cflags=flags, extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
        )  # fmt: skip
    except Exception as error:  # no compiler, no ninja, a PyTorch without these headers, a read-only cache
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        logger.warning("The CPU kernels could not be built (%s); attention runs through SDPA, int8's passes through "
                       "PyTorch", reason)  # fmt: skip
        return None
    return module


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def _clear_stale_lock(lock: Path) -> None:
    """A build killed half-way leaves cpp_extension's lock file behind, and every later load would wait on it
    forever: one older than STALE_LOCK_SECONDS (a build takes ~30 s) is removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("Removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), part of the build's key: a cache shared by machines never hands one a
    binary built for another's instructions."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""
