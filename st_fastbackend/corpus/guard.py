"""What the corpus job makes sure of in its output folder before the model loads, and keeps while it runs: it is
the only job writing there, it can create files there, there is room for the embeddings, and a write that fails
(a full disk) is one line naming the file."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from st_fastbackend.corpus import CorpusError

LOCK = ".embed-corpus.lock"
ITEM_BYTES = {"float32": 4, "float16": 2}
MIN_FREE = 1 << 20  # the least room asked for when the embeddings' width is not known (a Hub id)


@contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """The folder (created if need be) held for this process alone until the block ends: an exclusive flock on its
    lock file, which the OS drops when the process dies (SIGKILL included), so a killed job never blocks a resume.
    Another job's lock is a CorpusError naming the folder and the holder's pid (written in the lock file)."""
    if folder.exists() and not folder.is_dir():
        raise CorpusError(f"output {folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise CorpusError(f"cannot write to output folder {folder}: {_about(error, folder / LOCK)}") from error
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(handle, 32, 0).decode(errors="replace").strip() or "not written yet"
            raise CorpusError(
                f"output folder {folder} is in use by another embed-corpus job (pid {holder}, its lock "
                f"{folder / LOCK}): wait for it to end, or write to another folder"
            ) from None
        os.ftruncate(handle, 0)
        os.pwrite(handle, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(handle, 0)  # a pid left behind would name a process that holds nothing
    finally:
        os.close(handle)  # and with it the lock


def check_writable(folder: Path) -> None:
    """A file created, written to disk and removed: a read-only folder or a full disk is found now, not after
    the model has loaded."""
    probe = folder / f".write-check-{os.getpid()}.tmp"
    try:
        with open(probe, "wb") as file:
            file.write(bytes(4096))
            file.flush()
            os.fsync(file.fileno())  # a full disk may accept the write and refuse the blocks only here
        probe.unlink()
    except OSError as error:
        probe.unlink(missing_ok=True)
        raise CorpusError(f"cannot write to output folder {folder}: {_about(error, probe)}") from error


def check_free_space(folder: Path, rows: int, width: int | None, dtype: str) -> None:
    """Room for `rows` embeddings of `width` values (Parquet adds little to float data; the ids are not counted)."""
    if rows <= 0:
        return
    need = rows * width * ITEM_BYTES[dtype] if width else MIN_FREE
    free = shutil.disk_usage(folder).free
    if free < need:
        what = f"{rows} rows of {width} {dtype} values" if width else f"{rows} rows"
        raise CorpusError(
            f"output folder {folder} has {_size(free)} free, and the {what} still to embed need about {_size(need)}: "
            "free some space, or write to another folder"
        )


def write_file(path: Path, data) -> None:
    """`data` (bytes, a pyarrow Buffer) as `path`, whole or not at all: written under a hidden temporary name,
    then renamed. A failure (a full disk) leaves no temporary file and is one line naming the file."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise CorpusError(f"cannot write {path}: {error.strerror or error}") from error


def _size(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB" if count >= 1 << 20 else f"{count:,} bytes"


def _about(error: OSError, path: Path) -> str:
    return f"{error.filename or path}: {error.strerror or error}"
