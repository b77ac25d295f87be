"""`st-fastbackend embed-corpus` on a SparseEncoder (SPLADE) and a MultiVectorEncoder (ColBERT) folder: per
document `indices` and `values` (its active dimensions, ascending) or `embedding` (its [n_i, dim] token vectors),
row for row what encode_document gives, plain sentence-transformers' and ours; the manifest and each shard's
metadata say the kind and dimension; --output-dtype, --dtype and --quantize apply; a resume after an interrupted
run (a shard missing, one corrupted) gives the same rows; --ray, --chunk-tokens and other model classes are
refused before the model loads."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentence_transformers
import torch
from corpus_files import (
    embed_corpus,
    empty_texts_without_tokens,
    manifest,
    refused,
    write_jsonl,
    write_parquet,
)
from hybrid_builders import build_colbert, build_splade

import st_fastbackend
import st_fastbackend.cli.embed_corpus as cli_corpus
from st_fastbackend.corpus.output import METADATA_KEY
from st_fastbackend.engine import quantize

TOLERANCE = 1e-5
PROMPTS = {"query": "query: ", "document": "passage: "}  # encode_document picks "document"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """A SPLADE on BERT's masked-LM head, and a ColBERT whose documents are cut at 48 tokens, without punctuation."""
    return {
        "SparseEncoder": build_splade(tmp_path_factory.mktemp("splade"), "bert", prompts=PROMPTS),
        "MultiVectorEncoder": build_colbert(
            tmp_path_factory.mktemp("colbert"), document_length=48, skiplist_words=[".", ","], prompts=PROMPTS
        ),
    }


def load(model_class: str, folder, plain: bool = False, **kwargs):
    """Plain sentence-transformers' model class, or ours with backend="fast"."""
    if plain:
        return getattr(sentence_transformers, model_class)(str(folder), device="cpu", **kwargs)
    return getattr(st_fastbackend, model_class)(str(folder), backend="fast", device="cpu", **kwargs)


def document_rows(model, texts: list[str]) -> list:
    """Each text's rows as encode_document gives them: (active dimensions, their values), or [n_i, dim] vectors."""
    found = model.encode_document(texts)
    if isinstance(model, sentence_transformers.SparseEncoder):
        return [(np.flatnonzero(row), row[row != 0]) for row in found.to_dense().float().numpy()]
    return [vectors.float().numpy() for vectors in found]


def read_rows(out) -> tuple[list, list, pa.Schema]:
    """Every shard's ids and rows, in shard order (no id twice), and the first shard's schema."""
    shards = sorted(out.glob("part-*.parquet"))
    table = pa.concat_tables(pq.read_table(shard) for shard in shards)
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id was written twice"
    if "indices" in table.column_names:
        pairs = zip(table.column("indices").to_pylist(), table.column("values").to_pylist(), strict=True)
        rows = [(np.array(indices), np.array(values, np.float32)) for indices, values in pairs]
    else:
        rows = [np.array(vectors, np.float32).reshape(-1, table.schema.field("embedding").type.value_type.list_size)
                for vectors in table.column("embedding").to_pylist()]  # fmt: skip
    return ids, rows, pq.read_schema(shards[0])


def assert_same_rows(got: list, expected: list, tolerance: float = TOLERANCE) -> None:
    """Sparse: the same active dimensions, their values within `tolerance`; multi-vector: the same shapes, each
    value within it."""
    assert len(got) == len(expected)
    for row, reference in zip(got, expected, strict=True):
        if isinstance(reference, tuple):
            assert np.array_equal(row[0], reference[0])
            assert np.abs(row[1] - reference[1]).max(initial=0) <= tolerance * max(1.0, np.abs(reference[1]).max())
        else:
            assert row.shape == reference.shape
            assert np.abs(row - reference).max(initial=0) <= tolerance


def test_sparse_rows_are_encode_documents_active_dimensions(folders, texts, tmp_path):
    """Two list columns, `indices` int32 ascending and `values` float32, per document: plain's and ours."""
    folder = folders["SparseEncoder"]
    ids = [f"doc-{i}" for i in range(len(texts))]
    write_parquet(tmp_path / "in.parquet", ids, texts)
    embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--shard-rows", 7)
    got_ids, rows, schema = read_rows(tmp_path / "out")
    assert got_ids == ids
    assert schema.field("indices").type == pa.list_(pa.int32())
    assert schema.field("values").type == pa.list_(pa.float32())
    assert "embedding" not in schema.names and all(np.all(np.diff(indices) > 0) for indices, _ in rows)
    for plain in (True, False):
        assert_same_rows(rows, document_rows(load("SparseEncoder", folder, plain), texts))
    dimension = load("SparseEncoder", folder).get_embedding_dimension()
    written = manifest(tmp_path / "out")
    assert (written["kind"], written["columns"], written["dimension"]) == ("sparse", ["indices", "values"], dimension)
    assert written["prompt"] == "passage: " and written["rows"]["embedded"] == len(texts)
    metadata = json.loads(schema.metadata[METADATA_KEY])
    assert (metadata["kind"], metadata["dimension"]) == ("sparse", dimension)


def test_inference_free_splade_embeds_documents_through_its_document_route(texts, tmp_path):
    """A Router whose query route is a SparseStaticEmbedding: documents run the transformer route."""
    folder = build_splade(tmp_path / "router", "bert", router=True)
    write_parquet(tmp_path / "in.parquet", list(range(16)), texts[1:17])
    embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folder)
    _, rows, _ = read_rows(tmp_path / "out")
    for plain in (True, False):
        assert_same_rows(rows, document_rows(load("SparseEncoder", folder, plain), texts[1:17]))


def test_multi_vector_rows_are_encode_documents_token_vectors(folders, texts, tmp_path):
    """`embedding`: per document a list of fixed-size lists, its [n_i, 32] vectors (document_length, skiplist)."""
    folder = folders["MultiVectorEncoder"]
    write_jsonl(tmp_path / "in.jsonl", list(range(len(texts))), texts)
    embed_corpus(tmp_path / "in.jsonl", tmp_path / "out", "--model", folder, "--shard-rows", 16)
    got_ids, rows, schema = read_rows(tmp_path / "out")
    assert got_ids == list(range(len(texts)))
    assert schema.field("embedding").type == pa.list_(pa.list_(pa.float32(), 32))
    for plain in (True, False):
        assert_same_rows(rows, document_rows(load("MultiVectorEncoder", folder, plain), texts))
    assert max(len(row) for row in rows) <= 48 and len({len(row) for row in rows}) > 10
    written = manifest(tmp_path / "out")
    assert (written["kind"], written["columns"], written["dimension"]) == ("multi_vector", ["embedding"], 32)
    assert json.loads(schema.metadata[METADATA_KEY])["kind"] == "multi_vector"


@pytest.mark.parametrize("model_class", ["SparseEncoder", "MultiVectorEncoder"])
def test_float16_output(folders, texts, tmp_path, model_class):
    """--output-dtype float16: a sparse model's values, a multi-vector model's vectors (indices stay int32)."""
    write_parquet(tmp_path / "in.parquet", list(range(20)), texts[:20])
    embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folders[model_class], "--output-dtype",
                 "float16")  # fmt: skip
    _, rows, schema = read_rows(tmp_path / "out")
    value_type = schema.field("values").type if model_class == "SparseEncoder" else schema.field("embedding").type
    assert value_type.value_type == (pa.float16() if model_class == "SparseEncoder" else pa.list_(pa.float16(), 32))
    assert_same_rows(rows, document_rows(load(model_class, folders[model_class]), texts[:20]), tolerance=1e-3)


PRODUCTS = {"bf16": (["--dtype", "bf16"], {"model_kwargs": {"dtype": torch.bfloat16}})}
if quantize.int8_supported():
    PRODUCTS["int8"] = (["--quantize", "int8"], {"model_kwargs": {"quantize": "int8"}})


@pytest.mark.parametrize("model_class", ["SparseEncoder", "MultiVectorEncoder"])
@pytest.mark.parametrize("products", PRODUCTS)
def test_dtype_and_quantize_as_for_dense(folders, texts, tmp_path, model_class, products):
    """The rows of the model loaded as the option loads it (the job's identity records the option)."""
    options, loading = PRODUCTS[products]
    write_parquet(tmp_path / "in.parquet", list(range(12)), texts[1:13])
    embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folders[model_class], *options)
    _, rows, _ = read_rows(tmp_path / "out")
    assert_same_rows(rows, document_rows(load(model_class, folders[model_class], **loading), texts[1:13]))
    job = manifest(tmp_path / "out")["job"]
    assert (job["dtype"], job["quantize"]) == (("bfloat16", None) if products == "bf16" else (None, "int8"))


@pytest.mark.parametrize("model_class", ["SparseEncoder", "MultiVectorEncoder"])
def test_a_resume_after_an_interrupted_run_gives_the_same_rows(folders, texts, tmp_path, capsys, model_class):
    """As a job killed midway: a shard and the manifest gone, another shard's bytes flipped. The rerun keeps the
    good shards untouched, names the bad one and embeds the rows of both again: the first run's rows."""
    ids = [f"doc-{i}" for i in range(len(texts))]
    write_parquet(tmp_path / "in.parquet", ids, texts)
    arguments = [tmp_path / "in.parquet", tmp_path / "out", "--model", folders[model_class], "--shard-rows", 10]
    embed_corpus(*arguments)
    first = dict(zip(*read_rows(tmp_path / "out")[:2], strict=True))
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    shards[0].unlink()
    (tmp_path / "out" / "manifest.json").unlink()
    data = bytearray(shards[2].read_bytes())
    data[len(data) // 2] ^= 0xFF  # any byte: the shard is trusted only with the sha256 recorded
    shards[2].write_bytes(bytes(data) if model_class == "SparseEncoder" else bytes(data[:-100]))
    kept = {shard.name: shard.stat().st_mtime_ns for shard in (shards[1], shards[3])}
    capsys.readouterr()
    embed_corpus(*arguments)
    assert f"{shards[2]} cannot be trusted (" in capsys.readouterr().err
    assert {name: (tmp_path / "out" / name).stat().st_mtime_ns for name in kept} == kept
    got_ids, rows, _ = read_rows(tmp_path / "out")
    assert sorted(got_ids) == sorted(ids) and len(manifest(tmp_path / "out")["shards"]) == 4
    assert_same_rows([row for _, row in sorted(zip(got_ids, rows, strict=True))], [first[i] for i in sorted(ids)])


def test_what_the_kinds_cannot_do_is_refused_before_the_model_loads(folders, texts, tmp_path, capsys, monkeypatch):
    """--ray (its actors embed SentenceTransformer rows), --chunk-tokens (chunks are a SentenceTransformer's), and a
    model class embed-corpus does not take: one line each, nothing written."""

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_corpus, "load_model", loaded)
    write_parquet(tmp_path / "in.parquet", list(range(5)), texts[1:6])
    sparse, multi_vector = folders["SparseEncoder"], folders["MultiVectorEncoder"]
    error = refused(capsys, tmp_path / "in.parquet", tmp_path / "out", "--model", sparse, "--ray")
    assert f"--ray embeds with SentenceTransformer models only; {sparse} is a SparseEncoder: run the job on this " \
           "machine (without --ray), which writes its indices and values columns" in error  # fmt: skip
    error = refused(capsys, tmp_path / "in.parquet", tmp_path / "out", "--model", multi_vector, "--chunk-tokens", 16)
    assert f"--chunk-tokens cuts a SentenceTransformer's documents into chunks; {multi_vector} is a " \
           "MultiVectorEncoder: embed each document whole" in error  # fmt: skip
    other = shutil.copytree(sparse, tmp_path / "other")
    (other / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "CrossEncoder"}))
    error = refused(capsys, tmp_path / "in.parquet", tmp_path / "out", "--model", other)
    assert f"{other} is a CrossEncoder; embed-corpus takes SentenceTransformer, SparseEncoder, " in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_class", ["SparseEncoder", "MultiVectorEncoder"])
def test_a_text_without_tokens_stops_the_job_naming_its_id(folders, texts, tmp_path, capsys, monkeypatch,
                                                          model_class):  # fmt: skip
    """As for dense rows: the error names the row's id, the shards before it stay, its own is not written (no
    prompt: the model's document prompt would give "" tokens)."""
    empty_texts_without_tokens(monkeypatch)
    ids = [f"doc-{i}" for i in range(9)]
    write_parquet(tmp_path / "in.parquet", ids, [*texts[1:5], "", *texts[6:10]])
    error = refused(capsys, tmp_path / "in.parquet", tmp_path / "out", "--model", folders[model_class],
                    "--shard-rows", 3, "--prompt", "")  # fmt: skip
    assert "the row with id 'doc-4' cannot be embedded: its text '' has no tokens" in error
    assert sorted(read_rows(tmp_path / "out")[0]) == ids[:3] and not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize(
    ("model_class", "kind"), [("SparseEncoder", "sparse"), ("MultiVectorEncoder", "multi_vector")]
)
def test_a_subclass_is_served_and_written_as_its_kind(folders, model_class, kind):
    """The server's outputs and the corpus job's rows follow the kind a class declares (output_kind), which a user's
    subclass keeps; they were chosen by the class's name, so a subclass was served and written as dense."""
    from st_fastbackend.corpus.job import DocumentEmbedder, embedder_for
    from st_fastbackend.embedder import Embedder

    subclass = type("Mine", (getattr(st_fastbackend, model_class),), {})
    model = subclass(str(folders[model_class]), backend="fast", device="cpu")
    assert Embedder(model).kind == kind
    assert isinstance(embedder_for(model), DocumentEmbedder)
