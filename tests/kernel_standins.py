"""CPU stand-ins for the CUDA attention kernels, with the exact signatures of the releases we support.

Each refuses what the real kernel refuses (fp32, unequal head counts without grouped-query support,
int64 boundaries) and computes the flash kernels' masking rule exactly: a query at position i sees
key j of its own sequence where j >= i - left (left >= 0) and j <= i + right (right >= 0), and j <= i
when causal; (w, w) is a symmetric window. Where a sequence has more keys than queries (Lk > Lq), the
queries are aligned with the end of the keys: i counts from Lk - Lq (flash-attn >= 2.1, "the causal mask
is aligned to the bottom right corner of the attention matrix"). The softmax scale is `scale`
(1/sqrt(head_dim) when None).
Signatures as read from PyTorch's torch/nn/attention/varlen.py at each release tag and
from flash-attn 2's flash_attn_interface.py.
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


def flash_reference(q, k, v, cu_seq_q, cu_seq_k, *, causal, window_size, grouped, scale=None):
    """The flash kernels' contract, computed per sequence in fp32 and returned in the input dtype."""
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")  # the real kernels' refusal
    if cu_seq_q.dtype != torch.int32 or cu_seq_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q must have dtype int32")
    if len(cu_seq_q) != len(cu_seq_k) or cu_seq_k[-1] != len(k):
        raise RuntimeError("cu_seqlens_k must have shape (batch_size + 1) and end at the number of keys")
    if q.shape[1] != k.shape[1] and not grouped:
        raise ValueError(f"Expect query and key/value to have the same number of heads: {q.shape[1]}, {k.shape[1]}")
    if not isinstance(window_size, tuple):
        raise TypeError("window_size must be a tuple: varlen_attn compares it with (-1, 0)")
    Calls.count += 1
    Calls.longer_keys += int(not torch.equal(cu_seq_q, cu_seq_k))
    left, right = window_size
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for start, end, start_k, end_k in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True):
        qi = q[start:end].float().transpose(0, 1)  # [H, Lq, D]
        ki, vi = (t[start_k:end_k].float().transpose(0, 1) for t in (k, v))  # [H, Lk, D]
        scores = qi @ ki.transpose(1, 2) * (scale or 1 / math.sqrt(q.shape[-1]))  # [H, Lq, Lk]
        i = torch.arange(end - start)[:, None] + (end_k - start_k) - (end - start)  # aligned with the keys' end
        j = torch.arange(end_k - start_k)[None, :]
        allowed = torch.ones(end - start, end_k - start_k, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        if causal:
            allowed &= j <= i
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[start:end] = (weights @ vi).transpose(0, 1).to(q.dtype)
    return out


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return flash_reference(
        query, key, value, cu_seq_q, cu_seq_k, causal=is_causal, window_size=(-1, -1), grouped=False
    )


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    is_causal = window_size == (-1, 0)  # as PyTorch 2.11 derives it
    return flash_reference(
        query, key, value, cu_seq_q, cu_seq_k, causal=is_causal, window_size=window_size, grouped=False, scale=scale
    )


def varlen_attn_2_13(
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
    is_causal = window_size == (-1, 0)
    return flash_reference(
        query, key, value, cu_seq_q, cu_seq_k, causal=is_causal, window_size=window_size, grouped=enable_gqa,
        scale=scale,
    )


def flash_attn_varlen_func(
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
    window_size = tuple(window_size)  # flash-attn takes a list or a tuple
    if softcap:
        raise NotImplementedError("the stand-in has no soft-capping (the engine never asks for it)")
    return flash_reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, window_size=window_size, grouped=True,
        scale=softmax_scale,
    )


STANDINS = {
    "torch 2.10": varlen_attn_2_10,
    "torch 2.11": varlen_attn_2_11,
    "torch 2.13": varlen_attn_2_13,
    "flash-attn 2": flash_attn_varlen_func,
}


def install(monkeypatch, name: str) -> None:
    """Make the CPU look like a GPU with the named kernel installed, for choose_runtime and the engine."""
    import torch.nn.attention.varlen as varlen

    Calls.count = Calls.longer_keys = 0
    if name.startswith("flash-attn"):
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=STANDINS[name]))
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
        monkeypatch.setattr(varlen, "varlen_attn", STANDINS[name])
    monkeypatch.setattr(runtime, "VARLEN_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # as an H200 answers
    runtime.choose_runtime.cache_clear()  # the caller clears it again afterwards (see the `standin` fixtures)
