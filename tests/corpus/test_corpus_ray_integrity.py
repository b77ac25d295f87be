"""embed-corpus --ray keeps the corpus job's guarantees (tests/corpus/test_corpus_integrity.py): what the local job
refuses before it starts is refused on Ray too, and a Ray resume embeds the rows of a shard it cannot trust again,
leaves out the rows of a repeated id and writes no id twice. A local Ray cluster of 2 CPUs, started once for the
module."""

import fcntl
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from corpus_files import by_id, flip_embedding_bytes, manifest, read_output, refused, write_jsonl
from helpers import TOLERANCE

from st_fastbackend import SentenceTransformer
from st_fastbackend.cli import main

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
pytestmark = pytest.mark.usefixtures("ray_cluster")


def refused_on_ray(capsys, *args) -> str:
    return refused(capsys, *args, "--ray", "--num-workers", "1")


@pytest.mark.slow
def test_ray_refuses_a_held_folder_and_null_or_repeated_ids(folder, texts, tmp_path, capsys):
    """The folder's lock held by another open file (as by another process: flock locks one open file against every
    other), an id given to two rows, a null id: each refused in one line before Ray runs anything."""
    ids = [f"doc-{i}" for i in range(12)]
    write_jsonl(tmp_path / "in.jsonl", ids, texts[1:13])
    (tmp_path / "out").mkdir()
    holder = os.open(tmp_path / "out" / ".embed-corpus.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        os.write(holder, b"4242\n")
        error = refused_on_ray(capsys, tmp_path / "in.jsonl", tmp_path / "out", "--model", folder)
    finally:
        os.close(holder)
    assert f"output folder {tmp_path / 'out'} is in use by another embed-corpus job (pid 4242, " in error
    write_jsonl(tmp_path / "repeated.jsonl", [*ids[:7], "doc-3", *ids[8:]], texts[1:13])
    error = refused_on_ray(capsys, tmp_path / "repeated.jsonl", tmp_path / "out", "--model", folder)
    assert f"id 'doc-3' is given to 2 rows ({tmp_path / 'repeated.jsonl'} row 3, " in error
    write_jsonl(tmp_path / "null.jsonl", [*ids[:5], None, *ids[6:]], texts[1:13])
    error = refused_on_ray(capsys, tmp_path / "null.jsonl", tmp_path / "out", "--model", folder)
    assert f"row id=None of {tmp_path / 'null.jsonl'} (row 5): its id is null; " in error
    assert not list((tmp_path / "out").glob("part-*.parquet"))


@pytest.mark.slow
def test_ray_resume_embeds_a_bad_shard_again_and_leaves_out_repeated_ids(folder, texts, tmp_path, capsys):
    """A local job with --skip-duplicate-ids loses a shard (as if killed) and another one's bytes are flipped: the
    Ray resume names the bad shard and embeds its rows and the lost ones again, none of the repeated id's."""
    ids = [f"doc-{i}" for i in range(len(texts))]
    ids[7] = "doc-3"
    write_jsonl(tmp_path / "in.jsonl", ids, texts)
    arguments = ["embed-corpus", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", str(folder),
                 "--shard-rows", "10", "--skip-duplicate-ids"]  # fmt: skip
    main(arguments)
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    shards[2].unlink()
    flip_embedding_bytes(shards[1])
    capsys.readouterr()
    main([*arguments, "--ray", "--num-workers", "1"])
    assert f"st-fastbackend: warning: {shards[1]} cannot be trusted (" in capsys.readouterr().err
    got = by_id(*read_output(tmp_path / "out"))  # no id twice
    assert sorted(got) == sorted(set(ids) - {"doc-3"})
    expected = SentenceTransformer(str(folder), backend="fast", device="cpu").encode(texts)
    assert max(np.abs(got[row_id] - expected[i]).max() for i, row_id in enumerate(ids) if row_id in got) < TOLERANCE
    assert manifest(tmp_path / "out")["rows"] == {"input": len(texts), "embedded": len(texts) - 2, "rejected": 2}
    assert [row["row"] for row in pq.read_table(tmp_path / "out" / "rejects.parquet").to_pylist()] == [3, 7]
