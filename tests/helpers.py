"""Loading both backends of one folder and comparing them."""

from __future__ import annotations

import numpy as np
from sentence_transformers import SentenceTransformer as PlainSentenceTransformer

from st_fastbackend import SentenceTransformer

TOLERANCE = 1e-5  # max abs difference on unit-norm fp32 embeddings (the correctness contract)


def load_both(folder, **kwargs):
    plain = PlainSentenceTransformer(str(folder), device="cpu", **kwargs)
    fast = SentenceTransformer(str(folder), backend="fast", device="cpu", **kwargs)
    return plain, fast


def max_diff(a, b) -> float:
    """Max abs difference; NaN where both are NaN counts as equal (e.g. max-pooling nothing), elsewhere as inf."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    diff = np.where(both_nan, 0.0, np.abs(a - b))
    return float(np.nan_to_num(diff, nan=np.inf).max())
