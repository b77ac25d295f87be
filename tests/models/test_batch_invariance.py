"""A text's embedding must not depend on what else is in its batch, or where."""

import random

import numpy as np
import pytest
from helpers import DEVICE

from st_fastbackend import SentenceTransformer


@pytest.mark.parametrize("family", ["mistral", "qwen3", "distilbert"])
def test_alone_equals_inside_any_pack(st_model, texts, family):
    model = SentenceTransformer(str(st_model(family, pooling_mode="mean")), backend="fast", device=DEVICE)
    alone = np.stack([model.encode(text) for text in texts])
    together = model.encode(texts, batch_size=len(texts))
    shuffled_order = list(range(len(texts)))
    random.Random(0).shuffle(shuffled_order)
    shuffled = model.encode([texts[i] for i in shuffled_order], batch_size=7)
    np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)
    np.testing.assert_allclose(shuffled, alone[shuffled_order], atol=1e-5, rtol=0)
