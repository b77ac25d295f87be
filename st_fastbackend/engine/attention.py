"""One attention function over packed sequences, three kernels behind the same signature.

q: [T, Hq, D], k and v: [T, Hkv, D] (grouped-query: Hq is a multiple of Hkv) -> [T, Hq, D].
`window` is Hugging Face's `sliding_window`: a query sees itself and the `window - 1` tokens
before it (transformers `sliding_window_overlay`: kv_idx > q_idx - window).
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.layers import bf16_products_allowed

Kernel = Literal["flash_attn", "torch_varlen", "sdpa_loop"]
KERNELS: tuple[Kernel, ...] = ("flash_attn", "torch_varlen", "sdpa_loop")


def pick_kernel(device: torch.device) -> Kernel:
    """flash-attn's varlen kernel on CUDA when installed, else PyTorch's own; SDPA per sequence elsewhere."""
    if device.type != "cuda":
        return "sdpa_loop"
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attn"
    return "torch_varlen"


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, *, causal: bool, window: int | None, kernel: Kernel
) -> Tensor:
    if kernel == "sdpa_loop":
        if q.dtype == torch.float32 and bf16_products_allowed():
            # An fp32 model whose products run in bf16 (engine/layers.Linear): attention's two products
            # too, through the bf16 kernel (PyTorch's fp32 one slows down 4x under that setting here).
            return _sdpa_loop(q.bfloat16(), k.bfloat16(), v.bfloat16(), batch, causal=causal, window=window).float()
        return _sdpa_loop(q, k, v, batch, causal=causal, window=window)
    left = window - 1 if window is not None else -1  # both CUDA kernels count the window without the query
    window_size = (left, 0 if causal else -1)
    if kernel == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        cu, n = batch.cu_seqlens, batch.max_seqlen
        return flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=causal, window_size=window_size)
    if kernel == "torch_varlen":
        return _torch_varlen(q, k, v, batch, causal=causal, window_size=window_size)
    raise ValueError(f"Unknown attention kernel {kernel!r}; expected one of {KERNELS}.")


def _torch_varlen(q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, *, causal: bool, window_size) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu, n = batch.cu_seqlens, batch.max_seqlen
    grouped = q.shape[1] != k.shape[1]
    if "window_size" in inspect.signature(varlen_attn).parameters:  # torch >= 2.12
        return varlen_attn(q, k, v, cu, cu, n, n, window_size=window_size, enable_gqa=grouped)
    # Older releases take is_causal, no window and no grouped heads. Where the window changes the
    # result (a sequence longer than it), each sequence runs through SDPA with its own window mask.
    if window_size[0] != -1 and n > window_size[0] + 1:
        return _sdpa_loop(q, k, v, batch, causal=causal, window=window_size[0] + 1)
    if grouped:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu, cu, n, n, is_causal=causal)


def _sdpa_loop(q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, *, causal: bool, window: int | None) -> Tensor:
    """One SDPA call per run of adjacent equal-length sequences (packs are sorted by length, so runs are
    long): [n*L, H, D] is viewed as [n, H, L, D] without a copy. 4-D inputs reach PyTorch's flash kernel
    for the CPU; 3-D inputs would fall back to the slower math kernel."""
    out = torch.empty_like(q)
    grouped = q.shape[1] != k.shape[1]
    start = 0
    for length, count in _equal_length_runs(batch.lengths):
        end = start + length * count
        # [n*L, H, D] -> [n, L, H, D] -> [n, H, L, D]
        qi, ki, vi = (t[start:end].view(count, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        mask = None
        if window is not None and length > window:
            mask = _sliding_window_mask(length, window, q.device)
        oi = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=grouped
        )
        out[start:end].view(count, length, q.shape[1], q.shape[2]).copy_(oi.transpose(1, 2))  # -> [n, L, H, D]
        start = end
    return out


def _equal_length_runs(lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """(length, count) for each run of adjacent sequences of the same length."""
    runs: list[tuple[int, int]] = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


def _sliding_window_mask(length: int, window: int, device: torch.device) -> Tensor:
    """[L, L] bool, True where a query may attend: causal and within the window (one sequence, never T x T)."""
    q_idx = torch.arange(length, device=device)[:, None]
    kv_idx = torch.arange(length, device=device)[None, :]
    return (kv_idx <= q_idx) & (kv_idx > q_idx - window)
