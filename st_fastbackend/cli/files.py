"""The command line's files: texts in (UTF-8, one per line), embeddings out (.npy, .parquet or .jsonl, chosen by
the extension). Checked before the model loads, so a mistake costs no waiting."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

OUTPUT_FORMATS = (".npy", ".parquet", ".jsonl")


class CliError(Exception):
    """A mistake the user can fix: one line on stderr and exit status 2, no traceback (unless --debug)."""


def read_texts(source: str) -> list[str]:
    """One text per line; an empty line is an empty text."""
    try:
        data = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except FileNotFoundError:
        raise CliError(f"input file {source} does not exist") from None
    except IsADirectoryError:
        raise CliError(f"input {source} is a directory, not a text file") from None
    try:
        return data.decode("utf8").splitlines()
    except UnicodeDecodeError as error:
        name = "stdin" if source == "-" else source
        raise CliError(f"{name} is not UTF-8 text (byte {data[error.start]:#04x} at offset {error.start})") from None


def check_output(path: str) -> None:
    output = Path(path)
    if output.suffix not in OUTPUT_FORMATS:
        raise CliError(f"--output {path}: the extension chooses the format, one of {', '.join(OUTPUT_FORMATS)}")
    if not output.parent.is_dir():
        raise CliError(f"--output {path}: directory {output.parent} does not exist")
    if output.suffix == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        raise CliError("--output .parquet needs pyarrow: pip install pyarrow")


def write_embeddings(path: str, embeddings) -> None:
    """[N, dim] as .npy, as .parquet (one fixed-size list column `embedding`), or as .jsonl
    ({"embedding": [...]} a line); float32, or the integer type --precision gave."""
    suffix = Path(path).suffix
    if suffix == ".npy":
        import numpy as np

        np.save(path, embeddings)  # the name ends in .npy, so np.save adds nothing to it
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        values = pa.array(embeddings.reshape(-1))
        column = pa.FixedSizeListArray.from_arrays(values, embeddings.shape[1])
        pq.write_table(pa.table({"embedding": column}), path)
    else:
        with open(path, "w", encoding="utf8") as out:
            for row in embeddings.tolist():
                out.write(json.dumps({"embedding": row}) + "\n")
