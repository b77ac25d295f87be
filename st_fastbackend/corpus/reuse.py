"""Rows the corpus job does not embed again: those of a text met earlier in the same run or a killed run of the
same job (written once per row that holds it, each row with its own id), and those of an earlier output of the
same model and options (--reuse), copied bit for bit.

Every row carries a content key (KEY): the first 16 bytes of the sha256 of the job's numbers identity (the model's
files and every option that changes numbers: numbers_identity) and the text as the job read it. A chunk row
carries its document's key: a document's chunks, their spans and (late chunking) their numbers all follow from
its whole text and the chunking options, and are embedded, written and reused together, told apart by `chunk`.

An earlier output is trusted as a resume trusts a folder (its manifest, every shard's size and sha256) and must
say it was embedded with the same numbers identity; otherwise it is refused by name, never ignored. Where each
key's rows are is held in memory (RowIndex: about 150 bytes per distinct text)."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from st_fastbackend.corpus import CorpusError
from st_fastbackend.corpus.output import MANIFEST, JobSpec, OutputFolder
from st_fastbackend.modules.tokenizer import NoTokensError

KEY = "content_key"
KEY_TYPE = pa.binary(16)
NOT_NUMBERS = ("model", "input_fingerprint", "id_column", "text_column")  # where the texts come from, not their rows
CHUNK_COLUMNS = ("chunk", "char_start", "char_end")
SHARDS_HELD = 4  # shards read back and kept for copying rows (each up to --shard-rows rows)


def numbers_identity(spec: JobSpec) -> dict:
    """Everything a text's rows depend on besides the text: the model's files, the prompt, dtypes and products,
    max_seq_length, chunking, output precision."""
    return {name: value for name, value in asdict(spec).items() if name not in NOT_NUMBERS}


def content_keys(texts: list[str], identity: dict) -> list[bytes]:
    seed = hashlib.sha256(json.dumps(identity, sort_keys=True).encode() + b"\0")
    keys = []
    for text in texts:
        digest = seed.copy()
        digest.update(text.encode())
        keys.append(digest.digest()[:16])
    return keys


def row_columns(folder: OutputFolder) -> list[str]:
    """A shard's columns but the id, in the order they are written."""
    chunked = folder.spec.chunking is not None and folder.spec.chunking.get("aggregate") is None
    return [KEY, *(CHUNK_COLUMNS if chunked else ()), *folder.kind.columns]


@dataclass
class Counts:
    """Texts of a shard or a run: copied from elsewhere, repeated in this run, embedded."""

    reused: int = 0
    deduplicated: int = 0
    embedded: int = 0


class Place(NamedTuple):
    shard: Path
    start: int  # its first row
    count: int  # its rows (chunks)
    earlier: bool  # in an earlier output (--reuse), not this job's


class RowIndex:
    """Where the rows of each content key are, the first place found kept."""

    def __init__(self, columns: list[str]) -> None:
        self.columns, self.places = columns, {}
        self.held: OrderedDict[Path, pa.Table] = OrderedDict()

    def add_shard(self, shard: Path, earlier: bool = False) -> bool:
        """The keys of a shard whose integrity is checked (`earlier`: of a --reuse output); False: it has no key
        column (written before them)."""
        schema = pq.read_schema(shard)
        if KEY not in schema.names:
            return False
        table = pq.read_table(shard, columns=[KEY] + (["chunk"] if "chunk" in schema.names else []))
        keys = table.column(KEY).to_pylist()
        # A document's chunks are consecutive rows, its first one chunk 0.
        starts = np.flatnonzero(table.column("chunk").to_numpy() == 0) if "chunk" in schema.names else np.arange(
            len(keys))  # fmt: skip
        ends = np.append(starts[1:], len(keys))
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            self.places.setdefault(keys[start], Place(shard, start, end - start, earlier))
        return True

    def add_output(self, path: Path, folder: OutputFolder) -> None:
        """A complete earlier output of the same numbers identity, checked; CorpusError naming it otherwise."""
        for shard in trusted_shards(path, folder):
            if not self.add_shard(shard, earlier=True):
                raise CorpusError(f"--reuse {path}: {shard.name} has no {KEY} column (written before content keys): "
                                  "it cannot be reused; embed without it")  # fmt: skip

    def rows(self, shard: Path) -> pa.Table:
        """The shard's rows but the id, read once while among the last SHARDS_HELD used."""
        if shard not in self.held:
            self.held[shard] = pq.read_table(shard, columns=self.columns).replace_schema_metadata(None)
            if len(self.held) > SHARDS_HELD:
                self.held.popitem(last=False)
        self.held.move_to_end(shard)
        return self.held[shard]


def trusted_shards(path: Path, folder: OutputFolder) -> list[Path]:
    """The shards of the complete output at `path` whose manifest records this job's numbers identity, each of the
    size and sha256 recorded when it was written (as a resume checks them); CorpusError naming what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        job, listed = manifest["job"], {shard["name"]: shard for shard in manifest["shards"]}
    except FileNotFoundError:
        raise CorpusError(f"--reuse {path}: no {MANIFEST}, not a complete embed-corpus output") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorpusError(f"--reuse {path}: its {MANIFEST} is unreadable ({type(error).__name__})") from error
    ours = numbers_identity(folder.spec)
    differs = [name for name in ours if job.get(name) != ours[name]]
    if differs:
        what = "; ".join(f"{name} {job.get(name)!r} there, {ours[name]!r} now" for name in differs)
        raise CorpusError(f"--reuse {path} was embedded with another model or other options ({what}): its rows are "
                          "not this job's; reuse an output of the same model and options")  # fmt: skip
    previous = OutputFolder(path, folder.spec, folder.kind)
    shards = previous.shards()
    if sorted(shard.name for shard in shards) != sorted(listed):
        raise CorpusError(f"--reuse {path}: its shards are not those its {MANIFEST} lists")
    for shard in shards:
        why = previous.verify(shard)  # against its record, which the manifest copied
        record = {"name": shard.name, **json.loads(previous.record(shard).read_text())} if why is None else None
        if why is None and listed[shard.name] != record:
            why = f"its record is not the one {MANIFEST} lists"
        if why is not None:
            raise CorpusError(f"--reuse {path}: {shard.name} cannot be trusted ({why}); reuse another output")
    return shards


Embed = Callable[[list[str]], tuple[pa.Table, np.ndarray, int]]


def shard_table(id_column: str, ids: pa.Array, texts: list[str], keys: list[bytes], index: RowIndex,
                embed: Embed) -> tuple[pa.Table, Counts, int]:  # fmt: skip
    """The rows of one input shard in input order (`ids` beside them, one per text), the counts and the tokens
    run. Each key found in `index` is copied, the first of each other key embedded (`embed`: texts ->
    their rows' columns but the key, each row's text number, tokens), and the later ones copy it."""
    sources, new, counts = plan(keys, index)
    pool, tokens = [], 0
    if new:
        try:
            table, text_of_row, tokens = embed([texts[i] for i in new])
        except NoTokensError as error:  # its place among the new texts: the shard's
            raise NoTokensError(new[error.index], error.text) from error
        keys_of_new = pa.array([keys[i] for i in new], KEY_TYPE)
        pool.append(table.add_column(0, KEY, keys_of_new.take(text_of_row)).select(index.columns))
        per_text = np.bincount(text_of_row, minlength=len(new))
        starts = np.cumsum([0, *per_text])
    offsets, take, owner = {}, [], []
    for position, source in enumerate(sources):
        if isinstance(source, int):  # the new text's rows, first in the pool
            start, count = int(starts[source]), int(per_text[source])
        else:
            if source.shard not in offsets:
                offsets[source.shard] = sum(len(table) for table in pool)
                pool.append(index.rows(source.shard))
            start, count = offsets[source.shard] + source.start, source.count
        take.append(np.arange(start, start + count))
        owner.append(np.full(count, position))
    rows = pa.concat_tables(pool).take(np.concatenate(take))
    return rows.add_column(0, id_column, ids.take(np.concatenate(owner))), counts, tokens


def plan(keys: list[bytes], index: RowIndex) -> tuple[list[Place | int], list[int], Counts]:
    """Where each text's rows come from: a Place, or the number of a new text (among this shard's first of each
    key not in `index`); the new texts' positions; the counts."""
    counts, new, first, sources = Counts(), [], {}, []
    for position, key in enumerate(keys):
        if (found := index.places.get(key)) is not None:
            sources.append(found)
            counts.reused += found.earlier
            counts.deduplicated += not found.earlier
        elif key in first:
            sources.append(first[key])
            counts.deduplicated += 1
        else:
            first[key] = len(new)
            sources.append(len(new))
            new.append(position)
    counts.embedded = len(new)
    return sources, new, counts
