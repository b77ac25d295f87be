"""CPU matrix products through oneDNN on weights reordered once into its blocked layout.

Faster than PyTorch's default fp32 products on this project's CPUs, with activations computed inside the product
(eval/RESULTS.md, "2026-11-30 — CPU speed after moving matrix products to oneDNN"). An fp32 model multiplies in
bf16 (inputs and weight rounded to bf16, fp32 sums) where PyTorch's own setting allows fp32 products to
(torch.set_float32_matmul_precision("medium") or torch.backends.mkldnn.matmul.fp32_precision = "bf16") and the
CPU has bf16 dot products.
Which dtype the products run in is part of the engine's Runtime (engine/runtime.py); engine/layers.Linear
calls the functions here.
"""

from __future__ import annotations

import functools
import logging
import os
import platform

import psutil
import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

# transformers' activation name (config.hidden_act) -> the oneDNN post-op computing the same function
# (attribute, algorithm); equal to transformers' ACT2FN within 5e-7 (tests/engine/test_layers.py).
ACTIVATIONS = {
    "gelu": ("gelu", "none"),  # erf
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"),
    "relu": ("relu", ""),
    "silu": ("swish", ""),
    "swish": ("swish", ""),
    "tanh": ("tanh", ""),
    "sigmoid": ("sigmoid", ""),
}
PREPACK_ROWS = 4096  # the layout is chosen for products with about this many tokens

Packed = tuple[Tensor, Tensor | None]  # (weight in oneDNN's layout, bias), both in the product dtype


def product_dtype(weight_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype oneDNN multiplies a CPU weight of `weight_dtype` in: its own, or bf16 for fp32 where
    PyTorch's setting allows it and the CPU has bf16 dot products; None where oneDNN is not used for it (not
    x86-64, bf16 that oneDNN does not run, or fp32 where PyTorch's own products are faster: fp32_products())."""
    if weight_dtype not in onednn_dtypes():
        return None
    if weight_dtype == torch.float32 and bf16_products_allowed():
        return torch.bfloat16
    return None if weight_dtype == torch.float32 and not fp32_products() else weight_dtype


@functools.cache
def fp32_products() -> bool:
    """Whether fp32 products run through oneDNN: where PyTorch runs AVX-512 kernels. There oneDNN's reordered
    products were 1.1-1.2x PyTorch's own (MKL) on a Zen 4 (2026-11-30); on AVX2 (Zen 3) MKL's were 1.1-1.25x
    oneDNN's from 512 rows up, MiniLM 1.2x over Wikipedia paragraphs (eval/RESULTS.md, 2026-12-06 07:30).
    ST_FASTBACKEND_ONEDNN_FP32=1 or 0 in the environment says it for every model."""
    said = os.environ.get("ST_FASTBACKEND_ONEDNN_FP32", "")
    if said not in ("", "0", "1"):
        raise ValueError(f"ST_FASTBACKEND_ONEDNN_FP32={said!r}: 1 runs fp32 products in oneDNN, 0 in PyTorch")
    return said == "1" if said else torch.backends.cpu.get_cpu_capability() == "AVX512"


def bf16_products_allowed() -> bool:
    """PyTorch's own switch for fp32 products in bf16 on oneDNN (set by set_float32_matmul_precision
    ("medium")), honoured where the CPU multiplies bf16 natively (native_bf16); elsewhere the products stay fp32,
    exact, and faster."""
    if torch.backends.mkldnn.matmul.fp32_precision != "bf16" or torch.bfloat16 not in onednn_dtypes():
        return False
    if not native_bf16():
        _say_bf16_not_taken()
        return False
    return True


@functools.cache
def native_bf16() -> bool:
    """Whether the CPU has bf16 dot products (AVX512-BF16, which AMX CPUs have too). oneDNN also runs bf16 on other
    AVX-512 CPUs (onednn_dtypes), converting every element to fp32 first: there bf16 products of an fp32 model ran at
    0.33x its fp32 products (MiniLM on an Ice Lake Xeon, eval/RESULTS.md 2026-12-07), so they are not taken."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@functools.cache
def _say_bf16_not_taken() -> None:
    """Once per process."""
    logger.info("fp32 products stay fp32: torch's fp32_precision 'bf16' is taken only where the CPU has bf16 dot "
                "products (AVX512-BF16 or AMX), and this one converts bf16 to fp32 first.")  # fmt: skip


@functools.cache
def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """Where the oneDNN path was measured: x86-64 CPUs; bf16 only where oneDNN runs it natively (it
    refuses bf16 without AVX-512 or AVX-NE-CONVERT)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def prepack(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Packed:
    """(weight, bias) in `dtype`, the weight reordered into oneDNN's layout."""
    weight = weight.detach().to(dtype).contiguous()
    bias = None if bias is None else bias.detach().to(dtype).contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(weight, PREPACK_ROWS), bias


def product(x: Tensor, packed: Packed, activation: str | None = None, multiply: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias in the packed dtype (x is cast to it, and so is the result); then an activation
    (a key of ACTIVATIONS) or a product with `multiply`, inside the same kernel: no second pass."""
    if x.dim() != 2:  # [..., in] -> [T, in], and the result back to [..., out]
        flat = None if multiply is None else multiply.reshape(-1, multiply.shape[-1])
        return product(x.reshape(-1, x.shape[-1]), packed, activation, flat).unflatten(0, x.shape[:-1])
    weight, bias = packed
    rows = x.shape[0]
    x = padded(x, weight.dtype)  # [product_rows(T), in]
    if multiply is not None:
        out = torch.ops.mkldnn._linear_pointwise.binary(x, padded(multiply, weight.dtype), weight, bias, "mul")
    else:
        attr, algorithm = ACTIVATIONS[activation] if activation is not None else ("none", "")
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
    return out if out.shape[0] == rows else out[:rows]  # [product_rows(T), out] -> [T, out]


def product_rows(rows: int) -> int:
    """`rows` as it stands from 2 to 15 (one row as two), then rounded up to one of a few sizes: a multiple of 16 up
    to 128, then 8 sizes per doubling (at most 12.5% more rows). oneDNN compiles a primitive per product shape and
    keeps it, ~0.4-0.6 MB each with PyTorch's own cache of their descriptors, up to 1,024 shapes in each cache:
    packs of every token count filled them (RSS +700 MB over 1,200 small encode calls, eval/bench_memory.py). With
    these sizes a product has at most 70 shapes up to 8,192 tokens. A row's result does not depend on the rows
    around it (tests/engine/test_layers.py), so the zero rows added change no number; but oneDNN multiplies one row
    alone with other sums (a matrix-vector kernel: up to 1e-4 apart at 1,536 inputs with unit-variance weights, 1e-6
    with nn.Linear's initialization), so it gets a second. Below 16 rows nothing is added: a short text's pack is as
    many rows as it has tokens, 3.8-4.4 ms per one-text call of all-MiniLM-L6-v2 against 5.1-5.5 ms padded to 16
    (eval/RESULTS.md, 2026-12-08)."""
    if rows < 16:
        return 2 if rows == 1 else rows
    step = max(16, 1 << max(0, (rows - 1).bit_length() - 4))
    return -(-rows // step) * step


def padded(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x [T, n] in `dtype`, with rows appended up to product_rows(T). Where x is already in `dtype` and the
    first T rows of a buffer with room for the rest (a product's own output, as the MLP's first product
    hands it to the second; attention's output, engine/attention.py), the buffer's next rows as they stand:
    no copy. Else one copy, with zero rows appended. The appended rows' values change no number of x's rows
    (a row's result does not depend on the rows around it, tests/engine/test_layers.py), whatever they hold."""
    rows = product_rows(x.shape[0])
    if rows == x.shape[0]:
        return x.to(dtype)
    if x.dtype == dtype and has_room(x, rows):
        return x.as_strided((rows, x.shape[1]), x.stride())  # [T, n] -> [rows, n], the same storage
    out = x.new_empty((rows, x.shape[1]), dtype=dtype)
    out[: x.shape[0]] = x
    out[x.shape[0] :] = 0
    return out


def has_room(x: Tensor, rows: int) -> bool:
    """Whether x [T, n] is contiguous and its storage goes on for `rows` rows of n from where x begins."""
    end = (x.storage_offset() + rows * x.shape[1]) * x.element_size()
    return x.is_contiguous() and end <= x.untyped_storage().nbytes()


def with_room(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An empty [T, ...] tensor like `like` that is the first T rows of a buffer of product_rows(T) rows, the
    rest zero: a result that a product multiplies next without padded()'s copy."""
    rows = product_rows(shape[0])
    buffer = like.new_empty((rows, *shape[1:]))
    buffer[shape[0] :] = 0
    return buffer[: shape[0]]


def copies_fit(engine: nn.Module) -> bool:
    """Whether the reordered copies kept beside the matrix weights take at most a quarter of the memory available
    now: a large model on a small machine keeps PyTorch's default products instead. A copy in the weight's own
    dtype replaces the weight (engine/layers.Linear gives the weight back once it is copied), so only a copy in
    another dtype (bf16 products of fp32 weights) counts; the engine's layers are copied one at a time."""
    layers = [m for m in engine.modules() if isinstance(m, nn.Linear)]
    kept = [m.weight for m in layers if product_dtype(m.weight.dtype) not in (None, m.weight.dtype)]
    size = sum(weight.numel() * product_dtype(weight.dtype).itemsize for weight in kept)
    fits = size <= free_memory_bytes() / 4
    if not fits:
        logger.info(f"Weight copies of {size / 2**30:.1f} GiB: no reordered copies for oneDNN (memory).")
    return fits


def free_memory_bytes() -> int:
    return psutil.virtual_memory().available
