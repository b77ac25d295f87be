"""HybridEncoder and the FlagEmbedding-shaped face against FlagEmbedding 1.4.2's own outputs on a tiny BGE-M3-shaped
folder (tests/data/bge_m3: made by make_reference.py, which says how to regenerate them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer as PlainSentenceTransformer

from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.models.hybrid import HybridEncoder

DATA = Path(__file__).parent.parent / "data" / "bge_m3"
MODEL = DATA / "model"
TEXTS = json.loads((DATA / "texts.json").read_text())


@pytest.fixture(scope="module")
def reference() -> dict:
    found = np.load(DATA / "reference.npz")
    ids, values = np.split(found["sparse_ids"], np.cumsum(found["sparse_counts"])[:-1]), np.split(
        found["sparse_values"], np.cumsum(found["sparse_counts"])[:-1])  # fmt: skip
    return {
        "dense": found["dense"],
        "lexical": [dict(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, values, strict=True)],
        "colbert": np.split(found["colbert"], np.cumsum(found["colbert_counts"])[:-1]),
        "lexical_scores": found["lexical_scores"],
        "colbert_scores": found["colbert_scores"],
    }


@pytest.fixture(scope="module")
def model() -> HybridEncoder:
    return HybridEncoder(str(MODEL), device="cpu")


def assert_lexical(found: dict, expected: dict) -> None:
    assert sorted(found) == sorted(expected)
    assert np.allclose([found[k] for k in expected], list(expected.values()), atol=1e-5, rtol=0)


def assert_matches(out, reference: dict, order) -> None:
    assert np.abs(out.dense - reference["dense"][order]).max() < 1e-5
    for found, i in zip(out.lexical_weights, order, strict=True):
        assert_lexical(found, reference["lexical"][i])
    for found, i in zip(out.multi_vector, order, strict=True):
        assert found.shape == reference["colbert"][i].shape
        assert np.abs(found - reference["colbert"][i]).max() < 1e-5


def test_reference_is_not_trivial(reference):
    """The texts exercise every part of the rules: a dropped zero weight, a repeated id, <unk>, a cut text."""
    assert any(len(w) == 0 for w in reference["lexical"]) and any(len(w) > 5 for w in reference["lexical"])
    assert max(len(v) for v in reference["colbert"]) == 63  # cut at 64 tokens, CLS dropped


def test_encode_all_matches_flagembedding(model, reference):
    out = model.encode_all(TEXTS)
    assert_matches(out, reference, range(len(TEXTS)))
    dense_sparse = out.sparse.to_dense()
    for row, weights in zip(dense_sparse, out.lexical_weights, strict=True):
        assert {int(i): float(row[i]) for i in row.nonzero().squeeze(1)} == weights


@pytest.mark.slow
def test_encode_all_is_batch_invariant(model, reference):
    """Alone, in reversed order, two at a time: a text's outputs are the same."""
    order = list(reversed(range(len(TEXTS))))
    assert_matches(model.encode_all([TEXTS[i] for i in order], batch_size=2), reference, order)
    for i in (0, 3, len(TEXTS) - 2):
        assert_matches(model.encode_all([TEXTS[i]]), reference, [i])


def test_encode_is_plain_sentence_transformers(model):
    plain = PlainSentenceTransformer(str(MODEL), device="cpu").encode(TEXTS)
    assert np.abs(model.encode(TEXTS) - plain).max() < 1e-5


def test_only_asked_outputs(model, reference):
    out = model.encode_all(TEXTS[:3], dense=False, sparse=True, multi_vector=False)
    assert out.dense is None and out.multi_vector is None
    assert_lexical(out.lexical_weights[2], reference["lexical"][2])
    with pytest.raises(ValueError, match="none of dense, sparse, multi_vector"):
        model.encode_all(TEXTS, dense=False, sparse=False, multi_vector=False)


def test_flagembedding_face(reference):
    from st_fastbackend.flag import BGEM3FlagModel

    flag = BGEM3FlagModel(str(MODEL), passage_max_length=64, devices="cpu")
    out = flag.encode(TEXTS, return_dense=True, return_sparse=True, return_colbert_vecs=True)
    assert np.abs(out["dense_vecs"] - reference["dense"]).max() < 1e-5
    assert all(isinstance(k, str) for w in out["lexical_weights"] for k in w)
    lexical = flag.compute_lexical_matching_score(out["lexical_weights"], out["lexical_weights"])
    assert np.abs(lexical - reference["lexical_scores"]).max() < 1e-4
    colbert = [[float(flag.colbert_score(q, p)) for p in out["colbert_vecs"]] for q in out["colbert_vecs"]]
    assert np.abs(np.array(colbert) - reference["colbert_scores"]).max() < 1e-5
    only_dense = flag.encode(TEXTS[:2])
    assert only_dense["lexical_weights"] is None and only_dense["colbert_vecs"] is None
    one = flag.encode(TEXTS[2], return_sparse=True, max_length=5)  # a string gives one row; cut at 5 tokens
    assert one["dense_vecs"].shape == (64,) and len(one["lexical_weights"]) <= 3
    assert flag.model.max_seq_length == 64  # the folder's own limit is back after the call


def test_missing_head_is_named(tmp_path):
    shutil.copytree(MODEL, tmp_path / "m")
    (tmp_path / "m" / "colbert_linear.pt").unlink()
    with pytest.raises(UnsupportedModelError, match="colbert_linear.pt"):
        HybridEncoder(str(tmp_path / "m"), device="cpu")


def test_wrong_head_shape_is_named(tmp_path):
    shutil.copytree(MODEL, tmp_path / "m")
    torch.save(torch.nn.Linear(32, 1).state_dict(), tmp_path / "m" / "sparse_linear.pt")
    with pytest.raises(UnsupportedModelError, match=r"sparse_linear.pt holding .*backend=\"torch\""):
        HybridEncoder(str(tmp_path / "m"), device="cpu")


def test_a_bias_of_the_wrong_shape_is_named(tmp_path):
    shutil.copytree(MODEL, tmp_path / "m")
    state = torch.load(MODEL / "colbert_linear.pt", weights_only=True)
    torch.save({"weight": state["weight"], "bias": state["bias"][:1]}, tmp_path / "m" / "colbert_linear.pt")
    with pytest.raises(UnsupportedModelError, match="colbert_linear.pt holding"):
        HybridEncoder(str(tmp_path / "m"), device="cpu")


def test_save_writes_both_heads_and_loads_back(model, reference, tmp_path):
    model.save(str(tmp_path / "saved"))
    assert_matches(HybridEncoder(str(tmp_path / "saved"), device="cpu").encode_all(TEXTS), reference,
                   list(range(len(TEXTS))))  # fmt: skip


def test_check_compares_with_plain_sentence_transformers(model):
    """check() loads the plain side as a SentenceTransformer with backend="torch" (HybridEncoder has no other)."""
    report = model.check(TEXTS[:4])
    assert report.passed and report.failed == [] and report.cases, str(report)


def plain_bf16(reference: dict) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """FlagEmbedding's rules on transformers' own XLM-RoBERTa in bf16, one text at a time: the dense vectors, the
    lexical weights over the vocabulary, the ColBERT vectors."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(MODEL))
    hf = transformers.AutoModel.from_pretrained(str(MODEL), dtype=torch.bfloat16).eval()
    sparse, colbert = (
        torch.load(MODEL / name, weights_only=True) for name in ("sparse_linear.pt", "colbert_linear.pt")
    )
    unused = [tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id]
    dense, lexical, vectors = [], [], []
    with torch.inference_mode():
        for text in TEXTS:
            ids = tokenizer(text, truncation=True, max_length=64, return_tensors="pt")["input_ids"]
            hidden = hf(input_ids=ids).last_hidden_state[0]  # [n, H] bf16
            dense.append(torch.nn.functional.normalize(hidden[0].float(), dim=-1).numpy())
            weights = torch.relu(hidden @ sparse["weight"].bfloat16().T + sparse["bias"].bfloat16()).float()[:, 0]
            row = torch.zeros(len(tokenizer)).scatter_reduce(0, ids[0], weights, "amax")
            row[unused] = 0
            lexical.append(row.numpy())
            found = hidden[1:] @ colbert["weight"].bfloat16().T + colbert["bias"].bfloat16()
            vectors.append(torch.nn.functional.normalize(found.float(), dim=-1).numpy())
    return np.stack(dense), lexical, vectors


def as_vocabulary(weights: dict, size: int) -> np.ndarray:
    row = np.zeros(size, np.float32)
    row[list(weights)] = list(weights.values())
    return row


@pytest.mark.slow
def test_bf16_error_within_three_times_plain(reference):
    """Each output's bf16 error against FlagEmbedding's fp32 one at most ~3x that of transformers' own bf16 model."""
    ours = HybridEncoder(str(MODEL), device="cpu", model_kwargs={"dtype": torch.bfloat16}).encode_all(TEXTS)
    dense, lexical, vectors = plain_bf16(reference)
    size = len(lexical[0])
    assert np.abs(ours.dense - reference["dense"]).max() <= 3 * np.abs(dense - reference["dense"]).max()
    exact = np.stack([as_vocabulary(w, size) for w in reference["lexical"]])
    found = np.stack([as_vocabulary(w, size) for w in ours.lexical_weights])
    assert np.abs(found - exact).max() <= 3 * np.abs(np.stack(lexical) - exact).max()
    theirs = max(np.abs(v - r).max() for v, r in zip(vectors, reference["colbert"], strict=True))
    assert max(np.abs(v - r).max() for v, r in zip(ours.multi_vector, reference["colbert"], strict=True)) <= 3 * theirs
    assert theirs > 0  # bf16 differs from fp32: the bound is not vacuous


def test_the_heads_reach_the_device_once_not_per_pack(model, monkeypatch):
    """The server asks for a row rule per pack: the heads are copied to the pack's device and dtype once, and again
    only after the model moves; a pickled model carries no such copy."""
    import pickle

    copies = []
    heads_to = type(model.heads).to
    monkeypatch.setattr(type(model.heads), "to", lambda self, *a: copies.append(a) or heads_to(self, *a))
    model._on_device = None
    for _ in range(3):
        model.encode_all(TEXTS, batch_size=4)
    assert len(copies) == 1
    assert "_on_device" not in pickle.loads(pickle.dumps(model)).__dict__
    model.to("cpu")
    model.encode_all(TEXTS[:2])
    assert len(copies) == 2
