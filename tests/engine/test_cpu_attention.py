"""Our CPU attention kernel (engine/cpu_kernel.py, csrc/attention.cpp): fp32 as close to float64 attention as the
SDPA loop is; bf16 (AMX) as close to it as PyTorch's own bf16 kernel; a sequence's rows the same bits alone or
in any pack; strided heads as the fused q/k/v product gives them; what it refuses and what goes to the loop; in
whole models."""

import os
import time
from pathlib import Path

import pytest
import torch
from helpers import TOLERANCE, load_both, max_diff, one_minus_cosine
from test_attention import dense_reference

from st_fastbackend import SentenceTransformer
from st_fastbackend.engine import attention, cpu_kernel
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.runtime import Runtime

pytestmark = pytest.mark.skipif(not cpu_kernel.dtypes(), reason="needs an x86-64 CPU with AVX2 or AVX-512")
needs_bf16 = pytest.mark.skipif(
    torch.bfloat16 not in cpu_kernel.dtypes(), reason="bf16 needs AVX-512 and bf16 dot products (AVX512-BF16 or AMX)"
)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)]
LENGTHS = [257, 130, 65, 64, 64, 63, 31, 17, 2, 1]  # past one and two blocks of 64 query rows, odd key counts
# (query heads, key heads, head size, causal): MiniLM, BERT-base, the small Mistral, e5-mistral's group, edges
SHAPES = [
    (12, 12, 32, False), (4, 4, 64, False), (8, 2, 64, True), (4, 1, 128, True), (2, 2, 16, False), (2, 1, 256, True)
]


def kernel(dtype=torch.float32):
    built = cpu_kernel.attention_for(dtype)
    assert built is not None, "the CPU attention kernel did not build here (see the warning above)"
    return built


def run_kernel(q, k, v, lengths, causal, scale=None, products=None):
    batch = PackedBatch.from_sequences([[0] * n for n in lengths])
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    products = products or q.dtype
    kernel(products)(q, k, v, out, batch.cu_seqlens, scale, causal, cpu_kernel.BLOCK, products == torch.bfloat16)
    return out


def sdpa_loop(q, k, v, lengths, causal, scale, monkeypatch):
    batch = PackedBatch.from_sequences([[0] * n for n in lengths])
    runtime = Runtime("sdpa_loop", grouped_heads=True, window=True, is_causal=True, dtype=q.dtype)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernel, "attention_for", lambda dtype: None)
        return attention.sdpa_attention(q, k, v, batch, causal=causal, window=None, runtime=runtime, scale=scale)


def random_qkv(tokens, heads, kv_heads, head_dim, dtype):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, head_dim, generator=generator) * 2
    k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=generator)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "causal"), SHAPES)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_fp32_is_as_exact_as_the_sdpa_loop(heads, kv_heads, head_dim, causal, scale, monkeypatch):
    """Within fp32 rounding of float64 attention: as close on average as PyTorch's fp32 kernel is (its error grows
    with the logits: up to 2e-05 here where q.k reaches ~100). The single worst element is within 2x of the loop's:
    two fp32 summation orders (oneDNN's brgemm, the loop's BLAS) each have their own worst element."""
    q, k, v = random_qkv(sum(LENGTHS), heads, kv_heads, head_dim, torch.float32)
    exact = dense_reference(q, k, v, LENGTHS, causal, None, scale)
    ours = (run_kernel(q, k, v, LENGTHS, causal, scale).double() - exact).abs()
    pytorch = (sdpa_loop(q, k, v, LENGTHS, causal, scale, monkeypatch).double() - exact).abs()
    assert ours.mean() <= 1.1 * pytorch.mean(), (ours.mean(), pytorch.mean())
    assert ours.max() <= 2 * pytorch.max() + 1e-7, (ours.max(), pytorch.max())
    assert ours.max() < 3e-5


@needs_bf16
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "causal"), SHAPES)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_bf16_as_close_to_exact_attention_as_pytorchs(heads, kv_heads, head_dim, causal, scale, monkeypatch):
    q, k, v = random_qkv(sum(LENGTHS), heads, kv_heads, head_dim, torch.bfloat16)
    exact = dense_reference(q, k, v, LENGTHS, causal, None, scale)  # float64 from the same bf16 inputs
    ours = (run_kernel(q, k, v, LENGTHS, causal, scale).double() - exact).abs()
    pytorch = (sdpa_loop(q, k, v, LENGTHS, causal, scale, monkeypatch).double() - exact).abs()
    assert ours.max() <= 1.25 * pytorch.max() + 1e-3, (ours.max(), pytorch.max())
    assert ours.mean() <= 1.25 * pytorch.mean(), (ours.mean(), pytorch.mean())
    assert ours.max() < 0.05


@needs_bf16
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "causal"), SHAPES)
def test_bf16_products_of_fp32_tensors_are_those_of_the_rounded_tensors(heads, kv_heads, head_dim, causal):
    """fp32 q, k, v rounded to bf16 as the kernel reads them: the bf16 kernel's result on tensors rounded first, but
    not rounded itself (the fp32 output rounds to exactly the bf16 one)."""
    q, k, v = random_qkv(sum(LENGTHS), heads, kv_heads, head_dim, torch.float32)
    ours = run_kernel(q, k, v, LENGTHS, causal, products=torch.bfloat16)
    rounded = run_kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), LENGTHS, causal)
    assert ours.dtype == torch.float32 and torch.equal(ours.bfloat16(), rounded)
    assert not torch.equal(ours, rounded.float())
    with pytest.raises(RuntimeError, match="bf16 tensors take bf16 products"):
        kernel()(q.bfloat16(), k.bfloat16(), v.bfloat16(), rounded, torch.tensor([0, q.shape[0]], dtype=torch.int32),
                 0.1, causal, 64, False)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sequence_gives_the_same_bits_alone_and_in_any_pack(dtype):
    q, k, v = random_qkv(sum(LENGTHS), 4, 2, 64, dtype)
    packed = run_kernel(q, k, v, LENGTHS, causal=True)
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for start, n in zip(starts, LENGTHS, strict=True):
        rows = slice(start, start + n)
        assert torch.equal(run_kernel(q[rows], k[rows], v[rows], [n], causal=True), packed[rows])
    rows = torch.cat([torch.arange(s, s + n) for s, n in reversed(list(zip(starts, LENGTHS, strict=True)))])
    assert torch.equal(run_kernel(q[rows], k[rows], v[rows], LENGTHS[::-1], causal=True), packed[rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_heads_as_the_fused_qkv_product_gives_them(dtype):
    q, k, v = random_qkv(sum(LENGTHS), 6, 2, 32, dtype)
    qkv = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)  # [T, (6 + 2 + 2) * 32]
    views = [t.view(-1, heads, 32) for t, heads in zip(qkv.split([192, 64, 64], dim=1), (6, 2, 2), strict=True)]
    assert views[0].stride(0) == 320
    assert torch.equal(run_kernel(*views, LENGTHS, causal=False), run_kernel(q, k, v, LENGTHS, causal=False))


def test_refuses_what_it_does_not_compute():
    q, k, v = random_qkv(8, 2, 2, 32, torch.float32)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    cases = [
        ((q.double(), k, v, torch.empty_like(q), cu), "all fp32 or all bf16"),
        ((q[..., :24], k[..., :24], v[..., :24], torch.empty_like(q[..., :24]), cu), "multiple of 16"),
        ((q, k, v, torch.empty_like(q), cu.long()), "int32 cu_seqlens"),
        ((q, k, v, torch.empty_like(q), torch.tensor([0, 9], dtype=torch.int32)), "within the tokens"),
        ((q, k[:7], v, torch.empty_like(q), cu), "within the tokens"),  # keys shorter than the queries
        ((q, k, v, torch.empty_like(q), torch.tensor([1, 8], dtype=torch.int32)), "from 0"),
        ((q, k, v, torch.empty_like(q), torch.tensor([0, 5, 3], dtype=torch.int32)), "in order"),
        ((q, k[:, :1].expand(8, 3, 32), v, torch.empty_like(q), cu), "multiple of key heads"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kernel()(*args, 0.1, False, 64, False)
    with pytest.raises(RuntimeError, match="positive multiple of 16"):
        kernel()(q, k, v, torch.empty_like(q), cu, 0.1, False, 24, False)
    with pytest.raises(RuntimeError, match="positive softmax scale"):
        kernel()(q, k, v, torch.empty_like(q), cu, -0.1, False, 64, False)
    with pytest.raises(RuntimeError, match="multiple of key heads"):
        kernel()(q, k[:, :0], v[:, :0], torch.empty_like(q), cu, 0.1, False, 64, False)


def resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc (Linux)")
def test_memory_does_not_grow_with_the_lengths_it_has_seen():
    """PyTorch keeps a JIT kernel for each brgemm shape for the thread's life, never freed: the kernel's shapes
    must not follow the sequence lengths, or a server's memory grows with every new length (by ~700 MB over
    MiniLM's 2,185 paragraphs when they did)."""
    for head_dim, causal in ((64, False), (64, True), (256, False)):
        for n in (1, 17, 33, 49, 64, 65, 81, 97, 113, 130):  # every rounding of rows and key columns, warm
            run_kernel(*random_qkv(n, 2, 1, head_dim, torch.float32), [n], causal)
    before = resident_mib()
    for head_dim, causal in ((64, False), (64, True), (256, False)):
        for n in range(1, 300, 3):
            run_kernel(*random_qkv(n, 2, 1, head_dim, torch.float32), [n], causal)
    grown = resident_mib() - before
    print(f"resident size grew {grown:.1f} MiB")
    assert grown < 16, grown


def test_the_sdpa_loop_takes_what_the_kernel_does_not(monkeypatch):
    """Head sizes not a multiple of 16, a window that cuts, a dtype the kernel does not run here, a runtime
    without the kernel: the loop."""
    calls = []
    monkeypatch.setattr(cpu_kernel, "attention_for", lambda dtype: (lambda *args: calls.append(args)) if dtype in (
        torch.float32, torch.bfloat16) else None)  # fmt: skip
    batch = PackedBatch.from_sequences([[0] * 9, [0] * 5])
    runtime = Runtime("cpu_kernel", grouped_heads=True, window=True, is_causal=True, dtype=torch.float32)
    for q, k, v, window in (
        (*random_qkv(14, 2, 2, 24, torch.float32), None),
        (*random_qkv(14, 2, 2, 32, torch.float16), None),
        (*random_qkv(14, 2, 2, 32, torch.float32), 4),
    ):
        attention.sdpa_attention(q, k, v, batch, causal=True, window=window, runtime=runtime)
    assert calls == []
    attention.sdpa_attention(*random_qkv(14, 2, 2, 32, torch.float32), batch, causal=True, window=9, runtime=runtime)
    assert len(calls) == 1  # a window longer than every sequence cuts nothing
    loop = Runtime("sdpa_loop", grouped_heads=True, window=True, is_causal=True, dtype=torch.float32)
    attention.sdpa_attention(*random_qkv(14, 2, 2, 32, torch.float32), batch, causal=True, window=None, runtime=loop)
    assert len(calls) == 1


def test_bf16_products_without_a_bf16_kernel_take_the_kernel_at_fp32(monkeypatch):
    """An fp32 model with bf16 products where the kernel runs fp32 only (ATEN_CPU_CAPABILITY=avx2 on a bf16 CPU) takes
    the kernel at fp32, the same bits as an fp32 model's attention, not SDPA at bf16 (1.8x slower on a Zen 4)."""
    from st_fastbackend.engine.runtime import choose_runtime

    monkeypatch.setattr(cpu_kernel, "dtypes", lambda: (torch.float32,))
    runtime = choose_runtime("cpu", torch.float32, product_dtype=torch.bfloat16)
    assert runtime.kernel == "cpu_kernel" and runtime.product_dtype == torch.bfloat16
    q, k, v = random_qkv(sum(LENGTHS), 4, 2, 64, torch.float32)
    batch = PackedBatch.from_sequences([[0] * n for n in LENGTHS])
    out = attention.sdpa_attention(q, k, v, batch, causal=True, window=None, runtime=runtime)
    assert out.dtype == torch.float32 and torch.equal(out, run_kernel(q, k, v, LENGTHS, causal=True))
    monkeypatch.setattr(cpu_kernel, "dtypes", lambda: ())  # no kernel: SDPA in the products' bf16
    loop = Runtime("sdpa_loop", grouped_heads=True, window=True, is_causal=True, dtype=torch.float32,
                   product_dtype=torch.bfloat16)  # fmt: skip
    bf16 = attention.sdpa_attention(q, k, v, batch, causal=True, window=None, runtime=loop)
    assert 1e-3 < (bf16 - out).abs().max() < 5e-2


@needs_bf16
def test_bf16_products_of_an_fp32_model_take_the_kernel_in_bf16():
    """Where the kernel runs bf16, an fp32 model's bf16 products take it in bf16 from the fp32 tensors, an fp32
    result (1.4x as fast as fp32 on a Zen 4)."""
    from st_fastbackend.engine.runtime import choose_runtime

    runtime = choose_runtime("cpu", torch.float32, product_dtype=torch.bfloat16)
    q, k, v = random_qkv(sum(LENGTHS), 4, 2, 64, torch.float32)
    batch = PackedBatch.from_sequences([[0] * n for n in LENGTHS])
    out = attention.sdpa_attention(q, k, v, batch, causal=True, window=None, runtime=runtime)
    assert out.dtype == torch.float32
    assert torch.equal(out, run_kernel(q, k, v, LENGTHS, causal=True, products=torch.bfloat16))


@pytest.mark.parametrize("family", ["bert", "mistral"])
def test_fp32_models_through_the_kernel_are_exact(st_model, texts, family, monkeypatch):
    """Against plain sentence-transformers, and not the loop's bits (the kernel ran)."""
    plain, fast = load_both(st_model(family, pooling_mode="mean"))
    expected, ours = plain.encode(texts), fast.encode(texts)
    assert max_diff(ours, expected) <= TOLERANCE
    monkeypatch.setattr(cpu_kernel, "attention_for", lambda dtype: None)
    assert max_diff(fast.encode(texts), ours) > 0


@needs_bf16
@pytest.mark.parametrize("family", ["bert", "mistral"])
def test_bf16_models_through_the_kernel_and_the_loop_agree(st_model, texts, family, monkeypatch):
    folder, texts = str(st_model(family, pooling_mode="mean")), [t for t in texts if t]
    model = SentenceTransformer(folder, backend="fast", device="cpu", model_kwargs={"dtype": torch.bfloat16})
    ours = model.encode(texts)
    monkeypatch.setattr(cpu_kernel, "attention_for", lambda dtype: None)
    loop = model.encode(texts)
    assert max_diff(ours, loop) > 0
    assert one_minus_cosine(ours, loop).max() < 2e-3


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path):
    """cpp_extension waits on its lock file forever: one older than any build is cleared before loading."""
    lock = tmp_path / "lock"
    lock.touch()
    cpu_kernel._clear_stale_lock(lock)
    assert lock.exists()  # a build under way
    old = time.time() - cpu_kernel.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    cpu_kernel._clear_stale_lock(lock)
    assert not lock.exists()
    cpu_kernel._clear_stale_lock(lock)  # none: nothing to do
