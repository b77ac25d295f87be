"""The attention kernels against dense attention with an explicit block-diagonal mask: the CPU loop, the
CUDA kernels' CPU stand-ins (exact signatures of each supported release), and the real CUDA kernels
under `pytest --device cuda`."""

import math

import kernel_standins
import pytest
import torch
from helpers import DEVICE

from st_fastbackend.engine import cpu_kernel
from st_fastbackend.engine.attention import varlen_attention
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.runtime import Runtime, choose_runtime

SDPA_LOOP = Runtime("sdpa_loop", grouped_heads=True, window=True, is_causal=True, dtype=torch.float32)


def dense_reference(q, k, v, lengths, causal, window, scale=None):
    """Every token against every token of the pack, masked to its own sequence (and causal / window: fewer
    than `window` positions back, or either way when not causal)."""
    q, k, v = q.double(), k.double(), v.double()
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= (pos[None, :] - pos[:, None]).abs() < window
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (scale or 1 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def random_qkv(lengths, kv_heads, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    q = torch.randn(sum(lengths), 4, 8, dtype=dtype, device=device)
    k, v = torch.randn(2, sum(lengths), kv_heads, 8, dtype=dtype, device=device)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("scale", [None, 0.2])
def test_sdpa_loop_matches_dense_attention(causal, kv_heads, window, scale):
    lengths = [1, 7, 2, 12, 5, 5, 5, 3, 3]  # runs of equal lengths share one kernel call
    batch = PackedBatch.from_sequences([[0] * n for n in lengths])
    q, k, v = random_qkv(lengths, kv_heads)
    out = varlen_attention(q, k, v, batch, causal=causal, window=window, runtime=SDPA_LOOP, scale=scale)
    expected = dense_reference(q, k, v, lengths, causal, window, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_symmetric_window_rule():
    """Bidirectional, window 3: a query sees two tokens on each side, as transformers' Gemma 3 mask
    (|q - kv| < sliding_window) and ModernBERT's (|q - kv| <= local_attention // 2) do. With scale 0 every
    visible key weighs the same, and one-hot values show which keys those are."""
    batch = PackedBatch.from_sequences([[0] * 6])
    q, k, _ = random_qkv([6], 4)
    v = torch.eye(6, 8)[:, None, :].expand(6, 4, 8).contiguous()  # [T, H, D]: key j's value is one-hot j
    out = varlen_attention(q, k, v, batch, causal=False, window=3, runtime=SDPA_LOOP, scale=0.0)
    visible = torch.tensor([[j < 6 and abs(i - j) < 3 for j in range(8)] for i in range(6)]).float()
    torch.testing.assert_close(out[:, 0], visible / visible.sum(1, keepdim=True))


def test_fp32_and_cpu_use_the_sdpa_loop_or_our_cpu_kernel():
    """Flash kernels take fp16/bf16 only: fp32 runs through SDPA on a GPU too (choosing touches no GPU); a CPU runs
    our kernel for the dtypes it has here (engine/cpu_kernel.py), SDPA for the rest."""
    for device_type, dtype in [("cpu", torch.float32), ("cpu", torch.bfloat16), ("cuda", torch.float32)]:
        ours = device_type == "cpu" and dtype in cpu_kernel.dtypes()
        assert choose_runtime(device_type, dtype).kernel == ("cpu_kernel" if ours else "sdpa_loop")
    assert choose_runtime("cuda", torch.float32).grouped_heads is False  # k/v repeated for CUDA's SDPA kernels


def test_packed_batch_layout():
    batch = PackedBatch.from_sequences([[5, 6, 7], [8], [9, 10]])
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert batch.sequence_ids().tolist() == [0, 0, 0, 1, 2, 2]
    assert batch.max_seqlen == 3 and batch.lengths == (3, 1, 2)
    with pytest.raises(ValueError):
        PackedBatch.from_sequences([[1], []])


EXPECTED = {  # what choose_runtime must read from each release: (kernel, ask_grouped, window, is_causal, scale)
    "torch 2.10": ("torch_varlen", False, False, True, False),
    "torch 2.11": ("torch_varlen", False, True, False, True),
    "torch 2.13": ("torch_varlen", True, True, False, True),
    "torch 2.14": ("torch_varlen", True, True, False, True),
    "flash-attn 2.0": ("flash_attn", False, False, True, True),
    "flash-attn 2.1": ("flash_attn", False, False, True, True),
    "flash-attn 2.3": ("flash_attn", False, True, True, True),
    "flash-attn 2.8": ("flash_attn", False, True, True, True),
}


@pytest.mark.parametrize("name", kernel_standins.STANDINS)
def test_capabilities_are_read_from_the_installed_kernel(standin, name):
    """Every kernel takes grouped heads (PyTorch's from 2.12 when asked); flash-attn 2.0 alone aligns a causal
    mask over longer keys with their start."""
    standin(name)
    kernel, ask_grouped, window, is_causal, scale = EXPECTED[name]
    for dtype in (torch.bfloat16, torch.float16):
        expected = Runtime(
            kernel, grouped_heads=True, ask_grouped=ask_grouped, window=window, is_causal=is_causal, dtype=dtype,
            scale=scale, longer_keys=name != "flash-attn 2.0",
        )  # fmt: skip
        assert choose_runtime("cuda", dtype) == expected
    assert choose_runtime("cuda", torch.float32).kernel == "sdpa_loop"


@pytest.mark.parametrize("name", kernel_standins.STANDINS)
@pytest.mark.parametrize(
    "causal, window", [(True, None), (True, 16), (True, 3), (False, None), (False, 16), (False, 3)]
)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("scale", [None, 0.2])
def test_each_kernel_signature_gives_dense_attention(standin, name, causal, window, kv_heads, scale):
    """Through the stand-in where it can (grouped heads as they are, causality, windows and the scale expressed
    as the release takes them), through the SDPA loop where a release has no window and the window cuts."""
    standin(name)
    lengths = [9, 4, 4, 1]
    batch = PackedBatch.from_sequences([[0] * n for n in lengths])
    q, k, v = random_qkv(lengths, kv_heads, torch.bfloat16)
    runtime = choose_runtime("cpu", q.dtype)
    out = varlen_attention(q, k, v, batch, causal=causal, window=window, runtime=runtime, scale=scale)
    expected = dense_reference(q, k, v, lengths, causal, window, scale)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0)
    cuts = window is not None and window < max(lengths)
    assert kernel_standins.Calls.count == (0 if cuts and not runtime.window else 1)
    # never repeated for a kernel (~2 GB a layer at 131k tokens for e5-mistral)
    assert kernel_standins.Calls.kv_heads == (kv_heads if kernel_standins.Calls.count else 0)


def test_gpus_before_ampere_use_the_sdpa_loop(standin, monkeypatch):
    standin("torch 2.13")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert choose_runtime("cuda", torch.float16).kernel == "sdpa_loop"


def test_standins_refuse_what_the_kernels_refuse():
    lengths = [3, 2]
    cu = PackedBatch.from_sequences([[0] * n for n in lengths]).cu_seqlens
    q, k, v = random_qkv(lengths, 2)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        kernel_standins.varlen_attn_2_13(q, k, v, cu, cu, 3, 3, enable_gqa=True)
    q, k, v = random_qkv(lengths, 2, torch.bfloat16)
    kernel_standins.varlen_attn_2_11(q, k, v, cu, cu, 3, 3)  # the kernel under 2.10 and 2.11 takes grouped heads
    with pytest.raises(ValueError, match="same number of heads"):
        kernel_standins.varlen_attn_2_13(q, k, v, cu, cu, 3, 3)  # from 2.12 only when asked
    with pytest.raises(TypeError):
        kernel_standins.varlen_attn_2_11(q, k, v, cu, cu, 3, 3, enable_gqa=True)  # no such keyword in 2.11
    with pytest.raises(TypeError):
        kernel_standins.varlen_attn_2_13(q, k, v, cu, cu, 3, 3, is_causal=True)  # nor this one in 2.13
    with pytest.raises(TypeError):
        kernel_standins.flash_attn_2_1(q, k, v, cu, cu, 3, 3, window_size=(2, 0))  # before flash-attn 2.3
    with pytest.raises(RuntimeError, match="must divide"):
        three = k[:, :1].expand(-1, 3, -1).contiguous()  # 3 k/v heads for 4 query heads
        kernel_standins.flash_attn_2_8(q, three, three, cu, cu, 3, 3)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        kernel_standins.varlen_attn_2_13(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu, cu, 3, 3,
                                         enable_gqa=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="silently leaves the rows"):
        kernel_standins.flash_attn_2_8(q, k, v, cu, cu, 2, 3)
    odd = torch.randn(5, 4, 12, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernel_standins.varlen_attn_2_13(odd, odd, odd, cu, cu, 3, 3)
    kernel_standins.flash_attn_2_8(odd, odd, odd, cu, cu, 3, 3)  # flash-attn pads the head size itself
    with pytest.raises(RuntimeError, match="at most 256"):
        wide = torch.randn(5, 1, 264, dtype=torch.bfloat16)
        kernel_standins.flash_attn_2_8(wide, wide, wide, cu, cu, 3, 3)


def test_a_query_without_keys_gets_zeros():
    """flash-attn's rule where queries outnumber keys: the first queries see no key and the kernel writes 0."""
    q, k, v = random_qkv([4], 4, torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    out = kernel_standins.flash_attn_2_8(q, k[:2], v[:2], cu_q, cu_k, 4, 2, causal=True)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and out[2:].abs().sum() > 0


@pytest.mark.parametrize("name", ["torch 2.10", "torch 2.14", "flash-attn 2.1"])
def test_a_head_size_pytorchs_kernel_refuses_runs_through_sdpa(standin, name):
    """head_dim 12: PyTorch's varlen_attn refuses it, so SDPA; flash-attn pads it and runs it."""
    standin(name)
    lengths = [9, 4]
    batch = PackedBatch.from_sequences([[0] * n for n in lengths])
    q, k, v = (torch.randn(13, 4, 12, dtype=torch.bfloat16) for _ in range(3))  # head_dim 12: not a multiple of 8
    out = varlen_attention(q, k, v, batch, causal=True, window=None, runtime=choose_runtime("cpu", q.dtype))
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, lengths, True, None), atol=2e-2, rtol=0)
    assert kernel_standins.Calls.count == int(name.startswith("flash-attn"))


@pytest.mark.skipif(DEVICE != "cuda", reason="the real CUDA kernels run under `pytest --device cuda`")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal, window", [(True, None), (True, 16), (False, None), (False, 65)])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_the_installed_cuda_kernel_gives_dense_attention(dtype, causal, window, kv_heads):
    choose_runtime.cache_clear()
    lengths = [40, 17, 17, 1, 300]
    batch = PackedBatch.from_sequences([[0] * n for n in lengths]).to("cuda")
    q, k, v = random_qkv(lengths, kv_heads, dtype, "cuda")
    chosen = choose_runtime("cuda", dtype)
    assert (chosen.kernel == "sdpa_loop") == (dtype == torch.float32)
    out = varlen_attention(q, k, v, batch, causal=causal, window=window, runtime=chosen)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    expected = dense_reference(q, k, v, lengths, causal, window)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)
