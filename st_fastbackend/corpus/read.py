"""The corpus job's input: parquet files, a folder of them, JSON Lines or CSV, read through pyarrow a record batch
at a time (never the whole corpus in memory), as two columns, the id and the text. One scan before any
embedding counts the rows, finds the rows that cannot be embedded (a null id or text, a text that is not a string,
an id given to several rows: ids.py) and hashes every file's bytes, so a bad row stops the job before anything
is written and a resume knows the input is the one its shards were embedded from."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from st_fastbackend.corpus import CorpusError
from st_fastbackend.corpus.ids import repeated_ids

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".ndjson": "json", ".json": "json", ".csv": "csv"}
BATCH_ROWS = 8192
HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class Columns:
    id: str
    text: str


@dataclass(frozen=True)
class InputScan:
    files: tuple[Path, ...]
    rows: int
    rejects: pa.Table | None  # the id column, file, row (within its file), reason; None: no rejects
    python_json: frozenset[Path]  # JSON Lines files pyarrow refuses (a text of another type): read with json
    fingerprint: str  # of every file's name and bytes
    repeated: pa.Array | None  # ids given to more than one row (all those rows are rejects); None: none


def input_files(source: str) -> tuple[Path, ...]:
    """A file, or a folder's files of one format (sorted by name); CorpusError for anything else."""
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in FORMATS)
        if not files:
            raise CorpusError(f"input folder {source} holds no {', '.join(FORMATS)} files")
        if len({FORMATS[p.suffix] for p in files}) > 1:
            raise CorpusError(f"input folder {source} mixes formats: give one format per folder")
        return tuple(files)
    if not path.is_file():
        raise CorpusError(f"input {source} does not exist")
    if path.suffix not in FORMATS:
        raise CorpusError(f"input {source}: the extension chooses the format, one of {', '.join(FORMATS)}")
    return (path,)


def read_batches(path: Path, columns: Columns, python_json: bool = False) -> Iterator[pa.RecordBatch]:
    """The file's id and text columns a record batch at a time."""
    kind = FORMATS[path.suffix]
    if kind == "parquet":
        yield from _parquet_batches(path, columns)
    elif kind == "csv":
        yield from _csv_batches(path, columns)
    elif python_json:
        yield from _python_json_batches(path, columns)
    else:
        import pyarrow.json

        for batch in pyarrow.json.open_json(path):
            yield _select(batch, columns, path)


def _parquet_batches(path: Path, columns: Columns) -> Iterator[pa.RecordBatch]:
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    _check_columns(file.schema_arrow.names, columns, path)
    yield from file.iter_batches(batch_size=BATCH_ROWS, columns=[columns.id, columns.text])


def _csv_batches(path: Path, columns: Columns) -> Iterator[pa.RecordBatch]:
    import pyarrow.csv as csv

    # A CSV cell has no type of its own: the text column is read as a string even where it looks like a number.
    convert = csv.ConvertOptions(column_types={columns.text: pa.string()})
    for batch in csv.open_csv(path, convert_options=convert):
        yield _select(batch, columns, path)


def _python_json_batches(path: Path, columns: Columns) -> Iterator[pa.RecordBatch]:
    """pyarrow's reader stops at a column whose type changes (a number among texts); json keeps going, and a
    text that is not a string becomes null (the scan has rejected it already)."""
    ids, texts = [], []
    with open(path, encoding="utf8") as lines:
        for line in lines:
            if line.strip():
                row = json.loads(line)
                ids.append(row.get(columns.id))
                text = row.get(columns.text)
                texts.append(text if isinstance(text, str) else None)
            if len(ids) == BATCH_ROWS:
                yield pa.RecordBatch.from_pydict({columns.id: ids, columns.text: pa.array(texts, pa.string())})
                ids, texts = [], []
    if ids:
        yield pa.RecordBatch.from_pydict({columns.id: ids, columns.text: pa.array(texts, pa.string())})


def _select(batch: pa.RecordBatch, columns: Columns, path: Path) -> pa.RecordBatch:
    _check_columns(batch.schema.names, columns, path)
    return batch.select([columns.id, columns.text])


def _check_columns(names: list[str], columns: Columns, path: Path) -> None:
    for option, name in (("--id-column", columns.id), ("--text-column", columns.text)):
        if name not in names:
            raise CorpusError(f"{path} has no column {name!r} ({option}); its columns: {', '.join(names)}")


def invalid_rows(batch: pa.RecordBatch | pa.Table, text_column: str) -> tuple[pa.BooleanArray, str]:
    """Which rows cannot be embedded, and why."""
    texts = batch.column(text_column)
    if not is_string(texts.type):
        return pa.array([True] * len(texts)), f"its text is {texts.type}, not a string"
    return pc.is_null(texts), "its text is null"


def still_to_embed(batch: pa.RecordBatch | pa.Table, columns: Columns, skip: pa.Array | None):
    """The rows of `batch` with an id and a text to embed whose id is not in `skip` (ids_to_skip)."""
    keep = pc.and_(pc.invert(invalid_rows(batch, columns.text)[0]), pc.is_valid(batch.column(columns.id)))
    if skip is not None:
        keep = pc.and_(keep, pc.invert(pc.is_in(batch.column(columns.id), value_set=skip)))
    return batch.filter(keep)


def ids_to_skip(scan: InputScan, done: pa.Array | None) -> pa.Array | None:
    """The ids no row of this run embeds: those a complete shard holds, and those given to several rows."""
    if done is None or scan.repeated is None:
        return scan.repeated if done is None else done
    return pa.concat_arrays([done, scan.repeated.cast(done.type)])


def in_shards(batches: Iterator[pa.RecordBatch], shard_rows: int) -> Iterator[pa.Table]:
    """Record batches regrouped into tables of `shard_rows` rows (the last one shorter)."""
    held, count = [], 0
    for batch in batches:
        while len(batch):
            taken = batch.slice(0, shard_rows - count)
            held.append(taken)
            count += len(taken)
            batch = batch.slice(len(taken))
            if count == shard_rows:
                yield _table(held)
                held, count = [], 0
    if held:
        yield _table(held)


def _table(batches: list[pa.RecordBatch]) -> pa.Table:
    """One table of batches from several files, whose types may differ (string and large_string, say)."""
    tables = [pa.Table.from_batches([batch]) for batch in batches]
    return pa.concat_tables(tables, promote_options="permissive")


def is_string(type_: pa.DataType) -> bool:
    return pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_string_view(type_)


def scan_input(files: tuple[Path, ...], columns: Columns, stop_at_invalid: bool,
               stop_at_repeated: bool = True) -> InputScan:  # fmt: skip
    """Rows, rejects and a hash of every file's bytes; CorpusError at the first bad row with `stop_at_invalid`, at
    an id given to several rows with `stop_at_repeated`."""

    rows, rejects, python_json, ids, digest = 0, [], set(), [], hashlib.sha256()
    for path in files:
        found, count, file_ids, sha256 = _scan_readable(path, columns, stop_at_invalid, python_json)
        rows += count
        rejects += found
        ids.append(file_ids)
        digest.update(f"{path.name}\0{count}\0{sha256}\0".encode())
    repeated, found = repeated_ids(files, ids, columns.id, stop_at_repeated, rejects)
    table = pa.concat_tables(rejects + found, promote_options="permissive") if rejects or found else None
    table = None if table is None else table.sort_by([("file", "ascending"), ("row", "ascending")])
    return InputScan(files, rows, table, frozenset(python_json), digest.hexdigest()[:32], repeated)


def _scan_readable(path: Path, columns: Columns, stop: bool, python_json: set[Path]):
    """_scan_file's rejects, rows and ids, and the file's sha256; a JSON Lines file pyarrow refuses is read again
    with json (and added to `python_json`). A file that cannot be read is a CorpusError naming it."""
    try:
        try:
            found, rows, ids = _scan_file(path, columns, stop, python_json=False)
        except pa.ArrowInvalid as error:
            if FORMATS[path.suffix] != "json" or "changed from" not in str(error):
                raise
            python_json.add(path)
            found, rows, ids = _scan_file(path, columns, stop, python_json=True)
        return found, rows, ids, sha256_of_file(path)
    except (pa.ArrowException, OSError, ValueError) as error:  # ValueError: not UTF-8, not JSON
        raise CorpusError(f"cannot read {path}: {str(error).strip().splitlines()[0]}") from error


def _scan_file(path: Path, columns: Columns, stop: bool, python_json: bool):
    """The file's rejects (a null id, or a text that cannot be embedded), rows, and id columns."""
    found, row, ids = [], 0, []
    for batch in read_batches(path, columns, python_json):
        text_bad, text_reason = invalid_rows(batch, columns.text)
        text_reason = "its text is null or not a string" if python_json else text_reason
        id_bad = pc.is_null(batch.column(columns.id))
        bad = pc.or_(id_bad, text_bad)
        if stop and pc.any(bad).as_py():
            first = pc.index(bad, True).as_py()
            raise CorpusError(
                f"row {columns.id}={batch.column(columns.id)[first].as_py()!r} of {path} (row {row + first}): "
                f"{'its id is null' if id_bad[first].as_py() else text_reason}; "
                "fix it, or pass --skip-invalid to list such rows in rejects.parquet"
            )
        for mask, reason in ((id_bad, "its id is null"), (pc.and_(text_bad, pc.invert(id_bad)), text_reason)):
            if pc.any(mask).as_py():
                found.append(_rejects(batch, columns.id, path, row, mask, reason))
        ids.append(batch.column(columns.id))
        row += len(batch)
    return found, row, ids


def _rejects(batch, id_column: str, path: Path, first_row: int, mask: pa.BooleanArray, reason: str) -> pa.Table:
    bad = pc.indices_nonzero(mask)
    where = {"file": pa.array([str(path)] * len(bad)), "row": pc.add(bad.cast(pa.int64()), first_row)}
    return pa.table({id_column: batch.column(id_column).take(bad), **where, "reason": pa.array([reason] * len(bad))})


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
