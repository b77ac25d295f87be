"""`st-fastbackend embed-corpus --outputs` on a BGE-M3 folder: per document the columns of the outputs asked for
(`embedding`, `indices`/`values`, `multi_vector`), what encode_all() gives; a resume after an interrupted run gives
the same rows; --outputs on another folder, or with a prompt, is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from corpus_files import embed_corpus, manifest, refused, write_parquet

from st_fastbackend.models.hybrid import HybridEncoder

DATA = Path(__file__).parent.parent / "data" / "bge_m3"
MODEL = DATA / "model"
TEXTS = json.loads((DATA / "texts.json").read_text()) * 3  # 36 documents, repeated texts among them


def rows_by_id(out: Path) -> dict:
    table = pa.concat_tables(pq.read_table(shard) for shard in sorted(out.glob("part-*.parquet")))
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    return {doc: {name: columns[name][i] for name in columns if name != "id"} for i, doc in enumerate(columns["id"])}


def assert_rows(rows: dict, expected, outputs: tuple[str, ...]) -> None:
    for i in range(len(TEXTS)):
        row = rows[f"doc-{i}"]
        if "dense" in outputs:
            assert np.abs(np.array(row["embedding"]) - expected.dense[i]).max() < 1e-5
        if "sparse" in outputs:
            weights = expected.lexical_weights[i]
            assert row["indices"] == sorted(weights)
            assert np.abs(np.array(row["values"]) - [weights[k] for k in sorted(weights)]).max(initial=0) < 1e-5
        if "multi_vector" in outputs:
            assert np.abs(np.array(row["multi_vector"]) - expected.multi_vector[i]).max() < 1e-5


@pytest.fixture(scope="module")
def expected():
    return HybridEncoder(str(MODEL), device="cpu").encode_all(TEXTS)


@pytest.mark.slow
@pytest.mark.parametrize("outputs", ["dense,sparse,multi_vector", "sparse"])
def test_columns_are_encode_all(expected, tmp_path, outputs):
    write_parquet(tmp_path / "in.parquet", [f"doc-{i}" for i in range(len(TEXTS))], TEXTS)
    embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", MODEL, "--outputs", outputs)
    rows = rows_by_id(tmp_path / "out")
    assert_rows(rows, expected, tuple(outputs.split(",")))
    written = {"embedding", "indices", "values", "multi_vector"} & set(rows["doc-0"])
    assert written == ({"embedding", "indices", "values", "multi_vector"} if "," in outputs else {"indices", "values"})
    assert manifest(tmp_path / "out")["kind"] == "hybrid"


@pytest.mark.slow
def test_a_resume_after_an_interrupted_run_gives_the_same_rows(expected, tmp_path):
    write_parquet(tmp_path / "in.parquet", [f"doc-{i}" for i in range(len(TEXTS))], TEXTS)
    arguments = [tmp_path / "in.parquet", tmp_path / "out", "--model", MODEL, "--outputs", "dense,sparse,multi_vector",
                 "--shard-rows", 10]  # fmt: skip
    embed_corpus(*arguments)
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    kept = shards[1].stat().st_mtime_ns
    shards[0].unlink()
    (tmp_path / "out" / "manifest.json").unlink()
    embed_corpus(*arguments)
    assert shards[1].stat().st_mtime_ns == kept and shards[0].exists() is False
    assert len(manifest(tmp_path / "out")["shards"]) == len(shards)
    assert_rows(rows_by_id(tmp_path / "out"), expected, ("dense", "sparse", "multi_vector"))


def test_outputs_refused_where_they_mean_nothing(tmp_path, capsys):
    write_parquet(tmp_path / "in.parquet", [0, 1], TEXTS[2:4])
    other = tmp_path / "plain"
    other.mkdir()
    for name in ("modules.json", "config.json"):
        (other / name).write_text((MODEL / name).read_text())
    error = refused(capsys, tmp_path / "in.parquet", tmp_path / "out", "--model", other, "--outputs", "sparse")
    assert "--outputs sparse needs a BGE-M3 folder (sparse_linear.pt and colbert_linear.pt" in error
    error = refused(capsys, tmp_path / "in.parquet", tmp_path / "out", "--model", MODEL, "--outputs", "sparse",
                    "--prompt", "passage: ")  # fmt: skip
    assert "without a prompt" in error
    assert not (tmp_path / "out").exists()
