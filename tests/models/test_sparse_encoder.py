"""SparseEncoder(backend="fast") against plain sentence-transformers on the same folder at fp32: SPLADE on each
masked-LM family (max and sum, relu and log1p_relu), inference-free SPLADE, CSR; every encode argument."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import DEVICE, TOLERANCE, max_diff
from hybrid_builders import build_csr, build_splade
from sentence_transformers import SparseEncoder as PlainSparseEncoder
from torch.utils._python_dispatch import TorchDispatchMode

from st_fastbackend import SparseEncoder, UnsupportedModelError
from st_fastbackend.engine.batch import PackedBatch, Tokens
from st_fastbackend.engine.families import FAMILIES as TABLE
from st_fastbackend.modules import splade

FAMILIES = [name for name, family in TABLE.items() if not family.causal]  # every encoder: each has a masked-LM head


def load_both(folder, **kwargs):
    plain = PlainSparseEncoder(str(folder), device=DEVICE, **kwargs)
    fast = SparseEncoder(str(folder), backend="fast", device=DEVICE, **kwargs)
    return plain, fast


def assert_same(plain_rows, fast_rows) -> None:
    """The dense view within the contract, and the same active dimensions."""
    plain_rows, fast_rows = (r.to_dense() if r.is_sparse else r for r in (plain_rows, fast_rows))
    assert fast_rows.shape == plain_rows.shape
    assert max_diff(plain_rows, fast_rows) <= TOLERANCE * max(1.0, float(plain_rows.abs().max()))
    assert torch.equal(plain_rows.cpu() != 0, fast_rows.cpu() != 0)


@pytest.fixture(scope="module")
def splade_folder(tmp_path_factory):
    return lambda family, **kw: build_splade(tmp_path_factory.mktemp(f"splade-{family}"), family, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_splade_matches_plain(splade_folder, texts, family):
    plain, fast = load_both(splade_folder(family))
    assert_same(plain.encode(texts[:24], convert_to_tensor=True), fast.encode(texts[:24], convert_to_tensor=True))


@pytest.mark.parametrize(("strategy", "activation"), [("sum", "relu"), ("max", "log1p_relu"), ("sum", "log1p_relu")])
def test_splade_pooling_modes(splade_folder, texts, strategy, activation):
    plain, fast = load_both(splade_folder("bert", pooling_strategy=strategy, activation_function=activation))
    assert_same(plain.encode(texts[:24], convert_to_tensor=True), fast.encode(texts[:24], convert_to_tensor=True))


def test_vocabulary_projection_runs_in_slices(splade_folder, texts, monkeypatch):
    """Slices of 7 tokens (sequences cut across slices) give what one slice gives, and no vocabulary-wide tensor
    is larger than a slice: never [B, L, vocab], nor [T, vocab]."""
    plain, fast = load_both(splade_folder("bert"))
    expected = plain.encode(texts[:24], convert_to_tensor=True).to_dense()
    for name in ("SLICE_ELEMENTS", "SCATTER_SLICE_ELEMENTS"):  # a CPU's slices, a GPU's
        monkeypatch.setattr(splade, name, 7 * fast.get_embedding_dimension())
    rows, logits = [], splade._Head.logits
    monkeypatch.setattr(splade._Head, "logits", lambda head, h: rows.append(len(h)) or logits(head, h))
    assert_same(expected, fast.encode(texts[:24], convert_to_tensor=True))
    assert max(rows) == 7 and len(rows) > 24


@pytest.mark.parametrize(("strategy", "activation"), [("max", "relu"), ("sum", "log1p_relu")])
def test_one_scatter_per_slice_gives_the_per_text_rows(splade_folder, texts, monkeypatch, strategy, activation):
    """The GPU's reduction (one scatter per slice) forced on the CPU, in slices of 7 tokens that cut sequences: the
    per-text reduction's rows, exactly for max, within fp32 rounding for sum (it accumulates in fp32)."""
    fast = SparseEncoder(str(splade_folder("bert", pooling_strategy=strategy, activation_function=activation)),
                         backend="fast", device="cpu")  # fmt: skip
    for name in ("SLICE_ELEMENTS", "SCATTER_SLICE_ELEMENTS"):
        monkeypatch.setattr(splade, name, 7 * fast.get_embedding_dimension())
    per_text = fast.encode(texts[:24], convert_to_tensor=True, convert_to_sparse_tensor=False)
    monkeypatch.setattr(splade, "PER_TEXT_DEVICES", ())
    per_slice = fast.encode(texts[:24], convert_to_tensor=True, convert_to_sparse_tensor=False)
    if strategy == "max":
        assert torch.equal(per_slice, per_text)
    else:
        torch.testing.assert_close(per_slice, per_text, rtol=1e-6, atol=0)


class Operations(TorchDispatchMode):
    """Counts the operations dispatched: on a GPU, each is at least one kernel launch."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("strategy", ["max", "sum"])
def test_launches_per_slice_do_not_grow_with_the_texts(monkeypatch, strategy):
    """On a GPU (the meta device stands in: it runs no kernel, and is not a CPU), a pack of 256 tokens in slices of
    64 launches as many kernels as 4 texts or as 32: not a few per text per slice."""
    vocab, hidden = 1000, 16
    monkeypatch.setattr(splade, "SCATTER_SLICE_ELEMENTS", 64 * vocab)
    decoder = splade.Linear(hidden, vocab, device="meta")
    head = splade._Head(decoder, torch.relu, torch.nn.LayerNorm(hidden, device="meta"), decoder)
    pooling = splade.PackedSpladePooling(pooling_strategy=strategy)
    counts = []
    for lengths in ([64] * 4, [8] * 32):
        packed = PackedBatch.from_sequences([[1] * n for n in lengths]).to("meta")
        features = {"token_embeddings": torch.empty(256, hidden, device="meta"), "mlm_head": head, "packed": packed}
        with Operations() as counted:
            rows = pooling(features)["sentence_embedding"]
        assert rows.shape == (len(lengths), vocab)
        counts.append(counted.count)
    assert counts[0] == counts[1]


def test_batch_invariance(splade_folder, texts):
    fast = SparseEncoder(str(splade_folder("bert")), backend="fast", device=DEVICE)
    together = fast.encode(texts[:16], convert_to_tensor=True, convert_to_sparse_tensor=False)
    alone = torch.stack([fast.encode(t, convert_to_tensor=True, convert_to_sparse_tensor=False) for t in texts[:16]])
    assert max_diff(together, alone) <= TOLERANCE


def test_encode_arguments(splade_folder, texts):
    """max_active_dims, convert_to_sparse_tensor, convert_to_tensor, save_to_cpu, prompts, encode_query/document."""
    plain, fast = load_both(splade_folder("bert", prompts={"query": "query: ", "document": "passage: "}))
    for kwargs in [dict(max_active_dims=5), dict(convert_to_sparse_tensor=False), dict(save_to_cpu=True),
                   dict(prompt="search: "), dict(prompt_name="query")]:  # fmt: skip
        expected, found = (m.encode(texts[:10], convert_to_tensor=True, **kwargs) for m in (plain, fast))
        assert expected.is_sparse == found.is_sparse and expected.device == found.device, kwargs
        assert_same(expected, found)
    listed = fast.encode(texts[:3], convert_to_tensor=False)
    assert isinstance(listed, list) and len(listed) == 3 and listed[0].is_sparse
    assert_same(plain.encode_query(texts[:5]), fast.encode_query(texts[:5]))
    assert_same(plain.encode_document(texts[:5]), fast.encode_document(texts[:5]))
    single = fast.encode(texts[3])
    assert single.shape == (fast.get_embedding_dimension(),)
    assert fast.encode([], convert_to_tensor=True).numel() == 0


def test_decode_and_similarity_as_plain(splade_folder, texts):
    plain, fast = load_both(splade_folder("bert"))
    a, b = plain.encode(texts[:4]), fast.encode(texts[:4])
    assert max_diff(plain.similarity(a, a), fast.similarity(b, b)) <= 1e-4
    assert [t for t, _ in plain.decode(a[2], top_k=5)] == [t for t, _ in fast.decode(b[2], top_k=5)]


def test_inference_free_splade(splade_folder, texts):
    """Queries through the static embedding (no transformer), documents through the packed SPLADE."""
    plain, fast = load_both(splade_folder("bert", router=True))
    assert_same(plain.encode_query(texts[:8]), fast.encode_query(texts[:8]))
    assert_same(plain.encode_document(texts[:8]), fast.encode_document(texts[:8]))
    for encode in (fast.encode_query, fast.encode_document):  # the static route too: refused, never ignored
        with pytest.raises(UnsupportedModelError, match=r"processing_kwargs in encode\(\)"):
            encode(texts[:2], processing_kwargs={"text": {"max_length": 4}})


def test_csr(tmp_path, texts):
    plain, fast = load_both(build_csr(tmp_path, "bert"))
    for kwargs in [{}, dict(max_active_dims=4)]:
        expected, found = (m.encode(texts[:12], convert_to_tensor=True, **kwargs) for m in (plain, fast))
        assert_same(expected, found)


def test_save_loads_in_plain(splade_folder, tmp_path, texts):
    """Saved under sentence-transformers' module types (a Router's too): plain loads what the fast backend saved."""
    for router in (False, True):
        fast = SparseEncoder(str(splade_folder("bert", router=router)), backend="fast", device=DEVICE)
        fast.save(str(tmp_path / f"saved-{router}"))
        assert "st_fastbackend" not in (tmp_path / f"saved-{router}" / "modules.json").read_text()
        for router_json in (tmp_path / f"saved-{router}").rglob("router_config.json"):
            assert "st_fastbackend" not in json.dumps(json.loads(router_json.read_text()))
        plain = PlainSparseEncoder(str(tmp_path / f"saved-{router}"), device=DEVICE)
        assert_same(plain.encode_document(texts[:6]), fast.encode_document(texts[:6]))


def test_bare_masked_lm_checkpoint(tmp_path, texts):
    """A bare *ForMaskedLM: SPLADE with max pooling, as plain builds it."""
    from builders import build_hf_model

    folder = build_hf_model(tmp_path / "mlm", "bert", masked_lm=True)
    plain, fast = load_both(folder)
    assert_same(plain.encode(texts[:8]), fast.encode(texts[:8]))
    with pytest.raises(UnsupportedModelError, match="ForMaskedLM"):
        SparseEncoder(str(build_hf_model(tmp_path / "base", "bert")), backend="fast", device=DEVICE)


def test_head_products_follow_the_body(splade_folder):
    """The vocabulary projection takes the body's oneDNN products on a CPU (reordered weights), and stays in
    floating point where the body runs int8; the tied decoder is the word embeddings themselves, not a copy."""
    from st_fastbackend.engine import onednn, quantize
    from st_fastbackend.engine.layers import Linear

    fast = SparseEncoder(str(splade_folder("bert")), backend="fast", device=DEVICE)
    body = next(m for m in fast[0].model.modules() if isinstance(m, Linear))
    assert fast[0].head.decoder.product_dtype == body.product_dtype
    if DEVICE == "cpu":
        assert body.product_dtype == onednn.product_dtype(torch.float32)
    embeddings = fast[0].model.embeddings.word_embeddings.weight
    assert fast[0].head.decoder.weight.data_ptr() == embeddings.data_ptr()
    if DEVICE == "cpu" and quantize.int8_supported():
        quantized = {"quantize": "int8"}
        int8 = SparseEncoder(str(splade_folder("bert")), backend="fast", device=DEVICE, model_kwargs=quantized)
        assert next(m for m in int8[0].model.modules() if isinstance(m, Linear)).product_dtype == torch.int8
        assert int8[0].head.decoder.product_dtype in (torch.float32, None)


def test_forward_with_gradients_on(splade_folder, texts):
    """forward_sequences outside inference mode (the head's parameters want gradients): the same rows."""
    fast = SparseEncoder(str(splade_folder("bert")), backend="fast", device=DEVICE)
    ids = [Tokens(i) for i in fast.packed_input.texts.encode(texts[2:6])]
    with torch.no_grad():
        expected = fast.forward_sequences(ids)["sentence_embedding"]
    assert max_diff(fast.forward_sequences(ids)["sentence_embedding"].detach(), expected) <= TOLERANCE


def test_module_classes_outside_sentence_transformers_are_not_imported(splade_folder, tmp_path, monkeypatch):
    """A modules.json type outside sentence_transformers is not imported by the fast backend before
    sentence-transformers' remote-code check refuses it."""
    import shutil
    import sys

    folder = shutil.copytree(splade_folder("bert"), tmp_path / "evil")
    modules = json.loads((folder / "modules.json").read_text())
    modules[1]["type"] = "evil_module_for_the_test.Pooling"
    (folder / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "evil_module_for_the_test.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="trust_remote_code"):
        SparseEncoder(str(folder), backend="fast", device=DEVICE)
    assert "evil_module_for_the_test" not in sys.modules
