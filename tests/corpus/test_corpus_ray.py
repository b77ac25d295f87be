"""Ray Data, on a local Ray cluster of 2 CPUs started once for the module: `embed-corpus --ray` resumes a folder
the local job began with what model.encode gives, and embed_dataset adds an `embedding` column."""

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from corpus_files import by_id, empty_texts_without_tokens, manifest, read_output, write_jsonl
from helpers import TOLERANCE

from st_fastbackend import SentenceTransformer
from st_fastbackend.cli import main
from st_fastbackend.integrations.ray import ROWS_PER_CALL

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.mark.slow
def test_ray_cli_resumes_what_the_local_job_began(folder, texts, expected, tmp_path, capsys):
    """Shards are the same on both paths: a local run loses a shard, `--ray` adds only its rows, each equal to
    model.encode's, writes the manifest, and counts the tokens it embedded."""
    ids = [f"doc-{i}" for i in range(len(texts))]
    write_jsonl(tmp_path / "in.jsonl", ids, texts)
    arguments = ["embed-corpus", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", str(folder)]
    main([*arguments, "--shard-rows", "10"])
    lost = sorted((tmp_path / "out").glob("part-*.parquet"))[2]
    lost.unlink()
    (tmp_path / "out" / "manifest.json").unlink()
    capsys.readouterr()
    main([*arguments, "--ray", "--num-workers", "1", "--shard-rows", "10"])
    tokens = sum(map(len, SentenceTransformer(str(folder), backend="fast")[0].texts.encode(texts[20:30])))
    assert f"10 rows written: 0 reused, 0 deduplicated, 10 embedded (30 done before, 0 rejected, {len(texts)} in " \
        f"the input); {tokens} tokens in " in capsys.readouterr().err  # fmt: skip
    got = by_id(*read_output(tmp_path / "out"))  # no id twice
    assert sorted(got) == sorted(ids) and len(list((tmp_path / "out").glob("part-*.parquet"))) == 4
    assert max(np.abs(got[row_id] - expected[i]).max() for i, row_id in enumerate(ids)) < TOLERANCE
    written = manifest(tmp_path / "out")
    assert written["rows"]["embedded"] == len(texts) and written["dimension"] == expected.shape[1]


@pytest.mark.slow
def test_ray_cli_names_a_text_without_tokens_by_its_id(folder, texts, tmp_path, capsys):
    """Without a special token "" has no token at all, found only by an actor: the one-line error names the row's
    id (the actor's own error, not Ray's wrapper)."""
    model = shutil.copytree(folder, tmp_path / "model")
    for path in model.rglob("tokenizer.json"):  # the tokenizer adds no special token
        path.write_text(json.dumps(json.loads(path.read_text()) | {"post_processor": None}))
    write_jsonl(tmp_path / "in.jsonl", [f"doc-{i}" for i in range(4)], [texts[1], texts[2], "", texts[3]])
    with pytest.raises(SystemExit) as exit_:
        main(["embed-corpus", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", str(model), "--ray"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2
    assert "Ray job failed: ValueError: the row with id 'doc-2' cannot be embedded: its text '' has no tokens" in error
    assert not ray.data.DataContext.get_current().raise_original_map_exception  # put back as it was


@pytest.mark.slow
def test_embed_dataset_adds_an_embedding_column(folder, texts, expected):
    from st_fastbackend.integrations.ray import embed_dataset

    ds = ray.data.from_items([{"key": i, "body": text} for i, text in enumerate(texts)])
    rows = embed_dataset(ds, str(folder), text_column="body", num_workers=1, batch_size=8, token_column="n").take_all()
    assert sorted(row["key"] for row in rows) == list(range(len(texts)))
    assert max(np.abs(np.asarray(row["embedding"]) - expected[row["key"]]).max() for row in rows) < TOLERANCE
    lengths = list(map(len, SentenceTransformer(str(folder), backend="fast")[0].texts.encode(texts)))
    assert [row["n"] for row in sorted(rows, key=lambda row: row["key"])] == lengths
    with pytest.raises(TypeError, match="does not take precision"):
        embed_dataset(ds, str(folder), precision="int8")
    bad = ray.data.from_items([{"key": "a", "body": texts[1]}, {"key": "b", "body": None}])
    with pytest.raises(Exception, match="the row with key 'b' cannot be embedded: its text is null"):
        embed_dataset(bad, str(folder), text_column="body", id_column="key", num_workers=1).take_all()


def actor_options(folder, **options) -> dict:
    return dict(model=str(folder), load_kwargs={}, text_column="text", threads=None, matmul_precision=None,
                token_column=None, id_column=None, encode_kwargs={}) | options  # fmt: skip


def test_the_actor_sets_the_matmul_precision(folder):
    """A process-wide PyTorch setting: the actor sets it in its own process (here, this one), as --matmul-precision
    does for the local job."""
    from st_fastbackend.integrations.ray import EmbedBatches

    before = torch.get_float32_matmul_precision()
    try:
        EmbedBatches(**actor_options(folder, matmul_precision="medium"))
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_actor_names_a_row_it_cannot_embed_by_its_id(folder, texts, monkeypatch):
    """A null text, or one without any token (a tokenizer that adds no special token), is named by its id where
    the actor is told the id column (the corpus job tells it), else by its place in the batch."""
    from st_fastbackend.integrations.ray import EmbedBatches

    empty_texts_without_tokens(monkeypatch)
    actor = EmbedBatches(**actor_options(folder, id_column="key"))
    batch = pa.table({"key": ["a", "b", "c"], "text": [texts[1], "", texts[2]]})
    with pytest.raises(ValueError, match="^the row with key 'b' cannot be embedded: its text '' has no tokens$"):
        actor(batch)
    with pytest.raises(ValueError, match="^the row with key 'c' cannot be embedded: its text is null$"):
        actor(pa.table({"key": ["a", "c"], "text": [texts[1], None]}))
    actor.id_column = None
    with pytest.raises(ValueError, match="^row 1 of a batch of 3 cannot be embedded: its text '' has no tokens$"):
        actor(batch)


def test_the_actor_refuses_a_column_it_would_add(folder, texts):
    from st_fastbackend.integrations.ray import EmbedBatches

    actor = EmbedBatches(**actor_options(folder, token_column="n"))
    for taken in ("embedding", "n"):
        with pytest.raises(ValueError, match=f"already has a column '{taken}', which embed_dataset adds"):
            actor(pa.table({"text": texts[1:3], taken: [0, 0]}))
    assert actor(pa.table({"text": texts[1:3]})).column_names == ["text", "embedding", "n"]
    actor.id_column = "key"
    with pytest.raises(ValueError, match="id_column='key'\\): the dataset has no such column"):
        actor(pa.table({"text": texts[1:3]}))


@pytest.mark.slow
def test_the_job_splits_a_single_row_group_for_the_pool(texts, tmp_path):
    """A file of one row group reads as one block, which one actor would embed whole: the job's dataset reaches
    the actors in blocks of at most a call's rows, the done rows dropped."""
    from st_fastbackend.corpus.on_ray import pending_dataset
    from st_fastbackend.corpus.read import Columns, scan_input

    rows = 3 * ROWS_PER_CALL + 5
    pq.write_table(pa.table({"id": list(range(rows)), "text": [texts[i % len(texts)] for i in range(rows)]}),
                   tmp_path / "in.parquet")  # fmt: skip
    columns = Columns("id", "text")
    ds = pending_dataset(scan_input((tmp_path / "in.parquet",), columns, True), columns, done=pa.array([0, 1]))
    sizes = [len(block) for block in ds.iter_batches(batch_size=None, batch_format="pyarrow")]
    assert max(sizes) <= ROWS_PER_CALL and sum(sizes) == rows - 2


def test_local_layout_one_single_thread_actor_per_cpu_as_memory_allows():
    from st_fastbackend.corpus.on_ray import ACTOR_MEMORY, local_layout

    weights = 1 << 30
    each = 2 * weights + ACTOR_MEMORY
    assert local_layout(weights, None, None, 8, available=1 << 50) == (8, 1)  # one per CPU at most
    assert local_layout(weights, None, None, 8, available=2 * 3 * each) == (3, 2)
    assert local_layout(weights, None, None, 8, available=each) == (1, 8)
    assert local_layout(0, None, None, 8, available=1 << 50) == (1, 8)  # the size not known: one actor
    assert local_layout(weights, None, 2, 8, available=1 << 50) == (4, 2)  # --cpus-per-worker 2
    assert local_layout(weights, 4, None, 8, available=0) == (4, 2)  # --num-workers 4: the CPUs shared out


def test_ray_cli_lays_out_its_own_ray_by_device(folder, tmp_path, monkeypatch):
    """The Ray the CLI starts on this machine: on the CPU an actor per CPU (this small model fits), on a GPU
    device one actor with every CPU and a GPU; an address or a Ray already started: one actor of one CPU."""
    import st_fastbackend.corpus.on_ray as corpus_ray

    layouts = []

    def stop(scan, output, done, model, options, shard_rows):
        layouts.append((options["num_workers"], options["cpus_per_worker"], options["gpus_per_worker"]))
        raise RuntimeError("stopped before running")

    monkeypatch.setattr(corpus_ray, "start_ray", lambda address, cpus: None)
    monkeypatch.setattr(corpus_ray, "run_ray", stop)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    write_jsonl(tmp_path / "in.jsonl", ["a"], ["a text"])
    arguments = ["embed-corpus", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", str(folder), "--ray"]
    for device in ("cpu", "cuda"):
        with monkeypatch.context() as patch, pytest.raises(SystemExit):
            patch.setattr(ray, "is_initialized", lambda: False)
            main([*arguments, "--device", device])
    with pytest.raises(SystemExit):
        main([*arguments, "--device", "cpu"])  # this module's Ray
    assert layouts == [(4, 1, 0), (1, 4, 1), (1, 1, 0)]


@pytest.mark.slow
def test_the_docstring_example_runs_on_two_cpus(folder, texts, tmp_path, caplog):
    """The README's example (embed_dataset's docstring's, with text_column and batch_size) as written on this
    2-CPU cluster, num_workers=2: the two actors reserve half a CPU each, leaving one to the read and write
    tasks, and the job ends with encode()'s embeddings. Two actors of a whole CPU each left the read task none
    and waited for ever (issue 35)."""
    from st_fastbackend.integrations.ray import embed_dataset

    (tmp_path / "corpus").mkdir()
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), tmp_path / "corpus" / "part.parquet")
    with caplog.at_level("INFO", "st_fastbackend"):
        ds = ray.data.read_parquet(str(tmp_path / "corpus"))
        ds = embed_dataset(ds, str(folder), text_column="text", num_workers=2, prompt="passage: ", batch_size=64)
    assert caplog.messages == ["embed_dataset: 2 actors reserve 0.5 CPU each (torch threads: 1), leaving 1 of the "
                               "Ray cluster's 2 CPUs to read and write"]  # fmt: skip
    ds.write_parquet(str(tmp_path / "embeddings"))
    table = pq.read_table(tmp_path / "embeddings").sort_by("id")
    got = np.asarray(table.column("embedding").combine_chunks().flatten()).reshape(len(texts), -1)
    want = SentenceTransformer(str(folder), backend="fast", device="cpu").encode(texts, prompt="passage: ")
    assert table.column("id").to_pylist() == list(range(len(texts))) and np.abs(got - want).max() < TOLERANCE


def test_a_pool_larger_than_the_cluster_is_refused(folder, texts, tmp_path, capsys):
    """More workers than the cluster's CPUs is refused before anything runs, naming the CPUs, the actors and the
    read tasks' need, from Python and from the CLI (one line, exit status 2)."""
    from st_fastbackend.integrations.ray import embed_dataset
    from st_fastbackend.integrations.ray_pool import PoolError

    refusal = ("num_workers=3 (--num-workers): 3 actors of 1 CPU need 3 CPUs and Ray Data's read tasks 1 more, "
               "but the Ray cluster has 2 CPUs; ask for fewer workers or cpus_per_worker")  # fmt: skip
    with pytest.raises(PoolError) as error:
        embed_dataset(ray.data.from_items([{"text": "a"}]), str(folder), num_workers=3)
    assert str(error.value) == refusal
    write_jsonl(tmp_path / "in.jsonl", ["a"], ["a text"])
    with pytest.raises(SystemExit) as exit_:
        main(["embed-corpus", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", str(folder), "--ray",
              "--num-workers", "3"])  # fmt: skip
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"st-fastbackend: error: {refusal}"


def test_fit_pool_leaves_a_cpu_to_read_and_write():
    from st_fastbackend.integrations.ray_pool import Pool, PoolError, fit_pool

    assert fit_pool(None, 1, 0, 8, 0) == Pool(None, 7, 1, 0)  # Ray grows the pool up to 7 of 8
    assert fit_pool(None, 2, 0, 8, 0) == Pool(None, 3, 2, 0)
    assert fit_pool(None, 4, 0, 4, 0) == Pool(1, None, 3, 0)  # one actor of 4 threads reserving 3 CPUs
    assert fit_pool(3, 1, 0, 8, 0) == Pool(3, None, 1, 0)  # fits beside the read tasks: as asked
    assert fit_pool(4, 2, 0, 8, 0) == Pool(4, None, 1.75, 0)  # every CPU: a part of one each
    assert fit_pool(2, 0, 1, 2, 2) == Pool(2, None, 0, 1)  # actors that reserve no CPU
    assert fit_pool(None, 1, 1, 16, 2) == Pool(None, 2, 1, 1)  # as many as the GPUs hold
    assert fit_pool(4, 1, 0.5, 16, 2) == Pool(4, None, 1, 0.5)
    for workers, cpus, gpus, cluster, refusal in [
        (5, 2, 0, (8, 0), "5 actors of 2 CPU need 10 CPUs and Ray Data's read tasks 1 more, but the Ray cluster "
                          "has 8 CPUs"),
        (None, 1, 0, (1, 0), "the Ray cluster has 1 CPU: none is left for the actors beside Ray Data's read tasks"),
        (3, 1, 1, (8, 2), "3 actors of 1 GPU (gpus_per_worker, --gpus-per-worker) need 3 GPUs, but the Ray "
                          "cluster has 2"),
        (None, 1, 1, (8, 0), "1 actor of 1 GPU (gpus_per_worker, --gpus-per-worker) need 1 GPUs, but the Ray "
                             "cluster has 0"),
    ]:  # fmt: skip
        with pytest.raises(PoolError, match=refusal.replace("(", "\\(").replace(")", "\\)")):
            fit_pool(workers, cpus, gpus, *cluster)


@pytest.mark.slow
def test_a_stall_ends_the_job_naming_what_waits(folder, texts, tmp_path):
    """Another job holds one of the two CPUs, the actor the other: the read task can never start. The job ends
    after stall_timeout seconds without output, naming the operator that waits and the resources."""
    from st_fastbackend.integrations.ray import embed_dataset
    from st_fastbackend.integrations.ray_stall import PipelineStalled

    @ray.remote(num_cpus=1)
    class Other:
        def ready(self) -> bool:
            return True

    other = Other.remote()
    ray.get(other.ready.remote())
    try:
        pq.write_table(pa.table({"id": [0, 1], "text": texts[:2]}), tmp_path / "in.parquet")
        ds = embed_dataset(ray.data.read_parquet(str(tmp_path / "in.parquet")), str(folder), num_workers=1,
                           stall_timeout=3)  # fmt: skip
        with pytest.raises(PipelineStalled) as error:
            ds.take_all()
    finally:
        ray.kill(other)
    message = str(error.value)
    assert message.startswith("no rows out for 3s while ") and " waits for 1 CPU" in message, message
    assert "the Ray cluster has 2 CPU (0 CPU free); this job asks for " in message
    assert "MapBatches(EmbedBatches) 1 CPU" in message and message.endswith("raise stall_timeout (--stall-timeout)")


def test_worker_gpus_by_device(monkeypatch):
    """One GPU per actor where the model runs on CUDA (the device asked for, else the driver's); a CUDA device
    with no GPU per actor, or a CPU device with GPUs, is refused."""
    from st_fastbackend.integrations.ray_pool import PoolError, worker_gpus

    assert worker_gpus(None, None) == 0 and worker_gpus(None, "cpu") == 0  # no GPU here
    assert worker_gpus(None, "cuda") == 1 and worker_gpus(None, "cuda:0") == 1 and worker_gpus(0.5, "cuda") == 0.5
    assert worker_gpus(2, None) == 2 and worker_gpus(0, None) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the driver on a GPU host
    assert worker_gpus(None, None) == 1 and worker_gpus(None, "cpu") == 0 and worker_gpus(0, None) == 0
    hidden = "^device 'cuda' with no GPU per worker: Ray hides the GPUs from an actor that holds none; give each one"
    with pytest.raises(PoolError, match=hidden + ", e.g. gpus_per_worker=1 \\(--gpus-per-worker 1\\)$"):
        worker_gpus(0, "cuda")
    with pytest.raises(PoolError, match="^device 'cpu' with gpus_per_worker=1 \\(--gpus-per-worker\\): the actors "):
        worker_gpus(1, "cpu")


def test_a_cuda_device_gets_a_gpu_per_actor(folder, tmp_path, capsys):
    """embed_dataset and the CLI: load_kwargs' / --device cuda with no GPU per worker is refused before the model
    loads; left out, one GPU per actor, which this cluster (no GPU) cannot hold: refused too, not a wait."""
    from st_fastbackend.integrations.ray import embed_dataset
    from st_fastbackend.integrations.ray_pool import PoolError

    ds = ray.data.from_items([{"text": "a"}])
    with pytest.raises(PoolError, match="^device 'cuda' with no GPU per worker"):
        embed_dataset(ds, str(folder), load_kwargs={"device": "cuda"}, gpus_per_worker=0)
    with pytest.raises(PoolError, match="^1 actor of 1 GPU .* need 1 GPUs, but the Ray cluster has 0$"):
        embed_dataset(ds, str(folder), load_kwargs={"device": "cuda"})
    write_jsonl(tmp_path / "in.jsonl", ["a"], ["a text"])
    arguments = ["embed-corpus", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", str(folder), "--ray"]
    for extra, refusal in [(["--gpus-per-worker", "0"], "device 'cuda' with no GPU per worker"),
                           ([], "1 actor of 1 GPU (gpus_per_worker, --gpus-per-worker) need 1 GPUs")]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            main([*arguments, "--device", "cuda", *extra])
        assert exit_.value.code == 2 and refusal in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("part-*"))


@pytest.mark.slow
def test_a_share_of_a_gpu_sizes_the_token_budget_on_that_share(monkeypatch):
    """Two actors of gpus_per_worker=0.5 see the same free memory: each sizes its budget on its half of the GPU,
    less what it holds already; a whole GPU (or none) keeps the model's own budget. CUDA's memory readings are
    stand-ins here (no GPU on this machine)."""
    from types import SimpleNamespace

    from st_fastbackend.engine.schedule import cuda_max_tokens
    from st_fastbackend.integrations.ray import share_budget

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * gib)  # its weights
    config, cuda = SimpleNamespace(hidden_size=4096, intermediate_size=14336), torch.device("cuda")
    per_token = 4 * (4096 + 14336) * 2
    assert cuda_max_tokens(config, torch.float16, cuda) == 62 * gib // 2 // per_token  # free + cached, halved
    assert cuda_max_tokens(config, torch.float16, cuda, share=0.5) == (40 - 4) * gib // 2 // per_token
    assert share_budget(config, torch.float16, cuda, 0.5) == (40 - 4) * gib // 2 // per_token
    assert share_budget(config, torch.float16, cuda, 1) is None
    assert share_budget(config, torch.float16, cuda, 0) is None
    assert share_budget(config, torch.float16, torch.device("cpu"), 0.5) is None


@pytest.mark.slow
def test_ray_data_is_quiet_under_the_cli():
    """Issue 47: Ray Data logged a status block every 10 s (stdout not a terminal) beside the job's own bar."""
    import logging

    import ray.data

    from st_fastbackend.corpus.on_ray import quiet_ray_data

    context = ray.data.DataContext.get_current()
    before = context.enable_progress_bars
    try:
        quiet_ray_data()
        assert not context.enable_progress_bars
        assert logging.getLogger("ray.data._internal.progress.logging_progress").getEffectiveLevel() > logging.INFO
    finally:
        context.enable_progress_bars = before
