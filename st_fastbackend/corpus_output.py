"""The corpus job's output folder: parquet shards (the id column and `embedding`), rejects.parquet, and
manifest.json written last.

A shard is written under a hidden temporary name and renamed when complete, so a file named part-*.parquet is
always whole; a run killed at any moment leaves only temporary files, removed by the next run. Every shard
carries the job's identity (model, input fingerprint, columns, prompt, dtype) in its Parquet metadata: a rerun
skips the ids the complete shards hold, and a rerun of another job into the same folder is refused."""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from st_fastbackend import __version__
from st_fastbackend.corpus_io import CorpusError, InputScan

METADATA_KEY = b"st_fastbackend"
MANIFEST = "manifest.json"
REJECTS = "rejects.parquet"
OUTPUT_DTYPES = {"float32": np.float32, "float16": np.float16}


@dataclass(frozen=True)
class JobSpec:
    """What makes two runs the same job: a rerun must match it to add to a folder."""

    model: str  # a local folder's absolute path, or a Hub id as given
    input_fingerprint: str
    id_column: str
    text_column: str
    prompt: str | None
    prompt_name: str | None
    output_dtype: str
    max_seq_length: int | None


def model_name(model: str) -> str:
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_dir() else model


def new_run_name() -> str:
    """Unique per run, so a rerun's shard names never meet an earlier run's."""
    return f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"


class OutputFolder:
    def __init__(self, path: str | Path, spec: JobSpec) -> None:
        self.path, self.spec = Path(path), spec

    def shards(self) -> list[Path]:
        return sorted(self.path.glob("part-*.parquet"))

    def prepare(self) -> pa.Array | None:
        """Create the folder, drop the temporary files of a killed run, refuse another job's folder; the ids
        the complete shards already hold (None: none)."""
        if self.path.exists() and not self.path.is_dir():
            raise CorpusError(f"output {self.path} is a file, not a folder")
        self.path.mkdir(parents=True, exist_ok=True)
        for temporary in self.path.glob(".*.tmp"):
            temporary.unlink()
        self._check_manifest()
        done = []
        for shard in self.shards():
            self._check_same_job(shard, pq.read_schema(shard).metadata or {})
            done.append(pq.read_table(shard, columns=[self.spec.id_column]).column(0))
        return pa.concat_arrays([chunk for column in done for chunk in column.chunks]) if done else None

    def _check_manifest(self) -> None:
        manifest = self.path / MANIFEST
        if manifest.is_file():
            recorded = json.loads(manifest.read_text()).get("job", {})
            self._refuse_if_different(recorded, MANIFEST)

    def _check_same_job(self, shard: Path, metadata: dict) -> None:
        if METADATA_KEY not in metadata:
            raise CorpusError(f"{shard} was not written by st-fastbackend embed-corpus: use an empty output folder")
        self._refuse_if_different(json.loads(metadata[METADATA_KEY])["job"], shard.name)

    def _refuse_if_different(self, recorded: dict, where: str) -> None:
        ours = asdict(self.spec)
        differs = [key for key in ours if recorded.get(key) != ours[key]]
        if differs:
            what = "; ".join(f"{key} {recorded.get(key)!r} there, {ours[key]!r} now" for key in differs)
            raise CorpusError(
                f"{self.path} holds the output of another job ({where}: {what}): resume it with the same "
                "model, input and options, or write to another folder"
            )

    def write_shard(self, name: str, ids: pa.Array, rows: np.ndarray) -> None:
        """ids and their embeddings [n, dim] as one complete file: written under a temporary name, then renamed."""
        values = pa.array(rows.astype(OUTPUT_DTYPES[self.spec.output_dtype]).reshape(-1))
        embedding = pa.FixedSizeListArray.from_arrays(values, rows.shape[1])
        table = pa.table({self.spec.id_column: ids, "embedding": embedding})
        self.write_atomically(table.replace_schema_metadata(self.metadata(rows.shape[1])), name)

    def write_atomically(self, table: pa.Table, name: str) -> None:
        temporary = self.path / f".{name}.tmp"
        pq.write_table(table, temporary)
        os.replace(temporary, self.path / name)

    def metadata(self, dimension: int) -> dict[bytes, bytes]:
        record = {"job": asdict(self.spec), "dimension": dimension, "st_fastbackend": __version__}
        return {METADATA_KEY: json.dumps(record).encode(), b"st_fastbackend.model": self.spec.model.encode()}

    def finish(self, scan: InputScan, dimension: int, prompt: str | None) -> dict:
        """rejects.parquet (if any), then the manifest, last: the job is complete."""
        if scan.rejects is not None:
            self.write_atomically(scan.rejects, REJECTS)
        elif (self.path / REJECTS).exists():
            (self.path / REJECTS).unlink()
        shards = self.shards()
        embedded = sum(pq.read_metadata(shard).num_rows for shard in shards)
        rejected = 0 if scan.rejects is None else scan.rejects.num_rows
        manifest = {
            "model": self.spec.model, "dimension": dimension, "dtype": self.spec.output_dtype,
            "id_column": self.spec.id_column, "prompt": prompt,
            "rows": {"input": scan.rows, "embedded": embedded, "rejected": rejected},
            "input": {"files": [str(path) for path in scan.files], "fingerprint": scan.fingerprint},
            "shards": [shard.name for shard in shards], "job": asdict(self.spec), "st_fastbackend": __version__,
        }  # fmt: skip
        temporary = self.path / f".{MANIFEST}.tmp"
        temporary.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(temporary, self.path / MANIFEST)
        return manifest
