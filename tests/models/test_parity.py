"""fast vs plain sentence-transformers at fp32, per family, pooling mode and config variant."""

import pytest
from helpers import TOLERANCE, load_both, max_diff

from st_fastbackend.engine.families import FAMILIES as TABLE
from st_fastbackend.modules import PackedPooling, PackedTransformer

FAMILIES = list(TABLE)  # every family runs the reference test (tests/test_families.py holds the table to it)
DECODERS = [name for name, family in TABLE.items() if family.causal]
POOLING_MODES = [
    "lasttoken",
    "mean",
    "max",
    "cls",
    "weightedmean",
    "mean_sqrt_len_tokens",
    ("mean", "lasttoken", "max"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pooling_mode", POOLING_MODES, ids=str)
def test_every_family_and_pooling_mode_matches_plain(st_model, texts, family, pooling_mode):
    plain, fast = load_both(st_model(family, pooling_mode=pooling_mode))
    assert isinstance(fast[0], PackedTransformer) and isinstance(fast[1], PackedPooling)
    assert fast.get_backend() == "fast"
    assert max(len(ids) for ids in fast[0].texts.encode(texts)) == fast.max_seq_length == 256  # truncation hit
    special = len(fast[0].texts.encode([""])[0])  # <s> alone (a decoder), or the [CLS] x [SEP] of an encoder
    assert min(len(ids) for ids in fast[0].texts.encode(texts)) == special <= 2  # a text of its special tokens only
    assert max_diff(plain.encode(texts, batch_size=8), fast.encode(texts, batch_size=8)) <= TOLERANCE


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("pooling_mode", ["mean", "lasttoken", "cls", "weightedmean", "max"])
def test_pooling_without_prompt_tokens(st_model, texts, family, pooling_mode):
    folder = st_model(family, pooling_mode=pooling_mode, include_prompt=False)
    plain, fast = load_both(folder, prompts={"query": "Instruct: find the passage\nQuery: "})
    a = plain.encode(texts, prompt_name="query", batch_size=8)
    b = fast.encode(texts, prompt_name="query", batch_size=8)
    assert max_diff(a, b) <= TOLERANCE
    assert max_diff(b, fast.encode(texts, batch_size=8)) > 1e-3  # the prompt did reach the model


VARIANTS = {
    "mistral sliding window": ("mistral", dict(sliding_window=16)),
    "qwen2 window in layer 1": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "llama biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama linear rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0})),
    "llama yarn rope": (
        "llama",
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 128}),
    ),
    "llama dynamic rope": ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 100.0, "factor": 2})),
    "qwen3 attention bias": ("qwen3", dict(attention_bias=True)),
    "mistral multi-query": ("mistral", dict(num_key_value_heads=1)),
}  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_variants_match_plain(st_model, texts, variant):
    family, overrides = VARIANTS[variant]
    plain, fast = load_both(st_model(family, pooling_mode="mean", **overrides))
    assert max_diff(plain.encode(texts, batch_size=8), fast.encode(texts, batch_size=8)) <= TOLERANCE


def test_sliding_window_changes_the_result(st_model, texts):
    """Guards the variant above: a window shorter than the texts must matter."""
    _, full = load_both(st_model("mistral", pooling_mode="mean"))
    _, windowed = load_both(st_model("mistral", pooling_mode="mean", sliding_window=16))
    assert max_diff(full.encode(texts[3:4]), windowed.encode(texts[3:4])) > 1e-3
