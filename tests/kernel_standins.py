"""CPU stand-ins for the CUDA attention kernels, with the exact signatures of the releases we support.

Each refuses what the real kernel refuses, as read from its source: fp32 or mixed dtypes, int64 boundaries,
head_dim over 256, k/v heads that do not divide the query heads (aten's and flash-attn's mha_varlen_fwd), a last
dimension that is not contiguous or a head_dim that is not a multiple of 8 under PyTorch (flash-attn's Python
function makes the one contiguous and pads the other itself), and, from PyTorch 2.12, unequal heads without
enable_gqa=True (varlen_attn's own check). Where the real kernel fails silently the stand-in raises: a
max_seqlen below a sequence's length (the kernel sizes its work by it and leaves the rows past it unwritten).

The flash kernels' masking rule, computed exactly: a query at position i sees key j of its own sequence where
j >= i - left (left >= 0) and j <= i + right (right >= 0), and j <= i when causal; (w, w) is a symmetric
window. Where a sequence has more keys than queries (Lk > Lq), i counts from Lk - Lq, the queries aligned with
the end of the keys (flash-attn >= 2.1: "the causal mask is aligned to the bottom right corner of the attention
matrix"); flash-attn 2.0 and cuDNN's causal mask (PyTorch's MHA.cpp: set_causal_mask) count i from 0. A query
that sees no key gets 0, as the kernels write it (not softmax's NaN). The softmax scale is `scale`
(1/sqrt(head_dim) when None).

Signatures as read from PyTorch's torch/nn/attention/varlen.py in the 2.10.0, 2.11.0, 2.12.0, 2.13.0 and
2.14.1 wheels (2.12's is 2.13's) and from flash-attn's flash_attn_interface.py in its 2.0.9, 2.1.0, 2.2.5,
2.3.0, 2.4.2, 2.5.9, 2.6.3 and 2.8.3 releases.
"""

from __future__ import annotations

import math
import sys
import types

import torch

import st_fastbackend.engine.runtime as runtime


class Calls:
    """How many times the installed stand-in ran."""

    count = 0
    longer_keys = 0  # calls where some sequence has more keys than queries
    cudnn = 0  # calls PyTorch 2.14 would send to cuDNN
    kv_heads = 0  # the k/v heads of the last call (fewer than the query heads: not repeated)


def flash_reference(
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, causal, window_size, scale=None, top_left=False, pads=False
):
    """The flash kernels' contract, computed per sequence in fp32 and returned in the input dtype. `pads`: as
    flash-attn's Python function, which pads head sizes to a multiple of 8 and makes the last dimension contiguous."""
    _refuse(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, pads)
    if not isinstance(window_size, tuple):
        raise TypeError("window_size must be a tuple: varlen_attn compares it with (-1, 0)")
    Calls.count += 1
    Calls.longer_keys += int(not torch.equal(cu_seq_q, cu_seq_k))
    Calls.kv_heads = k.shape[1]
    left, right = window_size
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for start, end, start_k, end_k in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True):
        qi = q[start:end].float().transpose(0, 1)  # [H, Lq, D]
        ki, vi = (t[start_k:end_k].float().transpose(0, 1) for t in (k, v))  # [H, Lk, D]
        scores = qi @ ki.transpose(1, 2) * (scale or 1 / math.sqrt(q.shape[-1]))  # [H, Lq, Lk]
        i = torch.arange(end - start)[:, None] + (0 if top_left else (end_k - start_k) - (end - start))
        j = torch.arange(end_k - start_k)[None, :]
        allowed = torch.ones(end - start, end_k - start_k, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        if causal:
            allowed &= j <= i
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        weights = weights.masked_fill(~allowed.any(-1)[:, None], 0.0)  # a query without keys: 0
        out[start:end] = (weights @ vi).transpose(0, 1).to(q.dtype)
    return out


def _refuse(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, pads: bool) -> None:
    """What mha_varlen_fwd checks (messages as the kernel words them), and the silent failures made loud."""
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if cu_seq_q.dtype != torch.int32 or cu_seq_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q must have dtype int32")
    if not pads and any(t.stride(-1) != 1 for t in (q, k, v)):
        raise RuntimeError("Input tensor must have contiguous last dimension")
    if q.shape[-1] > 256 or (q.shape[-1] % 8 and not pads):
        raise RuntimeError(f"head_size {q.shape[-1]}: FlashAttention takes at most 256, a multiple of 8")
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if len(cu_seq_q) != len(cu_seq_k) or cu_seq_k[-1] != len(k):
        raise RuntimeError("cu_seqlens_k must have shape (batch_size + 1) and end at the number of keys")
    if not (isinstance(max_q, int) and isinstance(max_k, int)):
        raise TypeError("max_q and max_k are Python ints (the custom op's schema)")
    longest_q, longest_k = int(cu_seq_q.diff().max()), int(cu_seq_k.diff().max())
    if max_q < longest_q or max_k < longest_k:
        raise RuntimeError(
            f"max_q {max_q} / max_k {max_k} below the longest sequence ({longest_q} queries, {longest_k} keys): "
            "the real kernel sizes its work by them and silently leaves the rows past them unwritten"
        )


def _same_heads(query, key, enable_gqa: bool) -> None:
    """varlen_attn's own check from PyTorch 2.12 (the kernel under it takes grouped heads in every release)."""
    if not enable_gqa and query.shape[1] != key.shape[1]:
        heads = f"{query.shape[1]}, {key.shape[1]}"
        raise ValueError(f"Expect query and key/value to have the same number of heads: {heads}")
    if enable_gqa and query.shape[1] % key.shape[1]:
        raise ValueError("Expect number of query heads to be a multiple of kv heads for GQA")


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return flash_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, window_size=(-1, -1))


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    is_causal = window_size == (-1, 0)  # as PyTorch 2.11 derives it
    return flash_reference(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, window_size=window_size, scale=scale
    )


def _varlen_attn_from_2_12(cudnn_on_hopper: bool):
    """varlen_attn as 2.12 and 2.13 have it; with `cudnn_on_hopper`, 2.14's, which sends long full non-causal
    attention with equal heads to cuDNN on Hopper (the stand-in's (9, 0); varlen.py's _can_use_cudnn), whose causal
    mask would count from the keys' start (never causal there)."""

    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        _same_heads(query, key, enable_gqa)
        full = list(window_size) == [-1, -1] and not enable_gqa and query.shape[1] == key.shape[1]
        paged = block_table is not None and seqused_k is None
        cudnn = cudnn_on_hopper and full and max_q > 128 and num_splits is None and not paged
        Calls.cudnn += int(cudnn)
        is_causal = window_size == (-1, 0)
        return flash_reference(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, window_size=window_size,
            scale=scale, top_left=cudnn,
        )  # fmt: skip

    return varlen_attn


varlen_attn_2_13 = _varlen_attn_from_2_12(cudnn_on_hopper=False)
varlen_attn_2_14 = _varlen_attn_from_2_12(cudnn_on_hopper=True)


def flash_attn_2_0(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, return_attn_probs=False,
):  # fmt: skip
    """flash-attn 2.0.x: no window, and a causal mask counted from the keys' start."""
    return flash_reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, window_size=(-1, -1),
        scale=softmax_scale, top_left=True, pads=True,
    )  # fmt: skip


def flash_attn_2_1(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, return_attn_probs=False,
):  # fmt: skip
    """flash-attn 2.1 and 2.2: 2.0's signature, the causal mask aligned with the keys' end."""
    return flash_reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, window_size=(-1, -1),
        scale=softmax_scale, pads=True,
    )  # fmt: skip


def flash_attn_2_3(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), return_attn_probs=False,
):  # fmt: skip
    return flash_reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        window_size=tuple(window_size), scale=softmax_scale, pads=True,
    )  # fmt: skip


def flash_attn_2_8(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    if softcap:
        raise NotImplementedError("the stand-in has no soft-capping (the engine never asks for it)")
    return flash_attn_2_3(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size
    )


STANDINS = {
    "torch 2.10": varlen_attn_2_10,
    "torch 2.11": varlen_attn_2_11,
    "torch 2.13": varlen_attn_2_13,
    "torch 2.14": varlen_attn_2_14,
    "flash-attn 2.0": flash_attn_2_0,
    "flash-attn 2.1": flash_attn_2_1,
    "flash-attn 2.3": flash_attn_2_3,
    "flash-attn 2.8": flash_attn_2_8,
}
FLASH_ATTN_VERSIONS = {"flash-attn 2.0": "2.0.9", "flash-attn 2.1": "2.2.5", "flash-attn 2.3": "2.3.0",
                       "flash-attn 2.8": "2.8.3"}  # fmt: skip


def install(monkeypatch, name: str) -> None:
    """Make the CPU look like a GPU with the named kernel installed, for choose_runtime and the engine."""
    import torch.nn.attention.varlen as varlen

    Calls.count = Calls.longer_keys = Calls.cudnn = Calls.kv_heads = 0
    if name.startswith("flash-attn"):
        module = types.SimpleNamespace(flash_attn_varlen_func=STANDINS[name], __version__=FLASH_ATTN_VERSIONS[name])
        monkeypatch.setitem(sys.modules, "flash_attn", module)
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
        monkeypatch.setattr(varlen, "varlen_attn", STANDINS[name])
    monkeypatch.setattr(runtime, "VARLEN_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # as an H200 answers
    runtime.choose_runtime.cache_clear()  # the caller clears it again afterwards (see the `standin` fixtures)
