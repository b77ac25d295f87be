"""What the corpus job's rows depend on in the model folder, read before the model loads: an identity of its files
(a resume into a folder whose shards came from other weights or another configuration is refused), and the width
of its embeddings (for the free-space check)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from st_fastbackend.corpus import CorpusError

SMALL_FILE = 1 << 20  # configs, tokenizers, vocabularies: hashed whole
TENSOR_SAMPLE = 4096  # bytes hashed at each end of every tensor
FILE_SAMPLE = 1 << 16  # bytes hashed at each end of another large file (weights the fast backend does not read)


def model_identity(model: str) -> str:
    """A hash of every file of a local model folder but hidden ones and *.md: configuration, tokenizer and pooling
    files whole, safetensors files by their header (names, dtypes, shapes, offsets) and both ends of every tensor.
    The header alone would not tell a checkpoint retrained in place from the old one (same shapes, same size); the
    ends of each tensor do, for a few kB a tensor instead of reading gigabytes. A Hub id is known by its name only."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return f"hub id {model}"
    digest = hashlib.sha256()
    for path in sorted(path for path in folder.rglob("*") if path.is_file() and _counts(path.relative_to(folder))):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder).as_posix()}\0{size}\0".encode())
        with open(path, "rb") as file:
            if path.suffix == ".safetensors":
                _hash_safetensors(file, size, digest, path)
            elif size <= SMALL_FILE:
                digest.update(file.read())
            else:
                _hash_range(file, 0, size, FILE_SAMPLE, digest)
    return digest.hexdigest()[:32]


def _counts(relative: Path) -> bool:
    return not any(part.startswith(".") for part in relative.parts) and relative.suffix != ".md"


def _hash_safetensors(file, size: int, digest, path: Path) -> None:
    """The header (8 bytes of length, then JSON), then both ends of each tensor's bytes."""
    try:
        (length,) = struct.unpack("<Q", file.read(8))
        header = file.read(length)
        tensors = json.loads(header)
        spans = sorted(tuple(entry["data_offsets"]) for name, entry in tensors.items() if name != "__metadata__")
    except (struct.error, ValueError, TypeError, KeyError) as error:
        raise CorpusError(f"model file {path} is not a safetensors file: {type(error).__name__}: {error}") from error
    digest.update(header)
    for begin, end in spans:
        _hash_range(file, 8 + length + begin, min(8 + length + end, size), TENSOR_SAMPLE, digest)


def _hash_range(file, begin: int, end: int, sample: int, digest) -> None:
    """The bytes [begin, end) whole when short, else `sample` bytes at each end."""
    if end - begin <= 2 * sample:
        file.seek(begin)
        digest.update(file.read(end - begin))
        return
    for start in (begin, end - sample):
        file.seek(start)
        digest.update(file.read(sample))


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
