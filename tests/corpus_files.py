"""Corpus inputs for the embed-corpus tests, and reading a job's output folder back."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from st_fastbackend.cli import main


def embed_corpus(*args) -> None:
    main(["embed-corpus", *map(str, args)])


def refused(capsys, *args) -> str:
    """The one line a refused job prints (exit status 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        embed_corpus(*args)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("st-fastbackend: error: ")
    return lines[-1]


def empty_texts_without_tokens(monkeypatch) -> None:
    """As a tokenizer that adds no special token: "" gives no token at all (in this process only)."""
    from st_fastbackend.modules.tokenizer import TextTokenizer

    real = TextTokenizer._token_ids
    monkeypatch.setattr(TextTokenizer, "_token_ids", lambda self, batch, max_length: [
        ids if text else [] for text, ids in zip(batch, real(self, batch, max_length), strict=True)])  # fmt: skip


def write_parquet(path: Path, ids: list, texts: list) -> Path:
    pq.write_table(pa.table({"id": ids, "text": pa.array(texts, pa.string()), "other": list(range(len(ids)))}), path)
    return path


def write_jsonl(path: Path, ids: list, texts: list, padding: int = 0) -> Path:
    """`padding`: characters of another column in every row, for a large file of few rows."""
    rows = (
        {"id": row_id, "text": text, "lang": "xx" + "x" * padding} for row_id, text in zip(ids, texts, strict=True)
    )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path: Path, ids: list, texts: list) -> Path:
    with open(path, "w", newline="", encoding="utf8") as out:
        writer = csv.writer(out)
        writer.writerow(["id", "text"])
        writer.writerows(zip(ids, texts, strict=True))
    return path


def read_output(folder: Path, id_column: str = "id") -> tuple[list, np.ndarray]:
    """Every complete shard's ids and embeddings, in shard order; no id twice."""
    shards = sorted(folder.glob("part-*.parquet"))
    if not shards:
        return [], np.zeros((0, 0), np.float32)
    table = pa.concat_tables(pq.read_table(shard) for shard in shards)
    ids = table.column(id_column).to_pylist()
    assert len(ids) == len(set(ids)), "an id was written twice"
    embedding = table.column("embedding").combine_chunks()
    rows = np.asarray(embedding.flatten()).reshape(len(ids), embedding.type.list_size)
    return ids, rows


def flip_embedding_bytes(shard: Path) -> None:
    """The bytes of the shard's first four embedding values inverted in place: the file still reads, with other
    numbers (Parquet keeps float data as it is, so their bytes are in the file)."""
    data = shard.read_bytes()
    first = pq.read_table(shard).column("embedding")[0].values.to_numpy()[:4].tobytes()
    where = data.index(first)
    shard.write_bytes(data[:where] + bytes(byte ^ 0xFF for byte in first) + data[where + len(first) :])


def by_id(ids: list, rows: np.ndarray) -> dict:
    return {row_id: row for row_id, row in zip(ids, rows, strict=True)}


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())
