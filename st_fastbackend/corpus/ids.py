"""The corpus job's ids, checked on the whole input before the model loads. A row is known in the output by its id
alone, and a resume skips the rows whose ids a complete shard holds: two rows with one id would leave one of them
unembedded, or both under one id, and the folder could not say which text an embedding belongs to. The scan keeps
every id (the id column only, never the texts) to find those given to more than one row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from st_fastbackend.corpus import CorpusError

REPEATED = "its id is given to other rows too"
SHOWN = 3  # rows named in the error for a repeated id


def repeated_ids(files: tuple[Path, ...], ids: list[list[pa.Array]], id_column: str, stop: bool,
                 rejects: list[pa.Table]) -> tuple[pa.Array | None, list[pa.Table]]:  # fmt: skip
    """The ids given to more than one row (None: none) and a reject for every such row not in `rejects` already
    (every one of them: which text an id was meant for cannot be told); with `stop`, CorpusError naming the first
    repeated id's rows. `ids`: each file's id columns, in order."""
    every = _one_type(files, ids, id_column)
    if every is None:
        return None, []
    counts = pc.value_counts(every.drop_null())
    repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    if not len(repeated):
        return None, []
    starts = np.cumsum([0] + [sum(len(chunk) for chunk in chunks) for chunks in ids])
    if stop:
        raise CorpusError(_refusal(files, every, starts, repeated, id_column))
    rows = np.asarray(pc.indices_nonzero(pc.is_in(every, value_set=repeated)), np.int64)  # numbered input-wide
    rows = rows[~np.isin(rows, _rejected_rows(files, starts, rejects))]
    file_of = np.searchsorted(starts, rows, side="right") - 1
    table = pa.table({
        id_column: every.take(rows), "file": pa.array([str(files[index]) for index in file_of], pa.string()),
        "row": pa.array(rows - starts[file_of], pa.int64()), "reason": pa.array([REPEATED] * len(rows), pa.string()),
    })  # fmt: skip
    return repeated, [table]


def _one_type(files: tuple[Path, ...], ids: list[list[pa.Array]], id_column: str) -> pa.ChunkedArray | None:
    """Every id as one column (string and large_string, int32 and int64 agree); CorpusError naming a file whose
    ids are of another type (the output's id column has one). None: no rows."""
    chunks = [(path, chunk) for path, file_ids in zip(files, ids, strict=True) for chunk in file_ids if len(chunk)]
    if not chunks:
        return None
    try:
        schemas = [pa.schema([(id_column, chunk.type)]) for _, chunk in chunks]
        common = pa.unify_schemas(schemas, promote_options="permissive").field(0).type
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        first, chunk = chunks[0]
        path, other = next((path, other) for path, other in chunks if other.type != chunk.type)
        raise CorpusError(
            f"the ids of {path} are {other.type}, those of {first} {chunk.type}: give every row an id of one type"
        ) from None
    return pa.chunked_array([chunk.cast(common) for _, chunk in chunks], type=common)


def _refusal(files, every: pa.ChunkedArray, starts: np.ndarray, repeated: pa.Array, id_column: str) -> str:
    first = every[pc.indices_nonzero(pc.is_in(every, value_set=repeated))[0].as_py()]  # in input order
    rows = np.asarray(pc.indices_nonzero(pc.equal(every, first)), np.int64)
    file_of = np.searchsorted(starts, rows, side="right") - 1
    places = ", ".join(
        f"{files[f]} row {row - starts[f]}" for f, row in zip(file_of[:SHOWN], rows[:SHOWN], strict=True)
    )
    places += f" and {len(rows) - SHOWN} more" if len(rows) > SHOWN else ""
    others = f"; {len(repeated) - 1} other ids are given to several rows too" if len(repeated) > 1 else ""
    return (
        f"{id_column} {first.as_py()!r} is given to {len(rows)} rows ({places}){others}: a row is known by its id, "
        "so each needs its own; fix the input, or pass --skip-duplicate-ids to list every such row in "
        "rejects.parquet, none of them embedded"
    )


def _rejected_rows(files: tuple[Path, ...], starts: np.ndarray, rejects: list[pa.Table]) -> np.ndarray:
    """The input-wide numbers of the rows `rejects` holds already (a row with a repeated id and a null text)."""
    index = {str(path): i for i, path in enumerate(files)}
    found = [starts[[index[name] for name in table.column("file").to_pylist()]] + table.column("row").to_numpy()
             for table in rejects]  # fmt: skip
    return np.concatenate(found) if found else np.zeros(0, np.int64)
