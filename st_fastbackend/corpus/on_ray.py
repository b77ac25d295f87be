"""The corpus job on Ray Data: read -> drop the rows done or invalid -> blocks of one actor call's rows ->
embed_dataset's actors (the fast model loaded once per worker) -> ShardSink. The sink writes shards exactly as
the local job does (whole or not at all, the job's identity and each row's content key in them), so either job
resumes a folder the other began. Only the first row of each text not embedded yet goes to Ray (copy_plan); the
driver then writes the others, copied as the local job copies them (reuse.py). The output folder must be one path
every node reaches (a shared filesystem on a cluster)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import ray.data
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink

from st_fastbackend.corpus.job import pending_rows
from st_fastbackend.corpus.output import OutputFolder, new_run_name
from st_fastbackend.corpus.read import (
    FORMATS,
    Columns,
    InputScan,
    ids_to_skip,
    in_shards,
    read_batches,
    still_to_embed,
)
from st_fastbackend.corpus.reuse import KEY, KEY_TYPE, Counts, RowIndex, content_keys, numbers_identity
from st_fastbackend.integrations.ray import ROWS_PER_CALL, embed_dataset


def start_ray(address: str | None, cpus: float) -> None:
    """Join the cluster at `address`; else one on this machine with the workers' CPUs and one to read and write.
    A Ray already started in this process (a test's, a notebook's) is used as it is."""
    quiet_ray_data()
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=int(cpus) + 1, include_dashboard=False, logging_level=logging.WARNING)


def quiet_ray_data() -> None:
    """The job draws its own progress bar and sums up in one line: without this, Ray Data logs a status block every
    10 s where stdout is not a terminal, and INFO lines (plans, starts, the sink) between them. Warnings stay."""
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "Progress bars disabled. To enable..."


def read_dataset(scan: InputScan, columns: Columns) -> ray.data.Dataset:
    """The input files as one dataset of [id, text]; JSON Lines files pyarrow refuses are read here with json."""
    paths = [str(path) for path in scan.files if path not in scan.python_json]
    parts = []
    if paths:
        kind = FORMATS[scan.files[0].suffix]
        if kind == "parquet":
            parts.append(ray.data.read_parquet(paths, columns=[columns.id, columns.text], file_extensions=None))
        elif kind == "csv":
            import pyarrow.csv as csv

            convert = csv.ConvertOptions(column_types={columns.text: pa.string()})
            parts.append(ray.data.read_csv(paths, convert_options=convert).select_columns([columns.id, columns.text]))
        else:
            parts.append(ray.data.read_json(paths, file_extensions=None).select_columns([columns.id, columns.text]))
    for path in sorted(scan.python_json):
        parts.append(ray.data.from_arrow(pa.Table.from_batches(list(read_batches(path, columns, python_json=True)))))
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def pending_dataset(scan: InputScan, columns: Columns, done: pa.Array | None) -> ray.data.Dataset:
    """The rows still to embed, in blocks of at most one actor call's rows: a file of one large row group is
    one block, which would go to one actor whole while the others wait (the split runs in the read task)."""
    ds = read_dataset(scan, columns)
    skip = ids_to_skip(scan, done)
    ds = ds.map_batches(still_to_embed, batch_format="pyarrow", fn_kwargs=dict(columns=columns, skip=skip))
    return ds.repartition(target_num_rows_per_block=ROWS_PER_CALL)


TOKENS = "__st_fastbackend_tokens"  # each row's token count, from the actors to the sink (not written)


class ShardSink(Datasink):
    """Each write task cuts what it receives into shards of `shard_rows` rows, written whole or not at all, and
    returns the rows and tokens it wrote; `rows` and `tokens`: their sums, once the job is done."""

    def __init__(self, folder: OutputFolder, run: str, shard_rows: int) -> None:
        self.folder, self.run, self.shard_rows = folder, run, shard_rows
        self.rows = self.tokens = 0

    @property
    def min_rows_per_write(self) -> int:
        return self.shard_rows

    def write(self, blocks: Iterable, ctx) -> tuple[int, int]:
        tables = (BlockAccessor.for_block(block).to_arrow() for block in blocks)
        batches = (batch for table in tables for batch in table.to_batches())
        written = tokens = 0
        spec = self.folder.spec
        for index, shard in enumerate(in_shards(batches, self.shard_rows)):
            tokens += pc.sum(shard.column(TOKENS)).as_py() or 0
            embedding = shard.column("embedding").combine_chunks()
            rows = np.asarray(embedding.flatten()).reshape(len(shard), embedding.type.list_size)
            table, dimension = self.folder.rows_table(rows)
            keys = pa.array(content_keys(shard.column(spec.text_column).to_pylist(), numbers_identity(spec)), KEY_TYPE)
            table = table.add_column(0, KEY, keys).add_column(0, spec.id_column, shard.column(spec.id_column))
            name = f"part-{self.run}-{ctx.task_idx:05d}-{index:05d}.parquet"
            self.folder.write_table(name, table, dimension, asdict(Counts(embedded=len(shard))))
            written += len(shard)
        return written, tokens

    def on_write_complete(self, write_result) -> None:
        self.rows = sum(rows for rows, _ in write_result.write_returns)
        self.tokens = sum(tokens for _, tokens in write_result.write_returns)


def run_ray(scan: InputScan, folder: OutputFolder, done: pa.Array | None, model: str, options: dict,
            shard_rows: int) -> tuple[int, int, float]:  # fmt: skip
    """Rows and tokens embedded by this run and the seconds it took; `done`: from folder.prepare(); options:
    embed_dataset's keywords."""
    columns = Columns(folder.spec.id_column, folder.spec.text_column)
    start = time.perf_counter()
    ds = pending_dataset(scan, columns, done)
    ds = embed_dataset(ds, model, text_column=columns.text, token_column=TOKENS, id_column=columns.id, **options)
    sink = ShardSink(folder, new_run_name(), shard_rows)
    ds.write_datasink(sink)
    return sink.rows, sink.tokens, time.perf_counter() - start


def copy_plan(scan: InputScan, folder: OutputFolder, done: pa.Array | None,
              index: RowIndex) -> tuple[pa.Array | None, int]:  # fmt: skip
    """The ids of the pending rows the driver copies after the Ray job (their text's rows are in `index`, or an
    earlier pending row has that text) with `done`'s, and how many rows are left to Ray."""
    columns, identity = Columns(folder.spec.id_column, folder.spec.text_column), numbers_identity(folder.spec)
    seen, copied, embedded = set(), [] if done is None else [done], 0
    for batch in pending_rows(scan, columns, done):
        keys = content_keys(batch.column(columns.text).to_pylist(), identity)
        copy = []
        for key in keys:
            copy.append(key in index.places or key in seen)
            seen.add(key)
        copied.append(batch.column(columns.id).filter(pa.array(copy)))
        embedded += len(keys) - sum(copy)
    copied = [chunk.cast(copied[0].type) for chunk in copied if len(chunk)]
    return (pa.concat_arrays(copied) if copied else None), embedded


def written_ids(folder: OutputFolder) -> pa.Array | None:
    """The ids of every shard in the folder (after the Ray job: those prepare() trusted and the new ones)."""
    ids = [pq.read_table(shard, columns=[folder.spec.id_column]).column(0) for shard in folder.shards()]
    chunks = [chunk.cast(ids[0].type) for column in ids for chunk in column.chunks]
    return pa.concat_arrays(chunks) if chunks else None


def shard_dimension(shards: list[Path]) -> int | None:
    """The embeddings' width, from a shard (the driver of a Ray job never loads the model); None: no shards."""
    return pq.read_schema(shards[0]).field("embedding").type.list_size if shards else None


class NothingToEmbed:
    """The embedder of the driver's copy pass after the Ray job (job.run_local): every text's rows are written."""

    chunking = None

    def __init__(self, dimension: int | None, prompt: str | None) -> None:
        self.dimension, self.prompt = dimension, prompt

    def __call__(self, texts: list[str]):
        raise RuntimeError(f"{len(texts)} texts were left to embed after the Ray job")  # a bug, not the input's


ACTOR_MEMORY = 1 << 30  # an actor's memory beside its weights: PyTorch, Ray's worker, activations


def local_layout(weights: int, workers: int | None, threads: float | None, cpus: int,
                 available: int) -> tuple[int, float]:  # fmt: skip
    """(actors, CPUs each) for a job on this machine. Unset `workers`: an actor per `threads` CPUs (one each by
    default), as many as fit in half the `available` bytes at twice the `weights` (bytes) plus ACTOR_MEMORY
    each; one actor where `weights` is 0 (not known, or not on the CPU). Two threads of one actor wait for each
    other at every parallel step, so a slice Ray's own processes take from one core stalls both; separate
    actors lose only that slice. Unset `threads`: the CPUs shared out among the actors."""
    if workers is None:
        fit = available // 2 // (2 * weights + ACTOR_MEMORY) if weights else 1
        workers = max(1, min(int(cpus // (threads or 1)), fit))
    return workers, threads or max(1, cpus // workers)


def layout_here(model: str, on_cpu: bool, workers: int | None, threads: float | None) -> tuple[int, float]:
    """local_layout for this machine: its CPUs (a container's or taskset's share where the OS says), its free
    memory, and the model folder's safetensors where the model runs on the CPU (a Hub id's size is not known)."""
    from st_fastbackend.engine.onednn import free_memory_bytes

    folder = Path(model).expanduser()
    weights = sum(path.stat().st_size for path in folder.rglob("*.safetensors")) if on_cpu and folder.is_dir() else 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return local_layout(weights, workers, threads, cpus, free_memory_bytes())
