"""What the corpus job's rows depend on in the model folder, read before the model loads: an identity of its files
(a resume into a folder whose shards came from other weights or another configuration is refused), and the width
of its embeddings (for the free-space check).

The identity covers every byte of every file. A large file's sha256 is computed once and kept in a cache under the
user's cache folder (CACHE_ENV, else $XDG_CACHE_HOME/st_fastbackend, else ~/.cache/st_fastbackend), keyed by the file's
real path and its stat signature: device, inode, size, mtime and ctime, in nanoseconds. That is sound because no
change to a file's bytes keeps all of these: writing to it in place sets its ctime to the time of the write (which,
unlike the mtime, no program can set back: `touch -d`, `cp --preserve` and `rsync -t` restore only the mtime), and
replacing it (a new file renamed over it) gives another inode. Two traps are closed besides: a digest is kept only
for a file whose signature is the same after the hash as before (not being written meanwhile) and whose last change
is RACY_SECONDS old (a write later within the same timestamp tick would leave the signature as it was). The cache
is an optimisation only: one that is missing, unreadable or unwritable costs a full read again, never a wrong
identity. Beside the output folder it would serve only that folder's resumes; here every job on the same weights
(and a later one reusing earlier outputs) reads them once."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SMALL_FILE = 1 << 20  # configs, tokenizers, vocabularies: hashed as they are read, not cached
CACHE_ENV = "ST_FASTBACKEND_CACHE"
CACHE_FILE = "file-sha256.json"
RACY_SECONDS = 2.0  # coarser than any filesystem's timestamp tick (FAT's 2 s)
BLOCK = 1 << 20


def model_identity(model: str) -> str:
    """A hash of every byte of every file of a local model folder but hidden ones and *.md, with their names and
    sizes. A Hub id is known by its name only."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return f"hub id {model}"
    digest, cache = hashlib.sha256(), DigestCache(cache_folder() / CACHE_FILE)
    for path in sorted(path for path in folder.rglob("*") if path.is_file() and _counts(path.relative_to(folder))):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder).as_posix()}\0{size}\0".encode())
        digest.update(path.read_bytes() if size <= SMALL_FILE else cache.digest(path))
    cache.save()
    return digest.hexdigest()[:32]


def cache_folder() -> Path:
    if found := os.environ.get(CACHE_ENV):
        return Path(found).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "st_fastbackend"


def _counts(relative: Path) -> bool:
    return not any(part.startswith(".") for part in relative.parts) and relative.suffix != ".md"


class DigestCache:
    """Files' sha256 by real path, each with the stat signature it was computed for (see the module's docstring)."""

    def __init__(self, path: Path) -> None:
        self.path, self.changed = path, False
        try:
            found = json.loads(path.read_text())
            self.entries: dict[str, dict] = found if isinstance(found, dict) else {}
        except (OSError, ValueError):
            self.entries = {}

    def digest(self, path: Path) -> bytes:
        """The file's sha256: the cache's where its signature is unchanged, else read whole (and kept)."""
        real, before = str(path.resolve()), _signature(path)
        entry = self.entries.get(real)
        if isinstance(entry, dict) and entry.get("signature") == before and isinstance(entry.get("sha256"), str):
            return bytes.fromhex(entry["sha256"])
        started, found = time.time(), hashlib.sha256()
        with open(path, "rb") as file:
            while block := file.read(BLOCK):
                found.update(block)
        settled = started - max(before[3], before[4]) / 1e9 > RACY_SECONDS  # its last change, mtime or ctime
        if settled and _signature(path) == before:
            self.entries[real] = {"signature": before, "sha256": found.hexdigest()}
            self.changed = True
        return found.digest()

    def save(self) -> None:
        """Written whole under a temporary name, then renamed over the old one: a job reading it meanwhile sees either;
        two jobs saving at once lose one's new entries, which are computed again."""
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_text(json.dumps(self.entries))
            os.replace(partial, self.path)
        except OSError as error:
            logger.debug(f"The cache of file digests {self.path} was not written: {error}")


def _signature(path: Path) -> list[int]:
    found = os.stat(path)
    return [found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns]


def output_width(model: str) -> int | None:
    """The embedding width a local folder's files declare: the last Dense module's out_features, else the
    transformer's hidden_size (what pooling keeps); None for a Hub id or a folder that says neither."""
    folder = Path(model).expanduser()
    width = _read_json(folder / "config.json").get("hidden_size")
    modules = _read_json(folder / "modules.json", [])
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Dense"):
            width = _read_json(folder / str(module.get("path", "")) / "config.json").get("out_features", width)
    return width if isinstance(width, int) and width > 0 else None


def _read_json(path: Path, default=None):
    """The file's JSON (a dict unless `default` says otherwise); the default for a missing or broken file (a Hub
    id, or a file the model load names)."""
    default = {} if default is None else default
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return default
    return found if isinstance(found, type(default)) else default
