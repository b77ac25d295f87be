"""The corpus job never loses, doubles or mixes a row, in the cases of the trial that found it did (each exited 0
or with a traceback): ids null or given to several rows are refused up front or listed in rejects.parquet, a resume
refuses a model or an input changed since its shards were written, a shard whose bytes are not those recorded is
named and embedded again, and an output folder that cannot take the embeddings is refused before the model loads.
One job per folder: test_corpus.py::test_one_job_per_folder_and_resume_after_sigkill; on Ray: test_corpus_ray.py."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from corpus_files import (
    by_id,
    embed_corpus,
    flip_embedding_bytes,
    manifest,
    read_output,
    refused,
    write_jsonl,
    write_parquet,
)
from helpers import TOLERANCE

import st_fastbackend.cli.embed_corpus as cli_corpus
from st_fastbackend.corpus.ids import REPEATED


def test_duplicate_ids_are_refused_up_front(folder, texts, tmp_path, capsys):
    """doc-3 given to a row of each of two files, with different texts: the trial's resume dropped one, exit 0."""
    (tmp_path / "in").mkdir()
    ids = [f"doc-{i}" for i in range(12)]
    write_parquet(tmp_path / "in" / "a.parquet", ids[:6], texts[1:7])
    write_parquet(tmp_path / "in" / "b.parquet", [*ids[6:9], "doc-3", *ids[10:]], texts[7:13])
    error = refused(capsys, tmp_path / "in", tmp_path / "out", "--model", folder)
    rows = f"{tmp_path / 'in' / 'a.parquet'} row 3, {tmp_path / 'in' / 'b.parquet'} row 3"
    assert f"id 'doc-3' is given to 2 rows ({rows}): " in error and "--skip-duplicate-ids" in error
    assert not (tmp_path / "out").exists()  # found before anything is written


def test_skip_duplicate_ids_lists_every_such_row_in_rejects(folder, texts, expected, tmp_path):
    """None of the rows of a repeated id is embedded (which text the id means cannot be told), each is listed with
    its row; a resume adds nothing and drops nothing."""
    ids = [f"doc-{i}" for i in range(12)]
    ids[7] = "doc-3"
    write_parquet(tmp_path / "in.parquet", ids, texts[1:13])
    for _ in range(2):  # the job, then a resume of the complete folder
        embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--skip-duplicate-ids",
                     "--shard-rows", 4)  # fmt: skip
        got = by_id(*read_output(tmp_path / "out"))
        assert sorted(got) == sorted(set(ids) - {"doc-3"})
        assert max(np.abs(got[ids[i]] - expected[1 + i]).max() for i in range(12) if i not in (3, 7)) < TOLERANCE
        rejects = pq.read_table(tmp_path / "out" / "rejects.parquet").to_pylist()
        assert [(row["id"], row["row"], row["reason"]) for row in rejects] == [("doc-3", r, REPEATED) for r in (3, 7)]
        assert manifest(tmp_path / "out")["rows"] == {"input": 12, "embedded": 10, "rejected": 2}


def test_null_ids_are_refused_or_listed_in_rejects(folder, texts, expected, tmp_path, capsys):
    """The trial: after a resume 2 of 3 rows without an id were gone, exit 0."""
    ids = [f"doc-{i}" for i in range(12)]
    ids[2] = ids[5] = ids[9] = None
    write_parquet(tmp_path / "in.parquet", ids, texts[1:13])
    error = refused(capsys, tmp_path / "in.parquet", tmp_path / "out", "--model", folder)
    assert f"row id=None of {tmp_path / 'in.parquet'} (row 2): its id is null; " in error and "--skip-invalid" in error
    assert not (tmp_path / "out").exists()
    for _ in range(2):  # the job, then a resume of the complete folder
        embed_corpus(tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--skip-invalid", "--shard-rows", 4)
        got = by_id(*read_output(tmp_path / "out"))
        assert sorted(got) == sorted(row_id for row_id in ids if row_id)
        assert max(np.abs(got[ids[i]] - expected[1 + i]).max() for i in range(12) if ids[i]) < TOLERANCE
        rejects = pq.read_table(tmp_path / "out" / "rejects.parquet").to_pylist()
        assert [(row["id"], row["row"]) for row in rejects] == [(None, 2), (None, 5), (None, 9)]
        assert {row["reason"] for row in rejects} == {"its id is null"}
        assert manifest(tmp_path / "out")["rows"] == {"input": 12, "embedded": 9, "rejected": 3}


def interrupt(out: Path) -> None:
    """As a job killed midway: a shard and the manifest missing."""
    sorted(out.glob("part-*.parquet"))[0].unlink()
    (out / "manifest.json").unlink()


def test_a_resume_refuses_a_model_changed_in_place(folder, texts, tmp_path, capsys):
    """The trial: weights rewritten in place (same path) were accepted, and the folder held rows of two models. The
    same shapes and size with other values, another pooling, another dtype, max_seq_length or matmul precision:
    each refused naming what changed; the same model again resumes."""
    model = shutil.copytree(folder, tmp_path / "model")
    write_parquet(tmp_path / "in.parquet", list(range(20)), texts[1:21])
    arguments = [tmp_path / "in.parquet", tmp_path / "out", "--model", model, "--shard-rows", 10]
    embed_corpus(*arguments)
    interrupt(tmp_path / "out")
    weights, pooling = model / "model.safetensors", model / "1_Pooling" / "config.json"
    original, original_pooling = weights.read_bytes(), pooling.read_text()
    header = 8 + int.from_bytes(original[:8], "little")  # the same header: only the float32 values change
    weights.write_bytes(original[:header] + (np.frombuffer(original[header:], np.float32) * 1.01).tobytes())
    assert weights.stat().st_size == len(original) and weights.read_bytes() != original
    error = refused(capsys, *arguments)
    assert f"{tmp_path / 'out'} holds the output of another job (" in error and "start over" in error
    assert "model_identity " in error and "(the model's files changed)" in error
    weights.write_bytes(original)
    pooling.write_text(json.dumps(json.loads(original_pooling) | {"pooling_mode_mean_tokens": False,
                                                                  "pooling_mode_max_tokens": True}))  # fmt: skip
    assert "(the model's files changed)" in refused(capsys, *arguments)
    pooling.write_text(original_pooling)
    for option, value, key in (("--dtype", "bf16", "dtype"), ("--max-seq-length", 16, "max_seq_length"),
                               ("--matmul-precision", "medium", "matmul_precision")):  # fmt: skip
        assert f"{key} None there, " in refused(capsys, *arguments, option, value)
    embed_corpus(*arguments)
    assert sorted(read_output(tmp_path / "out")[0]) == list(range(20))


def test_a_resume_refuses_weights_changed_only_inside_a_tensor(folder, texts, tmp_path, capsys):
    """The trial: a few bytes changed in the middle of the largest tensor, past its first and last 4 KiB (all the old
    identity read of it): exit 0 and rows of two models. Every byte of the weights counts now."""
    model = shutil.copytree(folder, tmp_path / "model")
    write_parquet(tmp_path / "in.parquet", list(range(20)), texts[1:21])
    arguments = [tmp_path / "in.parquet", tmp_path / "out", "--model", model, "--shard-rows", 10]
    embed_corpus(*arguments)
    interrupt(tmp_path / "out")
    weights = model / "model.safetensors"
    original = weights.read_bytes()
    header = 8 + int.from_bytes(original[:8], "little")
    tensors = json.loads(original[8:header])
    begin, end = max((entry["data_offsets"] for name, entry in tensors.items() if name != "__metadata__"),
                     key=lambda offsets: offsets[1] - offsets[0])  # fmt: skip
    assert end - begin > 3 * 4096
    middle = header + (begin + end) // 2 // 4 * 4
    changed = original[:middle] + (np.frombuffer(original[middle : middle + 16], np.float32) * 1.5).tobytes()
    weights.write_bytes(changed + original[middle + 16 :])
    assert "(the model's files changed)" in refused(capsys, *arguments)
    weights.write_bytes(original)
    embed_corpus(*arguments)
    assert sorted(read_output(tmp_path / "out")[0]) == list(range(20))


def test_a_large_files_digest_is_kept_until_any_byte_of_it_may_have_changed(folder, tmp_path, monkeypatch):
    """A file's full sha256 is computed once and kept by its stat signature: a second identity reads it from the
    cache; writing the same number of bytes in place with the old mtime put back (`touch -d`, `cp --preserve`) still
    changes its ctime, and the digest is computed again. A file changed within RACY_SECONDS is not kept."""
    from st_fastbackend.corpus import identity

    monkeypatch.setattr(identity, "SMALL_FILE", 0)  # every file through the cache
    monkeypatch.setenv(identity.CACHE_ENV, str(tmp_path / "cache"))
    model = shutil.copytree(folder, tmp_path / "model")
    first = identity.model_identity(str(model))
    assert not (tmp_path / "cache" / identity.CACHE_FILE).exists()  # every file was just written: none kept
    monkeypatch.setattr(identity, "RACY_SECONDS", -1.0)
    assert identity.model_identity(str(model)) == first
    cache = tmp_path / "cache" / identity.CACHE_FILE
    entries = json.loads(cache.read_text())
    weights = str((model / "model.safetensors").resolve())
    assert entries[weights]["sha256"] == hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    entries[weights]["sha256"] = "00" * 32  # what the cache says is what the identity takes
    cache.write_text(json.dumps(entries))
    from_cache = identity.model_identity(str(model))
    assert from_cache != first
    stat = (model / "model.safetensors").stat()
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes())  # same bytes, in place
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (model / "model.safetensors").stat().st_ino == stat.st_ino
    assert identity.model_identity(str(model)) == first  # computed again: the ctime moved


def test_a_resume_refuses_an_input_changed_anywhere(folder, texts, expected, tmp_path, capsys):
    """The trial: a JSON Lines file edited outside the 64 KiB fingerprinted at each end (same size) was accepted, and
    one row stayed stale. Every byte of the input counts now."""
    ids = list(range(30))
    path = tmp_path / "in.jsonl"
    write_jsonl(path, ids, texts[1:31], padding=8000)  # 240 kB
    arguments = [path, tmp_path / "out", "--model", folder, "--shard-rows", 10]
    embed_corpus(*arguments)
    interrupt(tmp_path / "out")
    original = path.read_bytes()
    where, text = original.index(b'"id": 15, "text": ') + 18, json.dumps(texts[16]).encode()
    assert original[where : where + len(text)] == text and (1 << 16) < where < len(original) - (1 << 16)
    edited = b'"' + text[1:-1][::-1] + b'"'  # row 15's text backwards: the same size
    path.write_bytes(original[:where] + edited + original[where + len(text) :])
    error = refused(capsys, *arguments)
    assert f"{tmp_path / 'out'} holds the output of another job (" in error and "start over" in error
    assert "input_fingerprint " in error and "(the input's content changed)" in error
    path.write_bytes(original)
    embed_corpus(*arguments)
    got = by_id(*read_output(tmp_path / "out"))
    assert sorted(got) == ids and max(np.abs(got[i] - expected[1 + i]).max() for i in ids) < TOLERANCE


CORRUPTIONS = {
    "bytes flipped": flip_embedding_bytes,
    "truncated": lambda shard: shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2]),
    "empty": lambda shard: shard.write_bytes(b""),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_a_bad_shard_is_named_and_embedded_again(folder, texts, expected, tmp_path, capsys, case):
    """The trial: flipped bytes were trusted (4 rows off by 1.9e34), a truncated or empty shard stopped the rerun
    with a pyarrow traceback. Now a shard is trusted only with the size and sha256 recorded when it was written (the
    manifest lists them): a bad one is named, moved aside and its rows embedded again."""
    ids = [f"doc-{i}" for i in range(len(texts))]
    write_parquet(tmp_path / "in.parquet", ids, texts)
    arguments = [tmp_path / "in.parquet", tmp_path / "out", "--model", folder, "--shard-rows", 10]
    embed_corpus(*arguments)
    bad = sorted((tmp_path / "out").glob("part-*.parquet"))[1]
    CORRUPTIONS[case](bad)
    capsys.readouterr()
    embed_corpus(*arguments)
    warning = capsys.readouterr().err
    assert (
        f"st-fastbackend: warning: {bad} cannot be trusted (" in warning and "its rows are embedded again" in warning
    )
    got = by_id(*read_output(tmp_path / "out"))
    assert sorted(got) == sorted(ids)
    assert max(np.abs(got[row_id] - expected[i]).max() for i, row_id in enumerate(ids)) < TOLERANCE
    shards = manifest(tmp_path / "out")["shards"]
    assert len(shards) == 4 and sum(shard["rows"] for shard in shards) == len(ids)
    for shard in shards:
        data = (tmp_path / "out" / shard["name"]).read_bytes()
        assert (shard["bytes"], shard["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())


def test_an_unwritable_or_full_output_folder_is_refused_before_the_model_loads(folder, texts, expected, tmp_path,
                                                                                capsys, monkeypatch):  # fmt: skip
    """The trial: a read-only or full folder was found only once the model had loaded (165 s), as a raw OSError."""

    def loaded(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_corpus, "load_model", loaded)
    write_parquet(tmp_path / "in.parquet", list(range(10)), texts[1:11])
    read_only = tmp_path / "read-only"
    if os.geteuid() == 0:  # root writes through permission bits; no one creates a file in sysfs
        read_only = Path("/sys/kernel")
    else:
        read_only.mkdir()
        read_only.chmod(0o555)
    error = refused(capsys, tmp_path / "in.parquet", read_only, "--model", folder)
    assert f"cannot write to output folder {read_only}: {read_only / '.embed-corpus.lock'}: Permission denied" in error
    # A full disk as shutil.disk_usage reports it (making one takes privileges a test does not have).
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 100))
    error = refused(capsys, tmp_path / "in.parquet", tmp_path / "out", "--model", folder)
    need = 10 * expected.shape[1] * 4
    assert (f"output folder {tmp_path / 'out'} has 100 bytes free, and the 10 rows of {expected.shape[1]} float32 "
            f"values still to embed need about {need:,} bytes: free some space") in error  # fmt: skip
    assert not list((tmp_path / "out").glob("part-*.parquet"))
