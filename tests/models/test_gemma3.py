"""Gemma 3 text models on the packed decoder: EmbeddingGemma's pipeline (bidirectional attention, sliding and
full layers, mean pooling, two Dense layers, Normalize, its prompts) and causal Gemma 3, against plain
sentence-transformers on transformers' Gemma3TextModel."""

import json
import os

import numpy as np
import pytest
from builders import build_hf_model
from helpers import TOLERANCE, assert_bf16_error_within_twice_plain, load_both, max_diff

from st_fastbackend import SentenceTransformer, UnsupportedModelError

# EmbeddingGemma's prompts (its config_sentence_transformers.json, abridged).
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}
WINDOW = 9  # the small model's sliding_window=16 with use_bidirectional_attention: |i - j| <= 8
POOLING_MODES = ["mean", "lasttoken", "cls", "max", "weightedmean", ("mean", "lasttoken")]


def longest(plain, texts) -> int:
    """The longest text in tokens, after truncation."""
    return int(plain.tokenize(texts)["attention_mask"].sum(1).max())


def embedding_gemma(st_model, pooling_mode="mean", **overrides):
    """A small EmbeddingGemma-shaped folder: Transformer, Pooling, Dense 64 -> 96 -> 64, Normalize."""
    return st_model("gemma3_text", pooling_mode=pooling_mode, dense=(96, 64), prompts=PROMPTS, **overrides)


@pytest.mark.parametrize("pooling_mode", POOLING_MODES, ids=str)
def test_embedding_gemma_matches_plain(st_model, texts, pooling_mode):
    plain, fast = load_both(embedding_gemma(st_model, pooling_mode))
    assert fast[0].config.use_bidirectional_attention and type(fast[2]) is type(plain[2])  # Dense stays ST's own
    assert longest(plain, texts) == 256 > 2 * WINDOW  # truncated, and far beyond the window
    assert max_diff(plain.encode(texts, batch_size=8), fast.encode(texts, batch_size=8)) <= TOLERANCE


@pytest.mark.parametrize("include_prompt", [True, False])
def test_embedding_gemma_prompts(st_model, texts, include_prompt):
    plain, fast = load_both(embedding_gemma(st_model, include_prompt=include_prompt))
    assert max_diff(plain.encode_query(texts), fast.encode_query(texts)) <= TOLERANCE
    assert max_diff(plain.encode_document(texts), fast.encode_document(texts)) <= TOLERANCE
    assert max_diff(fast.encode_query(texts[2:6]), fast.encode(texts[2:6])) > 1e-3  # the prompt reached the model


@pytest.mark.parametrize("include_prompt", [True, False])
def test_causal_gemma3_prompt_computed_once(st_model, texts, include_prompt):
    """Causal Gemma 3 takes the shared-prompt pass (engine/prefix.py); EmbeddingGemma, bidirectional, cannot."""
    folder = embedding_gemma(st_model, include_prompt=include_prompt, use_bidirectional_attention=False)
    plain, fast = load_both(folder)
    assert fast[0].prefix_for(PROMPTS["query"]) is not None
    assert max_diff(plain.encode_query(texts), fast.encode_query(texts)) <= TOLERANCE
    _, bidirectional = load_both(embedding_gemma(st_model))
    assert bidirectional[0].prefix_for(PROMPTS["query"]) is None


def test_a_text_does_not_depend_on_its_batch(st_model, texts):
    _, fast = load_both(embedding_gemma(st_model))
    alone = np.stack([fast.encode(text) for text in texts])
    np.testing.assert_allclose(fast.encode(texts[::-1], batch_size=5)[::-1], alone, atol=1e-5, rtol=0)


VARIANTS = {
    "causal": dict(use_bidirectional_attention=False),
    "window 5, multi-query": dict(sliding_window=8, num_key_value_heads=1),
    "attention bias, scale 1/sqrt(head_dim)": dict(attention_bias=True, query_pre_attn_scalar=32),
    "linear rope on full layers": dict(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        }
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_gemma3_variants_match_plain(st_model, texts, variant):
    plain, fast = load_both(st_model("gemma3_text", pooling_mode="mean", **VARIANTS[variant]))
    assert max_diff(plain.encode(texts, batch_size=8), fast.encode(texts, batch_size=8)) <= TOLERANCE


def test_window_and_direction_change_the_result(st_model, texts):
    """Guards the tests above: the window and the bidirectional attention must each matter."""
    _, windowed = load_both(st_model("gemma3_text", pooling_mode="mean"))
    _, wide = load_both(st_model("gemma3_text", pooling_mode="mean", sliding_window=1024))
    _, causal = load_both(st_model("gemma3_text", pooling_mode="mean", use_bidirectional_attention=False))
    long_text = [max(texts, key=len)]
    assert max_diff(windowed.encode(long_text), wide.encode(long_text)) > 1e-3
    assert max_diff(windowed.encode(long_text), causal.encode(long_text)) > 1e-3


def test_bf16_error_within_twice_plain(st_model, texts):
    assert_bf16_error_within_twice_plain(embedding_gemma(st_model), [t for t in texts if t])


def test_attention_softcapping_is_refused(tmp_path):
    """transformers' Gemma3Attention does not apply attn_logit_softcapping (Gemma 2 did): refused, not guessed."""
    folder = build_hf_model(tmp_path / "hf", "gemma3_text")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 50.0}))
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping=50.0") as error:
        SentenceTransformer(str(folder), backend="fast", device="cpu")
    assert 'backend="torch"' in str(error.value)


# google/embeddinggemma-300m's config.json, but a vocabulary of the test tokenizer's size (262,144 rows of
# embeddings only cost memory: the lookup's numbers do not depend on the vocabulary's size).
EMBEDDING_GEMMA_300M = dict(
    hidden_size=768, intermediate_size=1152, num_hidden_layers=24, num_attention_heads=3, num_key_value_heads=1,
    head_dim=256, query_pre_attn_scalar=256, sliding_window=512, use_bidirectional_attention=True,
    max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4,
)  # fmt: skip
real_size = pytest.mark.skipif(
    not os.environ.get("ST_FASTBACKEND_REAL_SIZE"), reason="real-size models: set ST_FASTBACKEND_REAL_SIZE=1"
)


@real_size
def test_embedding_gemma_300m_shapes(st_model, texts):
    folder = st_model("gemma3_text", pooling_mode="mean", dense=(3072, 768), prompts=PROMPTS, max_seq_length=600,
                      **EMBEDDING_GEMMA_300M)  # fmt: skip
    plain, fast = load_both(folder)
    few = [texts[0], texts[2], texts[5], " ".join(texts)]  # empty, short, and one beyond the 257-token window
    assert longest(plain, few) == 600
    assert max_diff(plain.encode_query(few), fast.encode_query(few)) <= TOLERANCE
