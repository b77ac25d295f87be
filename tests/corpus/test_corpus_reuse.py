"""`embed-corpus --reuse` and the content key (corpus/reuse.py): every row carries the key of its text and the job's
numbers identity; equal texts in a run are embedded once and written per row; an edited input (rows changed,
added, removed, duplicated, reordered) run with --reuse of the last output copies the rows of the texts it had bit
for bit and equals a clean full run, for every kind the job writes; another identity's output or a corrupt one is
refused by name; a reusing run killed midway resumes."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from corpus_files import embed_corpus, flip_embedding_bytes, manifest, refused, write_parquet
from helpers import TOLERANCE
from hybrid_builders import build_colbert, build_splade

from st_fastbackend import SentenceTransformer
from st_fastbackend.corpus.reuse import KEY, NOT_NUMBERS

PROMPTS = {"query": "query: ", "document": "passage: "}
KINDS = {  # the model and options of each kind of output
    "dense": ("bert", ()),
    "chunks": ("bert", ("--chunk-tokens", 24, "--chunk-overlap", 4)),
    "aggregate": ("bert", ("--chunk-tokens", 24, "--aggregate", "mean")),
    "sparse": ("splade", ()),
    "multi_vector": ("colbert", ()),
}


@pytest.fixture(scope="module")
def models(folder, tmp_path_factory) -> dict:
    return {
        "bert": folder,
        "splade": build_splade(tmp_path_factory.mktemp("splade"), "bert", prompts=PROMPTS),
        "colbert": build_colbert(tmp_path_factory.mktemp("colbert"), document_length=48, prompts=PROMPTS),
    }


def output(out) -> pa.Table:
    """Every row of the folder, by id (and chunk); no (id, chunk) twice."""
    table = pa.concat_tables(pq.read_table(shard) for shard in sorted(out.glob("part-*.parquet")))
    order = [("id", "ascending")] + ([("chunk", "ascending")] if "chunk" in table.column_names else [])
    table = table.replace_schema_metadata(None).sort_by(order)
    names = ["id", "chunk"] if "chunk" in table.column_names else ["id"]
    assert len(table.group_by(names).aggregate([])) == len(table), "a row was written twice"
    return table


def values(column: pa.ChunkedArray) -> np.ndarray:
    """A column's numbers flattened (lists of lists of floats included)."""
    column = column.combine_chunks()
    while pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type):
        column = column.flatten()
    return column.to_numpy(zero_copy_only=False).astype(np.float64)


def assert_equal_rows(got: pa.Table, clean: pa.Table) -> None:
    """The same rows and keys as a clean run; embeddings within TOLERANCE (sparse: the same active dimensions)."""
    assert got.column_names == clean.column_names and len(got) == len(clean)
    for name in got.column_names:
        if name in ("embedding", "values"):
            assert np.abs(values(got.column(name)) - values(clean.column(name))).max(initial=0) <= TOLERANCE
        else:
            assert got.column(name).equals(clean.column(name)), name


def rows_of(table: pa.Table, ids: list) -> pa.Table:
    """The rows of `ids`, in that order, without the id column."""
    picked = [table.filter(pc.equal(table.column("id"), row_id)) for row_id in ids]
    return pa.concat_tables(picked).drop_columns(["id"])


def test_equal_texts_are_embedded_once_and_written_per_row(folder, texts, expected, tmp_path):
    """60 rows of 20 texts in shards of 7: 20 embedded, 40 copied from the first rows, within a shard or across
    shards, each under its own id. The key is the sha256 of the numbers identity and the text."""
    write_parquet(tmp_path / "in.parquet", list(range(60)), [texts[i % 20] for i in range(60)])
    embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--shard-rows", 7)
    table = output(tmp_path / "out")
    assert table.column("id").to_pylist() == list(range(60))
    assert table.schema.field(KEY).type == pa.binary(16)
    rows = values(table.column("embedding")).reshape(60, -1)
    assert np.abs(rows - expected[np.arange(60) % 20]).max() < TOLERANCE
    assert all(np.array_equal(rows[i], rows[i % 20]) for i in range(60))  # copied, bit for bit
    written = manifest(tmp_path / "out")
    identity = {name: value for name, value in written["job"].items() if name not in NOT_NUMBERS}
    seed = json.dumps(identity, sort_keys=True).encode() + b"\0"
    keys = [hashlib.sha256(seed + texts[i % 20].encode()).digest()[:16] for i in range(60)]
    assert table.column(KEY).to_pylist() == keys
    assert written["texts"] == {"reused": 0, "deduplicated": 40, "embedded": 20}
    assert written["rows"]["embedded"] == 60


def test_the_key_changes_with_every_option_that_changes_numbers(folder, texts, tmp_path):
    """The same texts under other ids and columns keep their keys; --max-seq-length or --output-dtype changes them."""
    write_parquet(tmp_path / "a.parquet", list(range(10)), texts[:10])
    pq.write_table(pa.table({"doc": [f"d{i}" for i in range(10)], "body": texts[:10]}), tmp_path / "b.parquet")
    keys = {}
    for name, source, options in [
        ("plain", "a.parquet", ()),
        ("other ids", "b.parquet", ("--id-column", "doc", "--text-column", "body")),
        ("max_seq_length", "a.parquet", ("--max-seq-length", 64)),
        ("output_dtype", "a.parquet", ("--output-dtype", "float16")),
    ]:
        embed_corpus(tmp_path / source, tmp_path / name, "--model", folder, *options)
        table = pq.read_table(sorted((tmp_path / name).glob("part-*.parquet")))
        keys[name] = table.column(KEY).to_pylist()
    assert keys["other ids"] == keys["plain"] and len(set(keys["plain"])) == 10
    assert not set(keys["max_seq_length"]) & set(keys["plain"])
    assert not set(keys["output_dtype"]) & set(keys["plain"])


def edited(texts: list[str], folder: Path) -> tuple[list, dict]:
    """The first input (doc-0..29) and an edit of it, written as folder/before.parquet and after.parquet: 3 rows
    removed, 3 changed, 4 added, 2 rows repeating another row's text (an old one and a new one), all reordered. The
    edit's rows, and its counts of texts reused, deduplicated, embedded."""
    before = {f"doc-{i}": texts[i] for i in range(30)}
    after = {key: text for key, text in before.items() if key not in ("doc-0", "doc-1", "doc-2")}
    after |= {f"doc-{i}": texts[i] + " edited" for i in (3, 4, 5)}
    after |= {f"doc-{i}": texts[i] for i in range(30, 34)}
    after |= {"dup-old": texts[10], "dup-new": texts[30]}
    order = sorted(after)
    random.Random(0).shuffle(order)
    rows = [(key, after[key]) for key in order]
    for name, written in (("before", list(before.items())), ("after", rows)):
        write_parquet(folder / f"{name}.parquet", *map(list, zip(*written, strict=True)))
    return rows, {"reused": 25, "deduplicated": 1, "embedded": 7}


@pytest.mark.parametrize("kind", KINDS)
def test_reuse_of_an_edited_input_equals_a_clean_full_run(models, texts, tmp_path, capsys, kind):
    model, options = KINDS[kind]
    after, counts = edited(texts, tmp_path)
    common = ("--model", models[model], "--shard-rows", 7, *options)
    embed_corpus(tmp_path / "before.parquet", tmp_path / "previous", *common)
    previous = {path.name: path.stat().st_mtime_ns for path in (tmp_path / "previous").iterdir()}
    capsys.readouterr()
    embed_corpus(tmp_path / "after.parquet", tmp_path / "out", *common, "--reuse", tmp_path / "previous")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"{len(after)} rows written: 25 reused, 1 deduplicated, 7 embedded (0 done before, ")
    embed_corpus(tmp_path / "after.parquet", tmp_path / "clean", *common)
    got, clean, first = output(tmp_path / "out"), output(tmp_path / "clean"), output(tmp_path / "previous")
    assert_equal_rows(got, clean)
    kept = [f"doc-{i}" for i in range(6, 30)]
    assert rows_of(got, kept).equals(rows_of(first, kept))  # copied bit for bit
    assert rows_of(got, ["dup-old"]).equals(rows_of(first, ["doc-10"]))
    assert rows_of(got, ["dup-new"]).equals(rows_of(got, ["doc-30"]))
    assert manifest(tmp_path / "out")["texts"] == counts
    assert manifest(tmp_path / "clean")["texts"] == {"reused": 0, "deduplicated": 2, "embedded": 31}
    assert {path.name: path.stat().st_mtime_ns for path in (tmp_path / "previous").iterdir()} == previous


def test_another_identity_or_a_corrupt_output_is_refused_by_name(folder, texts, tmp_path, capsys):
    """Before the model loads, and without touching the earlier output."""
    write_parquet(tmp_path / "in.parquet", list(range(20)), texts[:20])
    job = [tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--shard-rows", 7]
    embed_corpus(tmp_path / "in.parquet", tmp_path / "half", "--model", folder, "--output-dtype", "float16")
    error = refused(capsys, *job, "--reuse", tmp_path / "half")
    assert f"--reuse {tmp_path / 'half'} was embedded with another model or other options (output_dtype " in error
    assert "'float16' there, 'float32' now)" in error

    embed_corpus(tmp_path / "in.parquet", tmp_path / "previous", "--model", folder, "--shard-rows", 7)
    shard = sorted((tmp_path / "previous").glob("part-*.parquet"))[1]
    flip_embedding_bytes(shard)
    files = sorted(path.name for path in (tmp_path / "previous").iterdir())
    error = refused(capsys, *job, "--reuse", tmp_path / "previous")
    assert f"--reuse {tmp_path / 'previous'}: {shard.name} cannot be trusted (its sha256 is not the one " in error
    assert sorted(path.name for path in (tmp_path / "previous").iterdir()) == files  # nothing moved aside

    shard.unlink()
    (tmp_path / "previous" / "manifest.json").unlink()
    error = refused(capsys, *job, "--reuse", tmp_path / "previous")
    assert f"--reuse {tmp_path / 'previous'}: no manifest.json, not a complete embed-corpus output" in error
    assert not list((tmp_path / "out").glob("part-*.parquet"))
    if importlib.util.find_spec("ray"):  # refused on Ray too, before Ray starts
        assert "was embedded with another model" in refused(capsys, *job, "--reuse", tmp_path / "half", "--ray")


def test_an_output_written_before_content_keys_is_refused_by_name(folder, texts, tmp_path, capsys):
    """A complete, intact output whose shards have no content_key column, as every output was before keys: refused
    naming its first shard, not read as an output that holds none of the texts."""
    write_parquet(tmp_path / "in.parquet", list(range(20)), texts[:20])
    embed_corpus(tmp_path / "in.parquet", tmp_path / "previous", "--model", folder, "--shard-rows", 7)
    without_keys(tmp_path / "previous")
    job = [tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--shard-rows", 7]
    first = sorted((tmp_path / "previous").glob("part-*.parquet"))[0].name
    error = refused(capsys, *job, "--reuse", tmp_path / "previous")
    assert f"--reuse {tmp_path / 'previous'}: {first} has no {KEY} column (written before content keys)" in error
    assert not list((tmp_path / "out").glob("part-*.parquet"))


def without_keys(out: Path) -> None:
    """Each shard of a complete output rewritten without its content keys, its record and the manifest's listing
    made to match: an intact output as written before keys."""
    listing = json.loads((out / "manifest.json").read_text())
    for entry in listing["shards"]:
        shard = out / entry["name"]
        table = pq.read_table(shard)
        pq.write_table(table.drop_columns([KEY]), shard)
        data = shard.read_bytes()
        record_file = shard.with_name(f".{shard.name}.json")
        record = json.loads(record_file.read_text()) | {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        record_file.write_text(json.dumps(record) + "\n")
        entry.update(record)
    (out / "manifest.json").write_text(json.dumps(listing))


@pytest.mark.slow
def test_a_reusing_run_killed_midway_resumes(folder, texts, tmp_path):
    """240 rows in shards of 3, the first 120 in the earlier output: killed once a shard exists, the rerun (with
    --reuse again) completes it, every row once, the earlier rows bit for bit, the counts of both runs summed."""
    unique = [f"{texts[i % len(texts)]} {i}" for i in range(240)]
    write_parquet(tmp_path / "before.parquet", list(range(120)), unique[:120])
    write_parquet(tmp_path / "in.parquet", list(range(240)), unique)
    embed_corpus(tmp_path / "before.parquet", tmp_path / "previous", "--model", folder, "--shard-rows", 30)
    arguments = [tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--shard-rows", 3,
                 "--reuse", tmp_path / "previous"]  # fmt: skip
    command = [sys.executable, "-m", "st_fastbackend.cli", "embed-corpus", *map(str, arguments)]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "out").glob("part-*.parquet")) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    assert job.returncode == -signal.SIGKILL, job.stderr.read().decode()[-2000:]
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert 0 < len(list((tmp_path / "out").glob("part-*.parquet"))) < 80
    embed_corpus(*arguments)
    got, first = output(tmp_path / "out"), output(tmp_path / "previous")
    assert got.column("id").to_pylist() == list(range(240))
    assert got.slice(0, 120).equals(first)
    rows = values(got.column("embedding")).reshape(240, -1)
    reference = SentenceTransformer(str(folder), backend="fast", device="cpu").encode(unique[120:])
    assert np.abs(rows[120:] - reference).max() < TOLERANCE
    assert manifest(tmp_path / "out")["texts"] == {"reused": 120, "deduplicated": 0, "embedded": 120}
