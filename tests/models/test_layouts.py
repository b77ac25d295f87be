"""Every way a folder can be laid out gives the fast backend the settings plain sentence-transformers picks
(max_seq_length, pooling, normalisation, prompts, lower-casing, truncation side, dtype) and its numbers on
texts longer than every limit: all-MiniLM-L6-v2 with its files taken away or changed one at a time."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import TOLERANCE, load_both, max_diff, minilm_path
from safetensors.torch import load_file, save_file

from st_fastbackend import SentenceTransformer


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _half_weights(folder):
    weights = load_file(folder / "model.safetensors")
    save_file({name: t.half() for name, t in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    _edit_json(folder / "config.json", torch_dtype="float16", dtype="float16")


LAYOUTS = {
    "as published": lambda f: None,
    "no modules.json (a bare checkpoint)": lambda f: (f / "modules.json").unlink(),
    "no modules.json, no sentence_bert_config.json": lambda f: [
        (f / name).unlink() for name in ("modules.json", "sentence_bert_config.json")
    ],
    "no sentence_bert_config.json": lambda f: (f / "sentence_bert_config.json").unlink(),
    "no config_sentence_transformers.json": lambda f: (f / "config_sentence_transformers.json").unlink(),
    "no 1_Pooling/config.json": lambda f: (f / "1_Pooling" / "config.json").unlink(),
    "tokenizer without model_max_length": lambda f: _edit_json(f / "tokenizer_config.json", model_max_length=None),
    "tokenizer limit below the positions": lambda f: _edit_json(f / "tokenizer_config.json", model_max_length=128),
    "tokenizer limit above the positions": lambda f: _edit_json(f / "tokenizer_config.json", model_max_length=4096),
    "bare, tokenizer limit below the positions": lambda f: [
        (f / "modules.json").unlink(),
        _edit_json(f / "tokenizer_config.json", model_max_length=128),
    ],
    "max_seq_length 64 in sentence_bert_config.json": lambda f: _edit_json(
        f / "sentence_bert_config.json", max_seq_length=64
    ),
    "prompts and a default prompt": lambda f: _edit_json(
        f / "config_sentence_transformers.json", prompts={"query": "query: "}, default_prompt_name="query"
    ),
    "bare, prompts and a default prompt": lambda f: [
        (f / "modules.json").unlink(),
        _edit_json(f / "config_sentence_transformers.json", prompts={"query": "query: "}, default_prompt_name="query"),
    ],
    "truncation from the left": lambda f: _edit_json(f / "tokenizer_config.json", truncation_side="left"),
    "pooling: cls and max, without lower-casing": lambda f: [
        _edit_json(
            f / "1_Pooling" / "config.json",
            pooling_mode_mean_tokens=False,
            pooling_mode_cls_token=True,
            pooling_mode_max_tokens=True,
        ),
        _edit_json(f / "tokenizer_config.json", do_lower_case=False),
    ],  # fmt: skip
    "lower-casing asked in sentence_bert_config.json": lambda f: [
        _edit_json(f / "tokenizer_config.json", do_lower_case=False),
        _edit_json(f / "sentence_bert_config.json", do_lower_case=True),
    ],
    "weights stored in float16": _half_weights,
    "bare, weights stored in float16": lambda f: [(f / "modules.json").unlink(), _half_weights(f)],
}

LONG = " ".join(f"Word{i} and MORE text, number {i}." for i in range(400))  # past 512 tokens
TEXTS = [LONG, "A short sentence.", "ANOTHER ONE, in capitals", LONG[:1500]]


def settings(model) -> dict:
    """What decides a model's numbers, as sentence-transformers exposes it."""
    pooling = model[1]
    return {
        "max_seq_length": model.max_seq_length,
        "modules": [type(m).__name__.replace("Packed", "") for m in model],
        "pooling": pooling.get_config_dict() if hasattr(pooling, "get_config_dict") else None,
        "prompts": model.prompts,
        "default_prompt_name": model.default_prompt_name,
        "truncation_side": model.tokenizer.truncation_side,
        "lower-cases": model.tokenizer("ABC def")["input_ids"] == model.tokenizer("abc def")["input_ids"],
        "dtype": next(model.parameters()).dtype,
    }


@pytest.fixture(scope="module")
def minilm():
    return minilm_path()


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gets_plain_settings_and_numbers(minilm, tmp_path, layout):
    folder = shutil.copytree(minilm, tmp_path / "model")
    LAYOUTS[layout](folder)
    try:
        plain, _ = load_both(folder, device="cpu")
    except Exception as refused:  # plain refuses the layout: so must the fast backend, naming a reason
        with pytest.raises(Exception) as ours:
            load_both(folder, device="cpu")
        assert str(ours.value), refused
        return
    _, fast = load_both(folder, device="cpu")
    assert settings(fast) == settings(plain)
    expected = plain.encode(TEXTS, normalize_embeddings=True)
    got = fast.encode(TEXTS, normalize_embeddings=True)
    tolerance = TOLERANCE if settings(plain)["dtype"] == torch.float32 else 2e-3  # fp16 products on both sides
    assert max_diff(got, expected) <= tolerance


@pytest.mark.parametrize("name", ["./no-such-model", "~/no-such-model", "no/such/model"])
def test_a_missing_local_folder_is_named(name):
    """Issue 47: "./my-modle" reached the Hub as a repo id and failed naming a repo id's characters; a path (or a
    pathlib.Path) that names no folder is said to be one, as the CLI says it."""
    with pytest.raises(FileNotFoundError, match="not"):
        SentenceTransformer(name, backend="fast")
    with pytest.raises(FileNotFoundError, match="model folder no-such-model does not exist"):
        SentenceTransformer(Path("no-such-model"), backend="fast")
