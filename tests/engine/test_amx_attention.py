"""Our AMX attention kernel (engine/cpu_kernel.py, csrc/amx_attention.cpp) where attention runs in bf16 on a
CPU with AMX: as close to exact attention as PyTorch's own bf16 kernel, a sequence's rows the same bits alone
or in any pack, strided inputs as they come out of the fused q/k/v product, and in a model."""

import pytest
import torch
from helpers import one_minus_cosine
from test_attention import dense_reference

from st_fastbackend import SentenceTransformer
from st_fastbackend.engine import attention, cpu_kernel
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.runtime import Runtime

pytestmark = pytest.mark.skipif(not cpu_kernel.amx_capable(), reason="needs a CPU with AMX-BF16 (the kernel's only home)")
BF16_LOOP = Runtime("sdpa_loop", grouped_heads=True, window=True, is_causal=True, dtype=torch.bfloat16)
LENGTHS = [257, 130, 65, 64, 64, 63, 31, 17, 2, 1]  # past one and two blocks of 64 query rows, odd key counts


def kernel():
    built = cpu_kernel.amx_attention()
    assert built is not None, "the AMX attention kernel did not build here (see the warning above)"
    return built


def run_kernel(q, k, v, lengths, causal, scale=None):
    batch = PackedBatch.from_sequences([[0] * n for n in lengths])
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kernel()(q, k, v, out, batch.cu_seqlens, scale, causal, cpu_kernel.BLOCK)
    return out


def sdpa_loop(q, k, v, lengths, causal, scale=None, monkeypatch=None):
    batch = PackedBatch.from_sequences([[0] * n for n in lengths])
    monkeypatch.setattr(attention, "_amx_attention", lambda *args: None)
    return attention.sdpa_attention(q, k, v, batch, causal=causal, window=None, runtime=BF16_LOOP, scale=scale)


def bf16_qkv(tokens, heads, kv_heads, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, head_dim, generator=generator) * 2
    k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=generator)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "causal"),
    [(12, 12, 32, False), (4, 4, 64, False), (8, 2, 64, True), (4, 1, 128, True), (2, 2, 16, False), (2, 1, 256, True)],
)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_as_close_to_exact_attention_as_pytorchs_bf16_kernel(heads, kv_heads, head_dim, causal, scale, monkeypatch):
    q, k, v = bf16_qkv(sum(LENGTHS), heads, kv_heads, head_dim)
    exact = dense_reference(q, k, v, LENGTHS, causal, None, scale)  # float64 from the same bf16 inputs
    ours = (run_kernel(q, k, v, LENGTHS, causal, scale).double() - exact).abs()
    pytorch = (sdpa_loop(q, k, v, LENGTHS, causal, scale, monkeypatch).double() - exact).abs()
    assert ours.max() <= 1.25 * pytorch.max() + 1e-3, (ours.max(), pytorch.max())
    assert ours.mean() <= 1.25 * pytorch.mean(), (ours.mean(), pytorch.mean())
    assert ours.max() < 0.05  # bf16 outputs of values within a few units


def test_a_sequence_gives_the_same_bits_alone_and_in_any_pack():
    q, k, v = bf16_qkv(sum(LENGTHS), 4, 2, 64)
    packed = run_kernel(q, k, v, LENGTHS, causal=True)
    start = 0
    for n in LENGTHS:
        alone = run_kernel(q[start : start + n], k[start : start + n], v[start : start + n], [n], causal=True)
        assert torch.equal(alone, packed[start : start + n])
        start += n
    order = list(reversed(LENGTHS))  # the same sequences in another order
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    rows = torch.cat([torch.arange(s, s + n) for s, n in reversed(list(zip(starts, LENGTHS, strict=True)))])
    assert torch.equal(run_kernel(q[rows], k[rows], v[rows], order, causal=True), packed[rows])


def test_strided_heads_as_the_fused_qkv_product_gives_them():
    q, k, v = bf16_qkv(sum(LENGTHS), 6, 2, 32)
    qkv = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)  # [T, (6 + 2 + 2) * 32]
    views = [t.view(-1, heads, 32) for t, heads in zip(qkv.split([192, 64, 64], dim=1), (6, 2, 2), strict=True)]
    assert views[0].stride(0) == 320
    assert torch.equal(run_kernel(*views, LENGTHS, causal=False), run_kernel(q, k, v, LENGTHS, causal=False))


def test_refuses_what_it_does_not_compute():
    q, k, v = bf16_qkv(8, 2, 2, 32)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="bf16 q, k, v and out"):
        kernel()(q.float(), k, v, torch.empty_like(q), cu, 0.1, False, 64)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel()(q[..., :24], k[..., :24], v[..., :24], torch.empty_like(q[..., :24]), cu, 0.1, False, 64)
    with pytest.raises(RuntimeError, match="int32 cu_seqlens"):
        kernel()(q, k, v, torch.empty_like(q), cu.long(), 0.1, False, 64)


def test_the_sdpa_loop_takes_what_the_kernel_does_not(monkeypatch):
    """Head sizes not a multiple of 16, fp32 attention and a window that cuts go through the loop."""
    calls = []
    monkeypatch.setattr(cpu_kernel, "amx_attention", lambda: lambda *args: calls.append(args))
    lengths = [9, 5]
    batch = PackedBatch.from_sequences([[0] * n for n in lengths])
    for q, k, v, window in (
        (*bf16_qkv(14, 2, 2, 24), None),
        (*(t.float() for t in bf16_qkv(14, 2, 2, 32)), None),
        (*bf16_qkv(14, 2, 2, 32), 4),
    ):
        attention.sdpa_attention(q, k, v, batch, causal=True, window=window, runtime=BF16_LOOP)
    assert calls == []
    attention.sdpa_attention(*bf16_qkv(14, 2, 2, 32), batch, causal=True, window=None, runtime=BF16_LOOP)
    assert len(calls) == 1


@pytest.mark.parametrize("family", ["bert", "mistral"])
def test_a_bf16_model_through_the_kernel_and_the_loop(st_model, texts, family, monkeypatch):
    """The same bf16 model with the kernel and with the SDPA loop: the kernel ran (not the same bits) and the two
    agree as two bf16 kernels do."""
    folder, texts = str(st_model(family, pooling_mode="mean")), [t for t in texts if t]

    def encode():
        model = SentenceTransformer(folder, backend="fast", device="cpu", model_kwargs={"dtype": torch.bfloat16})
        return model.encode(texts, convert_to_numpy=False, convert_to_tensor=True).float()

    ours = encode()
    monkeypatch.setattr(cpu_kernel, "amx_attention", lambda: None)
    loop = encode()
    assert not torch.equal(ours, loop)
    assert one_minus_cosine(ours, loop).max() < 2e-3
