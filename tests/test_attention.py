"""The CPU kernel against dense attention with an explicit block-diagonal mask."""

import math

import pytest
import torch

from st_fastbackend.engine.attention import pick_kernel, varlen_attention
from st_fastbackend.engine.batch import PackedBatch


def dense_reference(q, k, v, lengths, causal, window):
    """Every token against every token of the pack, masked to its own sequence (and causal / window)."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("window", [None, 3])
def test_sdpa_loop_matches_dense_attention(causal, kv_heads, window):
    if window is not None and not causal:
        pytest.skip("sliding windows are causal here, as in every supported family")
    lengths = [1, 7, 2, 12, 5, 5, 5, 3, 3]  # runs of equal lengths share one kernel call
    batch = PackedBatch.from_sequences([[0] * n for n in lengths])
    torch.manual_seed(0)
    q = torch.randn(sum(lengths), 4, 8)
    k, v = torch.randn(2, sum(lengths), kv_heads, 8)
    out = varlen_attention(q, k, v, batch, causal=causal, window=window, kernel="sdpa_loop")
    torch.testing.assert_close(out, dense_reference(q, k, v, lengths, causal, window), atol=1e-5, rtol=1e-5)


def test_cpu_uses_the_sdpa_loop():
    assert pick_kernel(torch.device("cpu")) == "sdpa_loop"


def test_packed_batch_layout():
    batch = PackedBatch.from_sequences([[5, 6, 7], [8], [9, 10]])
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert batch.sequence_ids().tolist() == [0, 0, 0, 1, 2, 2]
    assert batch.max_seqlen == 3 and batch.lengths == (3, 1, 2)
    with pytest.raises(ValueError):
        PackedBatch.from_sequences([[1], []])


def test_torch_varlen_before_window_support(monkeypatch):
    """torch < 2.12's varlen_attn (CUDA only) takes is_causal, no window and equal head counts. A CPU
    stand-in with that signature checks our side: k/v heads repeated, and sequences longer than the
    window sent through the per-sequence SDPA with a window mask."""
    import torch.nn.attention.varlen as varlen

    calls = []

    def old_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        assert q.shape[1] == k.shape[1] == v.shape[1]
        calls.append(max_q)
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        return dense_reference(q, k, v, lengths, is_causal, None)

    monkeypatch.setattr(varlen, "varlen_attn", old_varlen_attn)
    lengths = [9, 4, 4, 1]
    batch = PackedBatch.from_sequences([[0] * n for n in lengths])
    q = torch.randn(sum(lengths), 4, 8)
    k, v = torch.randn(2, sum(lengths), 2, 8)
    for window in (None, 16, 3):  # no window, a window longer than every sequence, a window that cuts
        out = varlen_attention(q, k, v, batch, causal=True, window=window, kernel="torch_varlen")
        torch.testing.assert_close(out, dense_reference(q, k, v, lengths, True, window), atol=1e-5, rtol=1e-5)
    assert calls == [9, 9]  # the cutting window did not reach the windowless kernel
