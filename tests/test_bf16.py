"""bf16: error against the fp32 embeddings at most 2x what plain sentence-transformers in bf16 gives."""

import numpy as np
import pytest
import torch
from helpers import DATA_DIR, load_both, minilm_path, needs_data


def one_minus_cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return 1 - (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def assert_bf16_error_within_twice_plain(folder, texts):
    plain32, fast32 = load_both(folder)
    plain16, fast16 = load_both(folder, model_kwargs={"dtype": torch.bfloat16})
    reference = plain32.encode(texts)
    ours = one_minus_cosine(fast16.encode(texts).astype(np.float32), reference)
    theirs = one_minus_cosine(plain16.encode(texts).astype(np.float32), reference)
    assert ours.max() <= 2 * theirs.max()
    assert ours.mean() <= 2 * theirs.mean()
    assert np.abs(fast32.encode(texts) - reference).max() <= 1e-5  # the same folder is exact at fp32


@pytest.mark.parametrize("family", ["mistral", "qwen3", "bert"])
def test_bf16_error_bound_on_random_models(st_model, texts, family):
    assert_bf16_error_within_twice_plain(st_model(family, pooling_mode="mean"), [t for t in texts if t])


@needs_data
def test_bf16_error_bound_on_minilm_real_sentences():
    import csv

    with open(DATA_DIR / "stsb" / "stsb-dev.tsv", encoding="utf8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:150]
    assert_bf16_error_within_twice_plain(minilm_path(), [r["sentence1"] for r in rows])
