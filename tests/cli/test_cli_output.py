"""`st-fastbackend encode` writes what model.encode returns, in the format its extension names, with the options
sentence-transformers' encode takes; an empty input is [0, dim]; a summary line says what ran."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import DEVICE

from st_fastbackend import SentenceTransformer
from st_fastbackend.cli import main
from st_fastbackend.engine.runtime import choose_runtime


@pytest.fixture(scope="module")
def folder(st_model):
    return st_model("bert", pooling_mode="mean", prompts={"query": "query: "})


@pytest.fixture(scope="module")
def model(folder):
    return SentenceTransformer(str(folder), backend="fast", device=DEVICE)


@pytest.fixture
def lines(texts, tmp_path):
    lines = [t for t in texts if t][:12]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    return lines


def encode_cli(folder, tmp_path, output: str, *options: str) -> str:
    main(["encode", str(folder), "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / output),
          "--device", DEVICE, *options])  # fmt: skip
    return str(tmp_path / output)


def read(path: str) -> np.ndarray:
    if path.endswith(".npy"):
        return np.load(path)
    if path.endswith(".parquet"):
        column = pq.read_table(path).column("embedding")
        assert str(column.type) == "fixed_size_list<element: float>[64]"
        return np.array(column.to_pylist(), dtype=np.float32)
    with open(path) as f:
        return np.array([json.loads(line)["embedding"] for line in f], dtype=np.float32)


@pytest.mark.parametrize("output", ["out.npy", "out.parquet", "out.jsonl"])
def test_each_format_holds_the_embeddings(folder, model, lines, tmp_path, output, capsys):
    path = encode_cli(folder, tmp_path, output)
    np.testing.assert_array_equal(read(path), model.encode(lines))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", output]
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    tokens = sum(len(ids) for ids in model.tokenizer(lines, truncation=True, max_length=256)["input_ids"])
    assert summary.startswith(f"{len(lines)} texts, {tokens} tokens in ") and " tokens/s); " in summary
    kernel = choose_runtime("cpu", torch.float32).kernel
    assert summary.endswith(f"weights float32, products float32, attention {kernel} -> {path} (12, 64)")


OPTIONS = [
    (["--prompt-name", "query", "--normalize"], dict(prompt_name="query", normalize_embeddings=True)),
    (["--prompt", "passage: ", "--truncate-dim", "16"], dict(prompt="passage: ", truncate_dim=16)),
    (["--batch-size", "3", "--max-tokens-per-batch", "40"], dict(batch_size=3, max_tokens_per_batch=40)),
    (["--precision", "ubinary"], dict(precision="ubinary")),
    (["--precision", "int8"], dict(precision="int8")),
]


@pytest.mark.parametrize(("cli", "kwargs"), OPTIONS)
def test_options_are_encodes(folder, model, lines, tmp_path, cli, kwargs):
    got = np.load(encode_cli(folder, tmp_path, "out.npy", *cli))
    expected = model.encode(lines, **kwargs)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


def test_max_seq_length(folder, lines, tmp_path):
    got = np.load(encode_cli(folder, tmp_path, "out.npy", "--max-seq-length", "8"))
    short = SentenceTransformer(str(folder), backend="fast", device=DEVICE)
    short.max_seq_length = 8
    np.testing.assert_array_equal(got, short.encode(lines))


@pytest.mark.parametrize("precision", ["float32", "int8", "binary", "ubinary"])
def test_empty_input_is_zero_rows_of_the_right_width(folder, model, tmp_path, precision):
    (tmp_path / "empty.txt").write_text("")
    main(["encode", str(folder), "--input", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "out.npy"),
          "--truncate-dim", "40", "--precision", precision])  # fmt: skip
    one = model.encode(["a text", "another"], truncate_dim=40, precision=precision)
    got = np.load(tmp_path / "out.npy")
    assert got.shape == (0, one.shape[1]) and got.dtype == one.dtype
