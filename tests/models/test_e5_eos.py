"""e5-mistral's tokenizer: tokenizer_config.json asks for </s>, tokenizer.json adds only <s>.

transformers >= 5 follows tokenizer.json, so plain sentence-transformers pools the last content
token. The fast backend follows the model card: tokenize to max_length - 1, append </s>.
"""

import json
import logging

import pytest
import torch
import transformers
from builders import add_e5_tokenizer_contradiction, build_st_model
from helpers import DEVICE, TOLERANCE, max_diff
from sentence_transformers import SentenceTransformer as PlainSentenceTransformer

from st_fastbackend import SentenceTransformer

MAX_LENGTH = 64


@pytest.fixture(scope="module")
def e5_folder(tmp_path_factory):
    folder = build_st_model(
        tmp_path_factory.mktemp("e5"), "mistral", pooling_mode="lasttoken", max_seq_length=MAX_LENGTH
    )
    add_e5_tokenizer_contradiction(folder)
    return folder


def model_card_embeddings(folder, texts):
    """The procedure on the e5-mistral-7b-instruct model card, one text at a time (no padding)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()
    ids = tokenizer(texts, max_length=MAX_LENGTH - 1, truncation=True, padding=False)["input_ids"]
    rows = []
    with torch.no_grad():
        for sequence in ids:
            hidden = model(input_ids=torch.tensor([sequence + [tokenizer.eos_token_id]])).last_hidden_state
            rows.append(torch.nn.functional.normalize(hidden[0, -1], dim=-1))
    return torch.stack(rows).numpy()


def test_plain_sentence_transformers_drops_the_eos(e5_folder):
    plain = PlainSentenceTransformer(str(e5_folder), device=DEVICE)
    assert plain.tokenizer("some text")["input_ids"][-1] != plain.tokenizer.eos_token_id


def test_fast_backend_follows_the_model_card(e5_folder, texts, caplog):
    with caplog.at_level(logging.INFO, logger="st_fastbackend"):
        fast = SentenceTransformer(str(e5_folder), backend="fast", device=DEVICE)
    assert sum("asks for EOS" in record.message for record in caplog.records) == 1
    eos = fast.tokenizer.eos_token_id
    sequences = fast[0].texts.encode(texts)
    assert all(ids[-1] == eos and ids[0] == fast.tokenizer.bos_token_id for ids in sequences)
    assert max(len(ids) for ids in sequences) == MAX_LENGTH  # truncated to max_length - 1, then </s>
    assert max_diff(fast.encode(texts, batch_size=8), model_card_embeddings(e5_folder, texts)) <= TOLERANCE


def test_prompt_length_excludes_the_appended_eos(e5_folder):
    fast = SentenceTransformer(str(e5_folder), backend="fast", device=DEVICE)
    prompt = "Instruct: retrieve\nQuery: "
    assert fast[0].texts.prompt_length(prompt) == len(fast.tokenizer(prompt)["input_ids"])


def test_saved_folder_keeps_asking_for_eos(e5_folder, texts, tmp_path):
    fast = SentenceTransformer(str(e5_folder), backend="fast", device=DEVICE)
    fast.save(str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())["add_eos_token"] is True
    reloaded = SentenceTransformer(str(tmp_path / "saved"), backend="fast", device=DEVICE)
    assert max_diff(reloaded.encode(texts), fast.encode(texts)) == 0
