"""`st-fastbackend embed-corpus` on one machine: the shards equal model.encode row for row with the ids kept,
from parquet (a folder of files), JSON Lines and CSV; a rerun completes what a SIGKILL left and never writes an
id twice; bad rows stop the job (or go to rejects.parquet); another job's folder is refused."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from corpus_files import (
    by_id,
    embed_corpus,
    empty_texts_without_tokens,
    manifest,
    read_output,
    write_csv,
    write_jsonl,
    write_parquet,
)
from helpers import TOLERANCE

from st_fastbackend import SentenceTransformer


def test_shards_equal_encode_row_for_row_with_ids_kept(folder, texts, expected, tmp_path):
    """A folder of two parquet files, shards of 7 rows: every id once, its own text's embedding, and a manifest."""
    ids = [f"doc-{i}" for i in range(len(texts))]
    (tmp_path / "in").mkdir()
    write_parquet(tmp_path / "in" / "a.parquet", ids[:25], texts[:25])
    write_parquet(tmp_path / "in" / "b.parquet", ids[25:], texts[25:])
    embed_corpus(tmp_path / "in", tmp_path / "out", "--model", folder, "--shard-rows", 7)
    got_ids, rows = read_output(tmp_path / "out")
    assert got_ids == ids  # one machine: shards in input order
    assert np.abs(rows - expected).max() < TOLERANCE
    shard = pq.read_table(next((tmp_path / "out").glob("part-*.parquet")))
    kind = shard.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(kind) and (kind.list_size, kind.value_type) == (expected.shape[1], pa.float32())
    assert shard.schema.metadata[b"st_fastbackend.model"].decode() == str(folder.resolve())
    written = manifest(tmp_path / "out")
    assert written["rows"] == {"input": len(texts), "embedded": len(texts), "rejected": 0}
    assert written["dimension"] == expected.shape[1] and len(written["shards"]) == 6


def test_jsonl_input_and_float16_output(folder, texts, expected, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", list(range(100, 100 + len(texts))), texts)
    embed_corpus(tmp_path / "in.jsonl", tmp_path / "out", "--model", folder, "--output-dtype", "float16")
    got_ids, rows = read_output(tmp_path / "out")
    assert got_ids == list(range(100, 100 + len(texts)))
    assert rows.dtype == np.float16 and np.abs(rows.astype(np.float32) - expected).max() < 1e-3


def test_csv_input(folder, texts, expected, tmp_path):
    """Texts with commas, quotes and an empty one; the text column stays a string where it looks like a number."""
    chosen = [*texts[:10], 'a, "quoted" text', "12345"]
    write_csv(tmp_path / "in.csv", list(range(len(chosen))), chosen)
    embed_corpus(tmp_path / "in.csv", tmp_path / "out", "--model", folder)
    got_ids, rows = read_output(tmp_path / "out")
    assert got_ids == list(range(len(chosen)))
    reference = SentenceTransformer(str(folder), backend="fast", device="cpu").encode(chosen)
    assert np.abs(rows - reference).max() < TOLERANCE and np.abs(rows[:10] - expected[:10]).max() < TOLERANCE


def test_empty_input_writes_a_manifest_and_no_shard(folder, tmp_path):
    write_parquet(tmp_path / "in.parquet", [], [])
    embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folder)
    assert read_output(tmp_path / "out")[0] == []
    assert manifest(tmp_path / "out")["rows"] == {"input": 0, "embedded": 0, "rejected": 0}


def test_rerun_adds_only_the_missing_shards(folder, texts, expected, tmp_path):
    ids = [f"doc-{i}" for i in range(len(texts))]
    write_parquet(tmp_path / "in.parquet", ids, texts)
    embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--shard-rows", 10)
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    shards[1].unlink()
    (tmp_path / "out" / "manifest.json").unlink()
    kept = {shard.name: shard.stat().st_mtime_ns for shard in shards if shard.exists()}
    embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--shard-rows", 10)
    assert {name: (tmp_path / "out" / name).stat().st_mtime_ns for name in kept} == kept  # untouched
    got = by_id(*read_output(tmp_path / "out"))
    assert sorted(got) == sorted(ids) and len(list((tmp_path / "out").glob("part-*.parquet"))) == 4
    assert max(np.abs(got[row_id] - expected[i]).max() for i, row_id in enumerate(ids)) < TOLERANCE


@pytest.mark.slow
def test_one_job_per_folder_and_resume_after_sigkill(folder, texts, expected, tmp_path, capsys):
    """A subprocess job killed as soon as its first shard exists. While it runs, a second job on its folder is
    refused in one line naming the folder and the first job's pid (the trial: both finished, every id twice); once
    it is killed the OS has dropped its lock, and the rerun completes the job, no id twice."""
    ids = list(range(240))  # 80 shards of 3: the job runs for seconds after its first shard appears
    write_parquet(tmp_path / "in.parquet", ids, [texts[i % len(texts)] for i in ids])
    arguments = [tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--shard-rows", "3"]
    command = [sys.executable, "-m", "st_fastbackend.cli", "embed-corpus", *map(str, arguments)]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "out").glob("part-*.parquet")) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    try:
        with pytest.raises(SystemExit) as exit_:
            embed_corpus(*arguments)
        assert job.poll() is None, "the first job ended before the second one was tried"
    finally:
        os.kill(job.pid, signal.SIGKILL)
    job.wait()
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2
    assert f"output folder {tmp_path / 'out'} is in use by another embed-corpus job (pid {job.pid}, " in error
    assert job.returncode == -signal.SIGKILL, job.stderr.read().decode()[-2000:]
    assert not (tmp_path / "out" / "manifest.json").exists()
    first_ids, _ = read_output(tmp_path / "out")
    assert 0 < len(first_ids) < len(ids)
    embed_corpus(*arguments)
    got = by_id(*read_output(tmp_path / "out"))
    assert sorted(got) == ids and not list((tmp_path / "out").glob(".*.tmp"))
    assert max(np.abs(got[i] - expected[i % len(texts)]).max() for i in ids) < TOLERANCE
    assert manifest(tmp_path / "out")["rows"]["embedded"] == len(ids)


BAD_INPUTS = {
    "parquet, a null text": ("in.parquet", write_parquet, None, "its text is null"),
    "jsonl, a number as text": ("in.jsonl", write_jsonl, 42, "its text is null or not a string"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_a_bad_row_stops_the_job_naming_its_id_and_file(folder, texts, tmp_path, capsys, case):
    name, write, bad, reason = BAD_INPUTS[case]
    ids = [f"doc-{i}" for i in range(12)]
    write(tmp_path / name, ids, [*texts[:7], bad, *texts[8:12]])
    with pytest.raises(SystemExit) as exit_:
        embed_corpus(tmp_path / name, tmp_path / "out", "--model", folder, "--shard-rows", 3)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2
    assert f"row id='doc-7' of {tmp_path / name} (row 7): {reason}" in error and "--skip-invalid" in error
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written


def test_a_text_without_tokens_stops_the_job_naming_its_id(folder, texts, tmp_path, capsys, monkeypatch):
    """A tokenizer that adds no special token gives "" no token at all: found only when its shard is tokenized,
    the error names the row's id; the shards before it stay complete, its own is not written."""
    empty_texts_without_tokens(monkeypatch)
    ids = [f"doc-{i}" for i in range(12)]
    write_parquet(tmp_path / "in.parquet", ids, [*texts[1:8], "", *texts[9:13]])  # texts[0] is "" too
    with pytest.raises(SystemExit) as exit_:
        embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--shard-rows", 3)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "the row with id 'doc-7' cannot be embedded: its text '' has no tokens" in error
    assert sorted(read_output(tmp_path / "out")[0]) == ids[:6]
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_skip_invalid_lists_bad_rows_in_rejects(folder, texts, expected, tmp_path, case):
    name, write, bad, reason = BAD_INPUTS[case]
    ids = [f"doc-{i}" for i in range(12)]
    write(tmp_path / name, ids, [*texts[:3], bad, *texts[4:9], bad, *texts[10:12]])
    embed_corpus(tmp_path / name, tmp_path / "out", "--model", folder, "--skip-invalid")
    got = by_id(*read_output(tmp_path / "out"))
    assert sorted(got) == sorted(set(ids) - {"doc-3", "doc-9"})
    assert max(np.abs(got[f"doc-{i}"] - expected[i]).max() for i in (0, 4, 11)) < TOLERANCE
    rejects = pq.read_table(tmp_path / "out" / "rejects.parquet").to_pylist()
    assert [(row["id"], row["row"], row["reason"]) for row in rejects] == [("doc-3", 3, reason), ("doc-9", 9, reason)]
    assert manifest(tmp_path / "out")["rows"] == {"input": 12, "embedded": 10, "rejected": 2}


def test_another_job_into_the_same_folder_is_refused(folder, st_model, texts, tmp_path, capsys):
    write_parquet(tmp_path / "in.parquet", list(range(10)), texts[:10])
    write_parquet(tmp_path / "other.parquet", list(range(10)), texts[10:20])
    embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folder)
    other_model = st_model("roberta", pooling_mode="mean")
    for args, what in (([tmp_path / "in.parquet", "--model", other_model], "model"),
                       ([tmp_path / "other.parquet", "--model", folder], "input_fingerprint"),
                       ([tmp_path / "in.parquet", "--model", folder, "--prompt", "query: "], "prompt")):  # fmt: skip
        with pytest.raises(SystemExit):
            embed_corpus(args[0], tmp_path / "out", *args[1:])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"{tmp_path / 'out'} holds the output of another job" in error and f"{what} " in error


def test_import_does_not_import_ray():
    """The ray extra is optional: the package, the CLI's parser and the corpus job's files never import it (the
    local job's corpus.py adds only torch and the model to these)."""
    code = ("import sys, st_fastbackend, st_fastbackend.corpus.read, st_fastbackend.corpus.output, "
            "st_fastbackend.cli.embed_corpus, st_fastbackend.cli as cli; cli.build_parser(); "
            "sys.exit('ray imported' if 'ray' in sys.modules else 0)")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
