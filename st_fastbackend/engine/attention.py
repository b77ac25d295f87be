"""One attention function over packed sequences, four kernels behind the same signature.

q: [T, Hq, D], k and v: [T, Hkv, D] (grouped-query: Hq is a multiple of Hkv) -> [T, Hq, D].
`window`: a query sees the keys of its sequence less than `window` positions away. Causal, that is
Hugging Face's `sliding_window` (itself and the `window - 1` tokens before it: transformers
`sliding_window_overlay`, kv_idx > q_idx - window); bidirectional, `window - 1` tokens on each side
(|q_idx - kv_idx| < window: Gemma 3's `_bidirectional_window_overlay`; ModernBERT's
`sliding_window_bidirectional_overlay` with window = local_attention // 2 + 1). `scale` multiplies
q.k (None: 1/sqrt(head_dim)). Which kernel runs, and what it accepts, is the Runtime decided once per
device and dtype (engine/runtime.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from st_fastbackend.engine import cpu_kernel, onednn
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.runtime import VARLEN_KERNELS, Runtime
from st_fastbackend.engine.spec import UnsupportedModelError


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    batch: PackedBatch,
    *,
    causal: bool,
    window: int | None,
    runtime: Runtime,
    scale: float | None = None,
    keys: tuple[Tensor, int] | None = None,
) -> Tensor:
    """`keys`: (cu_seqlens, max_seqlen) of k and v where they are not the queries' (texts after a prompt
    computed once: engine/prefix.py), causal only; both kernels align a shorter query sequence with the end
    of its keys (flash-attn >= 2.1's rule, which PyTorch's copy of the kernel follows)."""
    if batch.attended is not None:  # tokens that attend but are not attended to (ColBERT's query expansion)
        if causal or keys is not None:
            raise UnsupportedModelError("Unattended tokens (query_expansion attend=False) with causal attention")
        if window_cuts(window, batch.max_seqlen) or not kernel_takes(q, runtime, cuts=False):  # masks per run
            return sdpa_attention(q, k, v, batch, causal=False, window=window, runtime=runtime, scale=scale)
        keep, cu_attended, longest = batch.attended_keys
        k, v, keys, window = k[keep], v[keep], (cu_attended, longest), None
    cu, n = batch.cu_seqlens, batch.max_seqlen
    cu_k, n_k = keys if keys is not None else (cu, n)
    cuts = window_cuts(window, n_k)
    if keys is None and not kernel_takes(q, runtime, cuts):
        return sdpa_attention(q, k, v, batch, causal=causal, window=window, runtime=runtime, scale=scale)
    if not runtime.grouped_heads:
        k, v = _repeat_kv(k, v, q.shape[1])
    side = window - 1 if window is not None and cuts else -1  # both kernels count the window without the query
    window_size = (side, 0) if causal else (side, side)
    if runtime.kernel == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        options = dict(softmax_scale=scale, causal=causal)
        if runtime.window:  # flash-attn >= 2.3
            options["window_size"] = window_size
        return flash_attn_varlen_func(q, k, v, cu, cu_k, n, n_k, **options)
    from torch.nn.attention.varlen import varlen_attn

    options: dict = {}
    if scale is not None and runtime.scale:
        options["scale"] = scale
    elif scale is not None:  # PyTorch 2.10 has no `scale`: the same logits from a rescaled q
        q = q * (scale * q.shape[-1] ** 0.5)
    if runtime.window:  # (-1, 0) is causal attention, (left, 0) causal within a window, (w, w) symmetric
        options["window_size"] = window_size
    if runtime.is_causal:
        options["is_causal"] = causal
    if runtime.ask_grouped and q.shape[1] != k.shape[1]:
        options["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu_k, n, n_k, **options)


def window_cuts(window: int | None, longest_keys: int) -> bool:
    """Whether a window changes some sequence's result: it does only where a sequence has more keys than it."""
    return window is not None and longest_keys > window


def kernel_takes(q: Tensor, runtime: Runtime, cuts: bool, longer_keys: bool = False) -> bool:
    """Whether the runtime's varlen kernel computes this attention: it is a GPU's varlen kernel, it has a window where
    the window cuts, it takes the head size (mha_varlen_fwd: at most 256, and a multiple of 8 under PyTorch's
    varlen_attn; flash-attn's Python function pads other sizes itself), and where the keys are longer than the
    queries it aligns them with the keys' end."""
    head_dim = q.shape[-1]
    return (
        runtime.kernel in VARLEN_KERNELS
        and (runtime.window or not cuts)
        and head_dim <= 256
        and (head_dim % 8 == 0 or runtime.kernel == "flash_attn")
        and (runtime.longer_keys or not longer_keys)
    )


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, *, causal: bool, window: int | None, runtime: Runtime,
    scale: float | None = None, prefix: tuple[Tensor, Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """Our CPU kernel's one call for the whole pack where the runtime has it and it takes this attention (no prefix,
    no unattended tokens, no window that cuts, a head size that is a multiple of 16: engine/cpu_kernel.py); else
    attention through SDPA, one call per run of adjacent equal-length sequences (packs are sorted by
    length, so runs are long): [n*L, H, D] is viewed as [n, H, L, D] without a copy; 4-D inputs reach
    PyTorch's flash kernel for the CPU, 3-D inputs would fall back to the slower math kernel.

    `prefix`: keys and values [P, Hkv, D] that every sequence follows (engine/prefix.py); each run's
    keys are [prefix ; its own] and its queries sit at positions P to P + L - 1.

    An fp32 model whose products run in bf16 (engine/onednn.py) runs attention's two products in bf16
    too (PyTorch's fp32 kernel slows down 4x under that setting here): in our kernel from the fp32 tensors, rounded
    as it reads them, to an fp32 result; in SDPA from bf16 copies."""
    dtype, products = q.dtype, runtime.product_dtype or q.dtype
    if runtime.kernel == "cpu_kernel" and prefix is None and batch.attended is None and not window_cuts(
        window, batch.max_seqlen
    ):
        out = _kernel_attention(q, k, v, batch, causal, scale, cpu_kernel.attention_dtype(dtype, products))
        if out is not None:
            return out
    q, k, v = q.to(products), k.to(products), v.to(products)
    if not runtime.grouped_heads:
        k, v = _repeat_kv(k, v, q.shape[1])
    before, prefix_k, prefix_v = 0, None, None
    if prefix is not None:
        prefix_k, prefix_v = (t.to(products) for t in prefix)
        if not runtime.grouped_heads:
            prefix_k, prefix_v = _repeat_kv(prefix_k, prefix_v, q.shape[1])
        before, prefix_k, prefix_v = prefix_k.shape[0], prefix_k.transpose(0, 1), prefix_v.transpose(0, 1)
    # Where oneDNN's products follow (a CPU), the output projection takes the result without a copy (onednn.padded).
    out = onednn.with_room(q.shape, q) if runtime.product_dtype is not None else torch.empty_like(q)
    grouped = q.shape[1] != k.shape[1]
    start = 0  # the run's first token
    for length, count in _equal_length_runs(batch.lengths):
        end = start + length * count
        # [n*L, H, D] -> [n, L, H, D] -> [n, H, L, D]
        qi, ki, vi = (t[start:end].view(count, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        if prefix is not None:  # [H, P, D] before each sequence's own: [n, H, P + L, D]
            ki = torch.cat((prefix_k.expand(count, -1, -1, -1), ki), dim=2)
            vi = torch.cat((prefix_v.expand(count, -1, -1, -1), vi), dim=2)
        mask = _mask(length, before, window, causal, q.device)
        if batch.attended is not None:  # [n*L] -> [n, 1, 1, L]: each sequence's keys up to its attended count
            attended = batch.attended_tokens[start:end].view(count, 1, 1, length)
            mask = attended if mask is None else mask & attended
        oi = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=grouped, scale=scale
        )
        out[start:end].view(count, length, q.shape[1], q.shape[2]).copy_(oi.transpose(1, 2))  # -> [n, L, H, D]
        start = end
    return out.to(dtype)


def _kernel_attention(
    q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, causal: bool, scale: float | None,
    products: torch.dtype | None,
) -> Tensor | None:
    """The whole pack in one call of our CPU kernel (engine/cpu_kernel.py), its products in `products` (bf16 products
    of fp32 tensors round them as it reads them), where it runs them, the tensors are fp32 or bf16 and the head size
    is a multiple of 16; else None."""
    kernel = cpu_kernel.attention_for(products) if q.shape[-1] % 16 == 0 else None  # the runtime's: a CPU
    if kernel is None or q.dtype not in cpu_kernel.dtypes():
        return None
    q, k, v = (t if t.stride(1) == t.shape[-1] and t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = onednn.with_room(q.shape, q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kernel(q, k, v, out, batch.cu_seqlens, scale, causal, cpu_kernel.BLOCK, products == torch.bfloat16)
    return out


def _repeat_kv(k: Tensor, v: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """For kernels without grouped-query heads: [T, Hkv, D] -> [T, Hq, D]."""
    if k.shape[1] == num_heads:
        return k, v
    return k.repeat_interleave(num_heads // k.shape[1], dim=1), v.repeat_interleave(num_heads // v.shape[1], dim=1)


def _equal_length_runs(lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """(length, count) for each run of adjacent sequences of the same length."""
    runs: list[tuple[int, int]] = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


def _mask(length: int, before: int, window: int | None, causal: bool, device: torch.device) -> Tensor | None:
    """[L, before + L] bool, True where a query (at positions before to before + L - 1) may attend: within
    the window, and causal if asked (one sequence, never T x T); None where SDPA's own causal or full
    attention is the same."""
    if before == 0 and (window is None or length <= window):
        return None
    q_idx = torch.arange(before, before + length, device=device)[:, None]
    kv_idx = torch.arange(before + length, device=device)[None, :]
    allowed = (
        (q_idx - kv_idx).abs() < window if window is not None else torch.ones_like(q_idx - kv_idx, dtype=torch.bool)
    )
    return allowed & (kv_idx <= q_idx) if causal else allowed
