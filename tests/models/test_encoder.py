"""BERT-family encoders on the packed engine: random BERT / RoBERTa / XLM-R / DistilBERT (each pooling mode against
plain sentence-transformers is in test_parity.py, with every family), and the real all-MiniLM-L6-v2."""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from builders import build_distilbert_mlm, build_hf_model
from helpers import DATA_DIR, TOLERANCE, load_both, max_diff, minilm_path, needs_data

from st_fastbackend import SentenceTransformer, UnsupportedModelError


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_encoder_prompt_excluded_and_batch_invariance(st_model, texts, family):
    plain, fast = load_both(st_model(family, pooling_mode="mean", include_prompt=False), prompts={"q": "query: "})
    assert max_diff(plain.encode(texts, prompt_name="q"), fast.encode(texts, prompt_name="q")) <= TOLERANCE
    alone = np.stack([fast.encode(text) for text in texts])
    np.testing.assert_allclose(fast.encode(texts[::-1], batch_size=5)[::-1], alone, atol=1e-5, rtol=0)


def test_roberta_positions_start_after_padding_idx(st_model):
    _, fast = load_both(st_model("roberta", pooling_mode="mean"))
    assert fast[0].preprocess(["ab cd"])["packed"].position_ids[0].item() == fast[0].config.pad_token_id + 1


def test_legacy_do_lower_case(st_model, texts, tmp_path):
    folder = shutil.copytree(st_model("bert", pooling_mode="mean"), tmp_path / "lower")
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": True}))
    plain, fast = load_both(folder)
    shouted = [text.upper() for text in texts]
    assert max_diff(plain.encode(shouted), fast.encode(shouted)) <= TOLERANCE
    assert max_diff(fast.encode(shouted), fast.encode(texts)) <= TOLERANCE


@pytest.mark.parametrize(
    "family, changes, named",
    [("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
     ("distilbert", {"activation": "gelu_made_up"}, "activation 'gelu_made_up'")],
    ids=["bert relative positions", "distilbert activation"],
)  # fmt: skip
def test_what_changes_the_math_is_refused_by_name(tmp_path, family, changes, named):
    folder = build_hf_model(tmp_path / "hf", family)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(UnsupportedModelError, match=named):
        SentenceTransformer(str(folder), backend="fast", device="cpu")


DISTILBERT_CHECKPOINTS = {
    "DistilBertModel": lambda folder: build_hf_model(folder, "distilbert"),
    "DistilBertForMaskedLM (distilbert. prefix, MLM head)": build_distilbert_mlm,
    "DistilBertForMaskedLM, untied projector": lambda folder: build_distilbert_mlm(folder, tie_word_embeddings=False),
}


@pytest.mark.parametrize("checkpoint", DISTILBERT_CHECKPOINTS)
def test_distilbert_token_states_match_transformers(tmp_path, texts, checkpoint):
    """Per-token last hidden states against transformers' DistilBertModel on the same folder (an MLM
    checkpoint's body, as AutoModel reads it), each text alone and unpadded there."""
    folder = DISTILBERT_CHECKPOINTS[checkpoint](tmp_path / "hf")
    fast = SentenceTransformer(str(folder), backend="fast", device="cpu")
    reference = transformers.AutoModel.from_pretrained(folder).eval()
    assert type(reference).__name__ == "DistilBertModel" and type(fast[0].model).__name__ == "DistilBert"
    ours = fast.encode(texts, output_value="token_embeddings", batch_size=8)
    for ids, states in zip(fast[0].texts.encode(texts), ours, strict=True):
        with torch.inference_mode():
            expected = reference(input_ids=torch.tensor([ids])).last_hidden_state[0]
        assert max_diff(states, expected) <= TOLERANCE


DISTILBERT_VARIANTS = {"sinusoidal_pos_embds (stored weights)": dict(sinusoidal_pos_embds=True),
                       "relu": dict(activation="relu")}  # fmt: skip


@pytest.mark.parametrize("variant", DISTILBERT_VARIANTS)
def test_distilbert_variants_match_plain(st_model, texts, variant):
    plain, fast = load_both(st_model("distilbert", pooling_mode="mean", **DISTILBERT_VARIANTS[variant]))
    assert max_diff(plain.encode(texts, batch_size=8), fast.encode(texts, batch_size=8)) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.real_model
@needs_data
def test_real_minilm_matches_plain_on_real_sentences():
    import csv

    with open(DATA_DIR / "stsb" / "stsb-test.tsv", encoding="utf8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:200]
    with open(DATA_DIR / "wikitext2" / "wikitext2_test_paragraphs.jsonl", encoding="utf8") as f:
        paragraphs = [json.loads(line)["text"] for _, line in zip(range(100), f, strict=False)]
    sentences = [r["sentence1"] for r in rows] + [r["sentence2"] for r in rows] + paragraphs
    plain, fast = load_both(minilm_path())
    assert fast[0].config.model_type == "bert" and fast.max_seq_length == 256
    assert max(len(ids) for ids in fast[0].texts.encode(sentences)) == 256  # long paragraphs are truncated
    assert max_diff(plain.encode(sentences), fast.encode(sentences)) <= TOLERANCE
