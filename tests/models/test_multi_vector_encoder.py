"""MultiVectorEncoder(backend="fast") against plain sentence-transformers on the same folder at fp32: per-token
vectors and masks, query and document lengths, query expansion, the skiplist, every encode argument."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, TOLERANCE, max_diff
from hybrid_builders import build_colbert
from sentence_transformers import MultiVectorEncoder as PlainMultiVectorEncoder
from transfers import HostToDevice, HostWaits

from st_fastbackend import MultiVectorEncoder, UnsupportedModelError
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.families import FAMILIES as TABLE
from st_fastbackend.modules.multi_vector import PackedMultiVectorMask

FAMILIES = [name for name, family in TABLE.items() if not family.causal]  # every encoder: attend=False is theirs
EXPANSION = {"strategy": "fixed", "attend": True, "length": 24}


def load_both(folder, **kwargs):
    plain = PlainMultiVectorEncoder(str(folder), device=DEVICE, **kwargs)
    fast = MultiVectorEncoder(str(folder), backend="fast", device=DEVICE, **kwargs)
    return plain, fast


def assert_same(plain_vectors: list, fast_vectors: list) -> None:
    """Per text the same scored tokens (shapes), each vector within the contract."""
    assert len(plain_vectors) == len(fast_vectors)
    for expected, found in zip(plain_vectors, fast_vectors, strict=True):
        assert tuple(found.shape) == tuple(expected.shape)
        assert max_diff(expected, found) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_plain(tmp_path, texts, family):
    plain, fast = load_both(build_colbert(tmp_path, family))
    assert_same(plain.encode_document(texts[:24]), fast.encode_document(texts[:24]))
    assert_same(plain.encode_query(texts[:24]), fast.encode_query(texts[:24]))


@pytest.mark.parametrize("strategy", ["fixed", "min"])
def test_lengths_and_query_expansion(tmp_path, texts, strategy):
    expansion = {**EXPANSION, "strategy": strategy}
    folder = build_colbert(tmp_path, "bert", query_expansion=expansion, query_length=40, document_length=60)
    plain, fast = load_both(folder)
    queries = fast.encode_query(texts[:24])
    assert_same(plain.encode_query(texts[:24]), queries)
    assert min(len(q) for q in queries) == 24  # short queries expanded to the expansion length
    assert_same(plain.encode_document(texts[:24]), fast.encode_document(texts[:24]))


def test_skiplist_and_prompts(tmp_path, texts):
    folder = build_colbert(tmp_path, "bert", skiplist_words=["</s>", "a"], prompts={"query": "q: ", "document": "d: "})
    plain, fast = load_both(folder)
    assert_same(plain.encode_document(texts[:16]), fast.encode_document(texts[:16]))
    assert_same(plain.encode_query(texts[:16]), fast.encode_query(texts[:16]))


def test_skiplist_and_allowlist_reach_the_device_once(tmp_path, texts):
    """The skiplist and the allowlist (keep_only_token_ids) move to the device at the first pack, not at every one
    (the meta device stands in for the GPU), and again when the allowlist changes: the same vectors as plain."""
    plain, fast = load_both(build_colbert(tmp_path, "bert", skiplist_words=["a", "is"]))
    mask = next(module for module in fast if isinstance(module, PackedMultiVectorMask))
    packed = PackedBatch.from_sequences([[5, 6, 9], [7, 8]]).to("meta")
    for allowlist in ([i for i in range(1000) if i % 3], [i for i in range(1000) if i % 4]):
        for model in (plain, fast):
            next(m for m in model if hasattr(m, "keep_only_token_ids")).keep_only_token_ids = allowlist
        assert_same(plain.encode_document(texts[1:17]), fast.encode_document(texts[1:17]))
        with HostToDevice() as counted:
            for _ in range(3):  # packs
                mask({"packed": packed}, task="document")
        assert counted.copies == 2  # the skiplist, the allowlist


def test_encode_arguments(tmp_path, texts):
    plain, fast = load_both(build_colbert(tmp_path, "bert"))
    for kwargs in [dict(normalize_embeddings=True), dict(convert_to_numpy=True), dict(task="query"),
                   dict(prompt="search: ")]:  # fmt: skip
        expected, found = (m.encode(texts[:10], **kwargs) for m in (plain, fast))
        assert type(expected[0]) is type(found[0]), kwargs
        assert_same(expected, found)
    single = fast.encode(texts[4])
    assert isinstance(single, torch.Tensor) and single.ndim == 2
    scores = (plain.similarity(plain.encode_query(texts[:3]), plain.encode_document(texts[3:8])),
              fast.similarity(fast.encode_query(texts[:3]), fast.encode_document(texts[3:8])))  # fmt: skip
    assert max_diff(*scores) <= 1e-4
    with pytest.raises(UnsupportedModelError, match="output_value=None"):
        fast.encode(texts[:2], output_value=None)


def test_batch_invariance(tmp_path, texts):
    fast = MultiVectorEncoder(str(build_colbert(tmp_path, "bert")), backend="fast", device=DEVICE)
    together = fast.encode_document(texts[:16])
    alone = [fast.encode_document(t) for t in texts[:16]]
    assert_same(alone, together)


def test_host_waits_per_pack_do_not_grow_with_the_texts(tmp_path, texts, monkeypatch):
    """From a GPU, a pack's rows reach the host after one wait (for the counts; the rows are gathered on the device
    and copied without waiting), whatever the number of texts: in encode() and in the server's rows. The CPU stands
    in for the GPU (tests/transfers.py)."""
    fast = MultiVectorEncoder(str(build_colbert(tmp_path, "bert", skiplist_words=["a"])), backend="fast", device="cpu")
    fast.encode_document(texts[:2])  # the skiplist reaches the device (once: test_skiplist_and_allowlist_...)
    inner, waits = fast._packed_inference, []

    def counted(*args, **kwargs):
        with HostWaits() as counter:
            found = inner(*args, **kwargs)
        waits.append(counter.count)
        return found

    monkeypatch.setattr(fast, "_packed_inference", counted)
    served = []
    for n in (4, 32):  # one pack each
        assert len(fast.encode_document(texts[:n], batch_size=64)) == n
        out = fast.forward_sequences(
            fast[0].encode_task(texts[:n], None, "document", 0), module_kwargs={"task": "document"}
        )
        with HostWaits() as counter:
            assert len(fast.served_rows("token_embeddings", out)) == n
        served.append(counter.count)
    assert waits == [1, 1] and served == [2, 2]  # the counts; the server also copies the rows (it needs them now)


def test_save_loads_in_plain(tmp_path, texts):
    fast = MultiVectorEncoder(str(build_colbert(tmp_path / "m", "bert", query_expansion=EXPANSION)), backend="fast",
                              device=DEVICE)  # fmt: skip
    fast.save(str(tmp_path / "saved"))
    assert "st_fastbackend" not in (tmp_path / "saved" / "modules.json").read_text()
    plain = PlainMultiVectorEncoder(str(tmp_path / "saved"), device=DEVICE)
    assert_same(plain.encode_query(texts[:6]), fast.encode_query(texts[:6]))


@pytest.mark.parametrize("family", FAMILIES)
def test_unattended_query_expansion(tmp_path, texts, family):
    """Classic ColBERT (attend=False): expansion tokens attend to the query, nothing attends to them."""
    folder = build_colbert(tmp_path, family, query_expansion={**EXPANSION, "attend": False})
    plain, fast = load_both(folder)
    assert_same(plain.encode_query(texts[:24]), fast.encode_query(texts[:24]))
    attended = MultiVectorEncoder(str(build_colbert(tmp_path / "attended", family, query_expansion=EXPANSION)),
                                  backend="fast", device=DEVICE)  # fmt: skip
    assert max_diff(plain.encode_query(texts[1]), attended.encode_query(texts[1])) > 1e-3  # "a": mostly expansion


def test_unattended_expansion_on_a_decoder_is_refused(tmp_path):
    folder = build_colbert(tmp_path, "qwen3", query_expansion={**EXPANSION, "attend": False})
    with pytest.raises(UnsupportedModelError, match="attend=False"):
        MultiVectorEncoder(str(folder), backend="fast", device=DEVICE)


def test_an_expansion_token_outside_the_vocabulary_is_refused(tmp_path):
    """As plain refuses it at load (its own check), rather than padding queries with [UNK]."""
    import json

    folder = build_colbert(tmp_path, "bert", query_expansion=EXPANSION)
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    config["query_expansion"]["token"] = "[NOT_A_TOKEN]"
    (folder / "sentence_bert_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="isn't in this tokenizer's vocabulary"):
        MultiVectorEncoder(str(folder), backend="fast", device=DEVICE)


def test_bad_lengths_and_lone_surrogates_are_named(tmp_path):
    """query_length=-1 reached the Rust tokenizer as an OverflowError (plain's too); a lone surrogate as its
    TypeError. Each is a ValueError naming the argument, or the input and the code point."""
    folder = build_colbert(tmp_path, "bert", query_length=40, document_length=60)
    fast = MultiVectorEncoder(str(folder), backend="fast", device=DEVICE)
    with pytest.raises(ValueError, match=r"^Input 1 holds a lone surrogate \(U\+DFFF\)"):
        fast.encode_document(["fine", "bad \udfff"])
    fast[0].query_length = -1
    with pytest.raises(ValueError, match="^query_length must be a positive number of tokens or None, got -1"):
        fast.encode_query(["a query"])
    config = folder / "sentence_bert_config.json"
    config.write_text(config.read_text().replace('"document_length": 60', '"document_length": 0'))
    with pytest.raises(ValueError, match="^document_length must be a positive number of tokens or None, got 0"):
        MultiVectorEncoder(str(folder), backend="fast", device=DEVICE)
