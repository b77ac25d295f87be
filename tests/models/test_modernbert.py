"""ModernBERT on the packed encoder (gte-modernbert-base and modernbert-embed-base are ModernBertModel with
CLS or mean pooling), against plain sentence-transformers on transformers' ModernBertModel."""

import os

import numpy as np
import pytest
from builders import build_st_model
from helpers import TOLERANCE, assert_bf16_error_within_twice_plain, load_both, max_diff
from test_gemma3 import longest

WINDOW = 9  # the small model's local_attention=16: |i - j| <= 8
POOLING_MODES = ["cls", "mean", "max", "lasttoken", "weightedmean", ("cls", "mean")]


@pytest.mark.parametrize("pooling_mode", POOLING_MODES, ids=str)
def test_modernbert_matches_plain(st_model, texts, pooling_mode):
    plain, fast = load_both(st_model("modernbert", pooling_mode=pooling_mode))
    assert fast[0].config.model_type == "modernbert"
    assert longest(plain, texts) == 256 > 2 * WINDOW  # truncated, and far beyond the local window
    assert max_diff(plain.encode(texts, batch_size=8), fast.encode(texts, batch_size=8)) <= TOLERANCE


def test_prompt_excluded_and_batch_invariance(st_model, texts):
    folder = st_model("modernbert", pooling_mode="mean", include_prompt=False)
    plain, fast = load_both(folder, prompts={"query": "search_query: "})  # nomic's prompt style
    assert max_diff(plain.encode(texts, prompt_name="query"), fast.encode(texts, prompt_name="query")) <= TOLERANCE
    alone = np.stack([fast.encode(text) for text in texts])
    np.testing.assert_allclose(fast.encode(texts[::-1], batch_size=5)[::-1], alone, atol=1e-5, rtol=0)


VARIANTS = {
    "biases": dict(norm_bias=True, attention_bias=True, mlp_bias=True),
    "gelu_pytorch_tanh, window 32": dict(hidden_activation="gelu_pytorch_tanh", local_attention=32),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_modernbert_variants_match_plain(st_model, texts, variant):
    plain, fast = load_both(st_model("modernbert", pooling_mode="mean", **VARIANTS[variant]))
    assert max_diff(plain.encode(texts, batch_size=8), fast.encode(texts, batch_size=8)) <= TOLERANCE


def test_masked_lm_checkpoint_loads(tmp_path, texts):
    """ModernBertForMaskedLM's checkpoint: the `model.` prefix, and a head and decoder embeddings never use."""
    plain, fast = load_both(build_st_model(tmp_path, "modernbert", pooling_mode="cls", masked_lm=True))
    assert max_diff(plain.encode(texts), fast.encode(texts)) <= TOLERANCE


def test_bf16_error_within_twice_plain(st_model, texts):
    assert_bf16_error_within_twice_plain(st_model("modernbert", pooling_mode="mean"), [t for t in texts if t])


# Alibaba-NLP/gte-modernbert-base's config.json (ModernBERT-base), with the test tokenizer's vocabulary.
GTE_MODERNBERT_BASE = dict(
    hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12, local_attention=128,
    layer_types=None, global_attn_every_n_layers=3, max_position_embeddings=8192, norm_eps=1e-5,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 160000.0}},
)  # fmt: skip


@pytest.mark.skipif(not os.environ.get("ST_FASTBACKEND_REAL_SIZE"), reason="set ST_FASTBACKEND_REAL_SIZE=1")
def test_gte_modernbert_base_shapes(st_model, texts):
    plain, fast = load_both(st_model("modernbert", pooling_mode="cls", max_seq_length=512, **GTE_MODERNBERT_BASE))
    few = [texts[0], texts[2], texts[5], " ".join(texts)]  # empty, short, and one beyond the local window
    assert longest(plain, few) == 512
    assert max_diff(plain.encode(few), fast.encode(few)) <= TOLERANCE
