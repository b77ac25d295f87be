"""`embed-corpus --ray` with content keys and --reuse, on a local Ray of 2 CPUs: only the first row of each text
not embedded yet goes to the actors, the driver copies the others; an edited input reusing a local output equals a
clean local run, the reused rows bit for bit; a Ray output is reused by a local job in turn; a Ray reusing run cut
off as a kill leaves it resumes."""

import json

import numpy as np
import pytest
from corpus_files import embed_corpus, manifest
from test_corpus_reuse import assert_equal_rows, edited, output, rows_of

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.mark.slow
def test_ray_reuses_an_edited_input_and_is_reused(folder, texts, tmp_path, capsys):
    after, counts = edited(texts, tmp_path)
    common = ("--model", folder, "--shard-rows", 7)
    embed_corpus(tmp_path / "before.parquet", tmp_path / "previous", *common)
    capsys.readouterr()
    embed_corpus(tmp_path / "after.parquet", tmp_path / "out", *common, "--reuse", tmp_path / "previous", "--ray",
                 "--num-workers", 1)  # fmt: skip
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"{len(after)} rows written: 25 reused, 1 deduplicated, 7 embedded (0 done before, ")
    embed_corpus(tmp_path / "after.parquet", tmp_path / "clean", *common)
    got, clean, first = output(tmp_path / "out"), output(tmp_path / "clean"), output(tmp_path / "previous")
    assert_equal_rows(got, clean)
    kept = [f"doc-{i}" for i in range(6, 30)]
    assert rows_of(got, kept).equals(rows_of(first, kept))
    assert rows_of(got, ["dup-new"]).equals(rows_of(got, ["doc-30"]))
    assert manifest(tmp_path / "out")["texts"] == counts

    embed_corpus(tmp_path / "after.parquet", tmp_path / "again", *common, "--reuse", tmp_path / "out")
    assert manifest(tmp_path / "again")["texts"] == {"reused": len(after), "deduplicated": 0, "embedded": 0}
    assert output(tmp_path / "again").equals(got)
    assert np.array_equal(output(tmp_path / "again").column("content_key"), clean.column("content_key"))


@pytest.mark.slow
def test_a_ray_reusing_run_cut_off_resumes(folder, texts, tmp_path, capsys):
    """The folder a SIGKILL leaves (complete shards, no manifest, a half-written temporary file; a shard's write is
    atomic) after a Ray run with --reuse: the same command completes it, equal to the uninterrupted run, the rows
    copied from the earlier output still bit for bit, and the counts those of the shards it kept and the ones it
    wrote."""
    edited(texts, tmp_path)
    common = ("--model", folder, "--shard-rows", 7)
    embed_corpus(tmp_path / "before.parquet", tmp_path / "previous", *common)
    job = (tmp_path / "after.parquet", tmp_path / "out", *common, "--reuse", tmp_path / "previous", "--ray",
           "--num-workers", 1)  # fmt: skip
    embed_corpus(*job)
    whole = output(tmp_path / "out")
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert len(shards) > 2
    for shard in shards[len(shards) // 2 :]:
        shard.unlink()
        shard.with_name(f".{shard.name}.json").unlink()
    (tmp_path / "out" / "manifest.json").unlink()
    (tmp_path / "out" / f".{shards[-1].name}.tmp").write_bytes(b"PAR1 half a shard")
    embed_corpus(*job)
    assert output(tmp_path / "out").equals(whole)
    assert not list((tmp_path / "out").glob(".*.tmp"))
    written = [json.loads(path.read_text()) for path in (tmp_path / "out").glob(".part-*.json")]
    counts = {name: sum(record[name] for record in written) for name in ("reused", "deduplicated", "embedded")}
    assert manifest(tmp_path / "out")["texts"] == counts == {"reused": 25, "deduplicated": 1, "embedded": 7}
