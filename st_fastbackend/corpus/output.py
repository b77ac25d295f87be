"""The corpus job's output folder: parquet shards (the id column, each row's content key (reuse.py) and the rows'
columns, by the model's kind (OUTPUT_KINDS): `embedding`, a fixed-size list per row or a list of them per row of a
multi-vector model, or a sparse model's `indices` and `values`), a record of each one's size, sha256 and texts
reused, deduplicated and embedded, rejects.parquet, and manifest.json written last.

A shard is written under a hidden temporary name and renamed when complete, its record (.part-*.parquet.json)
written just before, so a run killed at any moment leaves only temporary files and records without a shard,
removed by the next run. A resume trusts a shard only when its size and sha256 are those recorded: a shard
corrupted, truncated or emptied since (a disk, a copy, a power loss after the rename) is moved aside and its rows
embedded again. Every shard carries the job's identity (the model's files, the input's bytes, columns, prompt,
dtypes) in its Parquet metadata: a resume skips the ids the good shards hold, and another job's folder is refused.
The job holds the folder's lock (guard.py) from before it reads the folder until it ends."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from st_fastbackend import __version__
from st_fastbackend.corpus import CorpusError
from st_fastbackend.corpus.guard import check_free_space, check_writable, write_file
from st_fastbackend.corpus.read import InputScan, sha256_of_file

METADATA_KEY = b"st_fastbackend"
MANIFEST = "manifest.json"
REJECTS = "rejects.parquet"
OUTPUT_DTYPES = {"float32": np.float32, "float16": np.float16}
NO_RECORD = "no size and sha256 were recorded for it"
CHANGED = {"model_identity": "the model's files changed", "input_fingerprint": "the input's content changed"}


@dataclass(frozen=True)
class JobSpec:
    """What makes two runs the same job, everything the rows depend on: a rerun must match it to add to a folder."""

    model: str  # a local folder's absolute path, or a Hub id as given
    model_identity: str  # corpus_identity.model_identity: the weights, config, tokenizer, pooling
    input_fingerprint: str  # every input file's name and bytes
    id_column: str
    text_column: str
    prompt: str | None
    prompt_name: str | None
    output_dtype: str
    max_seq_length: int | None
    dtype: str | None  # --dtype
    matmul_precision: str | None  # bf16 products give other numbers than fp32 ones
    chunking: dict | None = None  # --chunk-tokens and its options (models/chunking.py), None: one row per text
    quantize: str | None = None  # --quantize (int8 products give other numbers); None for folders from before it


@dataclass(frozen=True)
class SparseRows:
    """A SparseEncoder's rows: row i's active dimensions (ascending, of `dimension`) are
    indices[offsets[i] : offsets[i + 1]], their values beside them."""

    offsets: np.ndarray  # [n + 1]
    indices: np.ndarray  # [active]
    values: np.ndarray  # float32 [active]
    dimension: int


@dataclass(frozen=True)
class MultiVectorRows:
    """A MultiVectorEncoder's rows: row i's token vectors are vectors[offsets[i] : offsets[i + 1]]."""

    offsets: np.ndarray  # [n + 1]
    vectors: np.ndarray  # float32 [tokens, dimension]


def dense_columns(rows: np.ndarray, dtype: type) -> tuple[dict[str, pa.Array], int]:
    """`embedding`: a fixed-size list of `dimension` values per row."""
    values = pa.array(rows.astype(dtype).reshape(-1))
    return {"embedding": pa.FixedSizeListArray.from_arrays(values, rows.shape[1])}, rows.shape[1]


def sparse_columns(rows: SparseRows, dtype: type) -> tuple[dict[str, pa.Array], int]:
    """`indices` (int32) and `values`: a list per row, of the same length."""
    offsets = pa.array(rows.offsets, pa.int32())  # an overflow (2**31 values in a shard) is an error, not a wrap
    indices = pa.ListArray.from_arrays(offsets, pa.array(rows.indices, pa.int32()))
    values = pa.ListArray.from_arrays(offsets, pa.array(rows.values.astype(dtype)))
    return {"indices": indices, "values": values}, rows.dimension


def multi_vector_columns(rows: MultiVectorRows, dtype: type) -> tuple[dict[str, pa.Array], int]:
    """`embedding`: per row a list of its token vectors, each a fixed-size list of `dimension` values."""
    dimension = rows.vectors.shape[1]
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(rows.vectors.astype(dtype).reshape(-1)), dimension)
    return {"embedding": pa.ListArray.from_arrays(pa.array(rows.offsets, pa.int32()), vectors)}, dimension


@dataclass(frozen=True)
class OutputKind:
    """What a model class's rows become in a shard."""

    name: str  # the metadata's and manifest's "kind"; a dense folder does not say it (as before the other kinds)
    columns: tuple[str, ...]
    write: Callable[[Any, type], tuple[dict[str, pa.Array], int]]  # (rows, output dtype) -> (columns, dimension)


DENSE = OutputKind("dense", ("embedding",), dense_columns)
# The model classes the job takes, by the name config_sentence_transformers.json gives them.
OUTPUT_KINDS = {
    "SentenceTransformer": DENSE,
    "SparseEncoder": OutputKind("sparse", ("indices", "values"), sparse_columns),
    "MultiVectorEncoder": OutputKind("multi_vector", ("embedding",), multi_vector_columns),
}


@dataclass(frozen=True)
class HybridRows:
    """A HybridEncoder's rows (BGE-M3): those of the outputs asked for, the others None."""

    dense: np.ndarray | None
    sparse: SparseRows | None
    multi_vector: MultiVectorRows | None


HYBRID_COLUMNS = {"dense": ("embedding",), "sparse": ("indices", "values"), "multi_vector": ("multi_vector",)}


def hybrid_kind(outputs: tuple[str, ...]) -> OutputKind:
    """The columns of the outputs asked for, in one row per document: `embedding` (dense), `indices` and `values`
    (lexical weights), `multi_vector` (ColBERT vectors); the dimension recorded is the dense one, else ColBERT's."""

    def write(rows: HybridRows, dtype: type) -> tuple[dict[str, pa.Array], int]:
        columns, dimensions = {}, []
        if rows.dense is not None:
            found, dimension = dense_columns(rows.dense, dtype)
            columns.update(found)
            dimensions.append(dimension)
        if rows.sparse is not None:
            columns.update(sparse_columns(rows.sparse, dtype)[0])
        if rows.multi_vector is not None:
            found, dimension = multi_vector_columns(rows.multi_vector, dtype)
            columns["multi_vector"] = found["embedding"]
            dimensions.append(dimension)
        return columns, dimensions[0] if dimensions else rows.sparse.dimension

    return OutputKind("hybrid", tuple(c for name in outputs for c in HYBRID_COLUMNS[name]), write)


def texts_counts(shards: list[dict]) -> dict:
    """The input rows the shards hold: copied from an earlier output, repeated in the same run, embedded (a shard
    written without these counts, by --ray or before them, embedded all of its rows)."""
    return {name: sum(shard.get(name, shard["rows"] if name == "embedded" else 0) for shard in shards)
            for name in ("reused", "deduplicated", "embedded")}  # fmt: skip


def model_name(model: str) -> str:
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_dir() else model


def new_run_name() -> str:
    """Unique per run, so a rerun's shard names never meet an earlier run's."""
    return f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"


class OutputFolder:
    def __init__(self, path: str | Path, spec: JobSpec, kind: OutputKind = DENSE) -> None:
        self.path, self.spec, self.kind = Path(path), spec, kind
        self.untrusted: list[str] = []  # what prepare() found bad and moved aside, one line each

    def shards(self) -> list[Path]:
        return sorted(self.path.glob("part-*.parquet"))

    def record(self, shard: Path) -> Path:
        return shard.with_name(f".{shard.name}.json")

    def prepare(self, rows: int, width: int | None) -> pa.Array | None:
        """With the folder's lock held: drop a killed run's temporary files, check the folder takes files, refuse
        another job's folder, move aside the shards that cannot be trusted, check there is room for the `rows`
        (the input's, less rejects) the good shards do not hold at `width` values each. Those shards' ids (None:
        none)."""
        for leftover in [*self.path.glob(".*.tmp"), *self._records_without_shard()]:
            leftover.unlink()
        check_writable(self.path)
        self._check_manifest()
        verdicts = [(shard, self.verify(shard)) for shard in self.shards()]
        for shard, why in verdicts:  # refuse another job's folder before moving anything
            if why is None or why == NO_RECORD:
                self._check_same_job(shard)
        bad = [(shard, why) for shard, why in verdicts if why is not None]
        for shard, why in bad:
            aside = self._move_aside(shard)
            self.untrusted.append(f"{shard} cannot be trusted ({why}): moved to {aside}, its rows are embedded again")
        if bad and (self.path / MANIFEST).exists():
            (self.path / MANIFEST).unlink()  # the job is not complete until those rows are embedded again
        done = [self._ids(shard) for shard, why in verdicts if why is None]
        done = pa.concat_arrays([chunk for column in done for chunk in column.chunks]) if done else None
        if done is not None and self.spec.chunking and self.spec.chunking.get("aggregate") is None:
            done = pc.unique(done)  # one row per chunk: a document's id on each of its rows
        check_free_space(self.path, rows - (0 if done is None else len(done)), width, self.spec.output_dtype)
        return done

    def _records_without_shard(self) -> list[Path]:
        """Records of shards a killed run did not rename into place."""
        records = self.path.glob(".part-*.parquet.json")
        return [record for record in records if not (self.path / record.name[1 : -len(".json")]).exists()]

    def verify(self, shard: Path) -> str | None:
        """Why `shard` cannot be trusted, or None: its size and sha256 are the ones recorded when it was written."""
        try:
            record = json.loads(self.record(shard).read_text())
            size, sha256 = record["bytes"], record["sha256"]
        except FileNotFoundError:
            return NO_RECORD
        except (OSError, ValueError, KeyError, TypeError) as error:
            return f"its record {self.record(shard).name} is unreadable: {type(error).__name__}"
        if shard.stat().st_size != size:
            return f"{shard.stat().st_size} bytes, {size} were written"
        if sha256_of_file(shard) != sha256:
            return "its sha256 is not the one recorded when it was written"
        return None

    def _move_aside(self, path: Path) -> str:
        """Kept for a look, under a name no run reads; its record goes."""
        aside = path.with_name(f".{path.name}.bad")
        os.replace(path, aside)
        self.record(path).unlink(missing_ok=True)
        return aside.name

    def _ids(self, shard: Path) -> pa.ChunkedArray:
        try:
            return pq.read_table(shard, columns=[self.spec.id_column]).column(0)
        except (pa.ArrowException, OSError) as error:  # its bytes are those written: a shard this job cannot read
            raise CorpusError(f"cannot read {shard}: {str(error).strip().splitlines()[0]}") from error

    def _check_manifest(self) -> None:
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            return
        try:
            recorded = json.loads(manifest.read_text())["job"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            aside = self._move_aside(manifest)
            self.untrusted.append(f"{manifest} is unreadable ({type(error).__name__}): moved to {aside}, rewritten")
            return
        self._refuse_if_different(recorded, MANIFEST)

    def _check_same_job(self, shard: Path) -> None:
        try:
            metadata = pq.read_schema(shard).metadata or {}
        except (pa.ArrowException, OSError):
            return  # unreadable: not trusted (it has no record), moved aside
        if METADATA_KEY not in metadata:
            raise CorpusError(f"{shard} was not written by st-fastbackend embed-corpus: use an empty output folder")
        try:
            recorded = json.loads(metadata[METADATA_KEY])["job"]
        except (ValueError, KeyError, TypeError):
            return  # damaged metadata of a shard without a record: moved aside
        self._refuse_if_different(recorded, shard.name)

    def _refuse_if_different(self, recorded: dict, where: str) -> None:
        ours = asdict(self.spec)
        differs = [key for key in ours if recorded.get(key) != ours[key]]
        if differs:
            what = "; ".join(f"{key} {recorded.get(key)!r} there, {ours[key]!r} now" + (
                f" ({CHANGED[key]})" if key in CHANGED else "") for key in differs)  # fmt: skip
            raise CorpusError(
                f"{self.path} holds the output of another job ({where}: {what}): resume it with the same model, "
                f"input and options, or start over in an empty folder (remove {self.path}, or write to another one)"
            )

    def rows_table(self, rows, columns: dict | None = None) -> tuple[pa.Table, int]:
        """The kind's rows (and `columns` before them) as a table, and their dimension."""
        written, dimension = self.kind.write(rows, OUTPUT_DTYPES[self.spec.output_dtype])
        return pa.table({**(columns or {}), **written}), dimension

    def write_table(self, name: str, table: pa.Table, dimension: int, counts: dict | None = None) -> None:
        """A shard's table as one complete file, its size, sha256 and `counts` (reuse.py's, of its texts) recorded
        beside it first."""
        sink = pa.BufferOutputStream()
        pq.write_table(table.replace_schema_metadata(self.metadata(dimension)), sink)
        data = sink.getvalue()
        record = {"rows": len(table), "bytes": data.size, "sha256": hashlib.sha256(data).hexdigest(), **(counts or {})}
        write_file(self.record(self.path / name), json.dumps(record).encode() + b"\n")
        write_file(self.path / name, data)

    def metadata(self, dimension: int) -> dict[bytes, bytes]:
        record = {"job": asdict(self.spec), "dimension": dimension, **self._kind(), "st_fastbackend": __version__}
        return {METADATA_KEY: json.dumps(record).encode(), b"st_fastbackend.model": self.spec.model.encode()}

    def _kind(self) -> dict:
        """What the metadata and the manifest say of the rows' kind: nothing for dense rows (`embedding`, as
        written before there were other kinds), else the kind and its columns."""
        return {} if self.kind == DENSE else {"kind": self.kind.name, "columns": list(self.kind.columns)}

    def finish(self, scan: InputScan, dimension: int, prompt: str | None) -> dict:
        """rejects.parquet (if any), then the manifest, last: the job is complete."""
        if scan.rejects is not None:
            sink = pa.BufferOutputStream()
            pq.write_table(scan.rejects, sink)
            write_file(self.path / REJECTS, sink.getvalue())
        elif (self.path / REJECTS).exists():
            (self.path / REJECTS).unlink()
        shards = [{"name": shard.name, **json.loads(self.record(shard).read_text())} for shard in self.shards()]
        rejected = 0 if scan.rejects is None else scan.rejects.num_rows
        manifest = {
            "model": self.spec.model, "dimension": dimension, **self._kind(), "dtype": self.spec.output_dtype,
            "id_column": self.spec.id_column, "prompt": prompt,
            "rows": {"input": scan.rows, "embedded": sum(shard["rows"] for shard in shards), "rejected": rejected},
            "input": {"files": [str(path) for path in scan.files], "fingerprint": scan.fingerprint},
            "texts": texts_counts(shards), "shards": shards, "job": asdict(self.spec), "st_fastbackend": __version__,
        }  # fmt: skip
        write_file(self.path / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
        return manifest
