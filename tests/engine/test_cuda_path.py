"""The CUDA path driven on the CPU: stand-ins with the exact signatures of each supported kernel release
(tests/kernel_standins.py) run the whole encode(). fp32 must never reach them (the flash kernels refuse
it) and stays exact; bf16 goes through them and keeps the bf16 error rule."""

import functools

import kernel_standins
import numpy as np
import pytest
import torch
from helpers import DEVICE, TOLERANCE, load_both, max_diff, one_minus_cosine
from transfers import HostToDevice

from st_fastbackend.engine.attention import sdpa_attention
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.layers import Rotary
from st_fastbackend.engine.runtime import VARLEN_KERNELS, Runtime

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the stand-ins replace the CUDA kernels on the CPU")
SDPA_LOOP = Runtime("sdpa_loop", grouped_heads=True, window=True, is_causal=True, dtype=torch.float32)

CASES = {
    "mistral window 16": ("mistral", dict(sliding_window=16)),
    "qwen2 window in layer 1": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "mistral multi-query": ("mistral", dict(num_key_value_heads=1)),
    "bert": ("bert", {}),
    "distilbert": ("distilbert", {}),
    "embeddinggemma (symmetric window, scale)": ("gemma3_text", {}),
    "modernbert (symmetric window)": ("modernbert", {}),
}


@pytest.fixture(scope="module")
def case_texts(texts):
    return [t for t in texts if t]


@pytest.fixture(scope="module")
def plain_embeddings(st_model, case_texts):
    """case -> (folder, plain fp32 embeddings, plain bf16 embeddings), computed once per case."""

    @functools.cache
    def embed(case: str):
        family, overrides = CASES[case]
        folder = st_model(family, pooling_mode="mean", **overrides)
        plain32, _ = load_both(folder)
        plain16, _ = load_both(folder, model_kwargs={"dtype": torch.bfloat16})
        return folder, plain32.encode(case_texts), plain16.encode(case_texts)

    return embed


# Every release with eager layer seams; with compiled ones (the CUDA default) the newest of each kernel.
RELEASES = [(name, False) for name in kernel_standins.STANDINS] + [("torch 2.14", True), ("flash-attn 2.8", True)]


@pytest.mark.slow
@pytest.mark.parametrize("name, compiled", RELEASES, ids=lambda x: {True: "compiled", False: "eager"}.get(x, x))
@pytest.mark.parametrize("case", CASES)
def test_bf16_encode_through_each_kernel_release(standin, plain_embeddings, case_texts, name, compiled, case):
    standin(name)
    folder, reference, plain_bf16 = plain_embeddings(case)
    _, fast = load_both(folder, model_kwargs={"dtype": torch.bfloat16})
    fast[0].compiled_seams = compiled
    assert fast[0].attention_kernel == ("flash_attn" if name.startswith("flash") else "torch_varlen")
    assert fast[0].runtime.fused == compiled
    ours = fast.encode(case_texts, batch_size=8)
    assert kernel_standins.Calls.count > 0
    ours_error = one_minus_cosine(ours.astype(np.float32), reference)
    plain_error = one_minus_cosine(plain_bf16.astype(np.float32), reference)
    assert ours_error.max() <= 2 * plain_error.max()
    assert ours_error.mean() <= 2 * plain_error.mean()
    alone = np.stack([fast.encode(text) for text in case_texts[:6]])  # a text alone equals it in a pack
    np.testing.assert_allclose(ours[:6], alone, atol=1e-2, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fp32_never_reaches_a_flash_kernel_and_stays_exact(standin, plain_embeddings, case_texts, case):
    standin("torch 2.11")  # the release on the project's GPU machine
    folder, reference, _ = plain_embeddings(case)
    _, fast = load_both(folder)
    assert fast[0].attention_kernel not in VARLEN_KERNELS
    assert max_diff(reference, fast.encode(case_texts, batch_size=8)) <= TOLERANCE
    assert kernel_standins.Calls.count == 0


def test_rotary_tables_reach_the_device_once():
    """A copy from pageable host memory makes the host wait for the GPU's queue: inv_freq moves once, not per
    pack. (The meta device stands for the GPU: it records copies without computing.)"""
    rotary = Rotary(torch.rand(8), 1.0)
    positions = torch.arange(40, device="meta")
    with HostToDevice() as counted:
        for _ in range(3):
            rotary(positions, torch.bfloat16)
    assert counted.copies == 1
    assert "_on_device" not in rotary.__getstate__()  # a pickled model carries no copy on a device


def test_unattended_counts_reach_the_device_with_the_batch():
    """ColBERT's attend=False: the attended counts go to the GPU in the batch's one copy; the SDPA loop (fp32 queries
    on a GPU) and the kernels' gathered keys copy nothing more, per layer or per run of equal lengths."""
    lengths = [9, 9, 7, 7, 7, 4]  # three runs
    batch = PackedBatch.from_sequences([[1] * n for n in lengths]).with_attended([5, 9, 3, 7, 2, 4])
    with HostToDevice() as counted:
        on_device = batch.to("meta")
        moved = counted.copies
        q = torch.empty(sum(lengths), 2, 8, device="meta")
        for _ in range(3):  # layers
            sdpa_attention(q, q, q, on_device, causal=False, window=None, runtime=SDPA_LOOP)
        keys, _, longest = on_device.attended_keys
    assert moved == 4 and counted.copies == moved  # input_ids, position_ids, cu_seqlens, attended_counts
    assert keys.shape == (sum(batch.attended),) and longest == 9


@pytest.mark.slow
@pytest.mark.parametrize("name", ["torch 2.11", "flash-attn 2.8"])
def test_unattended_query_expansion_through_the_kernels(standin, tmp_path, case_texts, name):
    """ColBERT's attend=False on the kernel path: the attended keys gathered, the kernel given their own cu_seqlens;
    bf16 queries within bf16's error of the SDPA path's, which matches plain at fp32 (test_multi_vector_encoder)."""
    from hybrid_builders import build_colbert

    from st_fastbackend import MultiVectorEncoder

    folder = build_colbert(tmp_path, "bert", query_expansion={"strategy": "fixed", "attend": False, "length": 24})
    bf16 = {"dtype": torch.bfloat16}
    on_cpu = MultiVectorEncoder(str(folder), backend="fast", device=DEVICE, model_kwargs=bf16).encode_query(case_texts)
    standin(name)
    fast = MultiVectorEncoder(str(folder), backend="fast", device=DEVICE, model_kwargs=bf16)
    assert fast[0].attention_kernel != "sdpa_loop"
    through = fast.encode_query(case_texts)
    assert kernel_standins.Calls.count > 0 and kernel_standins.Calls.longer_keys > 0
    for a, b in zip(on_cpu, through, strict=True):
        assert a.shape == b.shape and max_diff(a, b) <= 2e-2


@pytest.mark.parametrize("name", ["torch 2.11", "flash-attn 2.8"])
def test_sparse_and_multi_vector_through_the_kernels(standin, tmp_path, case_texts, name):
    """SPLADE (the vocabulary projection fused with the pooling) and ColBERT on the kernel path in bf16: within
    bf16's error of the same models on the SDPA path, which match plain at fp32 (their own test files)."""
    from hybrid_builders import build_colbert, build_splade

    from st_fastbackend import MultiVectorEncoder, SparseEncoder

    bf16 = {"dtype": torch.bfloat16}
    folders = {SparseEncoder: build_splade(tmp_path / "s", "bert"), MultiVectorEncoder: build_colbert(tmp_path / "c")}
    on_cpu = {cls: cls(str(f), backend="fast", device=DEVICE, model_kwargs=bf16).encode_document(case_texts)
              for cls, f in folders.items()}  # fmt: skip
    standin(name)
    for cls, folder in folders.items():
        fast = cls(str(folder), backend="fast", device=DEVICE, model_kwargs=bf16)
        assert fast.packed_input.attention_kernel != "sdpa_loop"
        count = kernel_standins.Calls.count
        through = fast.encode_document(case_texts)
        assert kernel_standins.Calls.count > count
        if cls is SparseEncoder:
            a, b = on_cpu[cls].to_dense().float(), through.to_dense().float()
            assert ((a - b).abs().amax(1) / a.abs().amax(1).clamp_min(1)).max() <= 5e-2
        else:
            pairs = zip(on_cpu[cls], through, strict=True)
            assert all(x.shape == y.shape and max_diff(x, y) <= 5e-2 for x, y in pairs)
