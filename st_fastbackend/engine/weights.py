"""Strict loading of Hugging Face safetensors checkpoints (single file or sharded) into the engine.

The layout and names stay Hugging Face's; the only change is fusing the parts a model declares in
its `fused` table (e.g. q/k/v into qkv_proj) along dim 0, in slot order. Every expected tensor must
be present with its shape; a tensor the model does not know is an error that names it.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import Tensor, nn

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    pass


def checkpoint_files(folder: Path) -> list[Path]:
    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise CheckpointError(
        f"No {SINGLE_FILE} or {INDEX_FILE} in {folder}: the fast backend reads safetensors checkpoints only. "
        'backend="torch" loads other formats.'
    )


SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def stored_dtype(folder: Path) -> torch.dtype | None:
    """The dtype of the checkpoint's first floating-point tensor, read from the file's header (what
    transformers' dtype="auto" falls back to where config.json names none)."""
    for file, name in _tensor_names(folder):
        with safe_open(file, framework="pt") as f:
            if (dtype := SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())) is not None:
                return dtype
    return None


def load_weights(
    model: nn.Module, folder: Path, device: torch.device, dtype: torch.dtype,
    skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
) -> list[str]:  # fmt: skip
    """Fill `model` (built on the meta device) from the checkpoint, read tensor by tensor straight onto
    `device` and cast there: the host never holds more than the tensor being read. Fused tensors are
    joined as soon as their last part arrives. Returns the names it loaded.

    A checkpoint read by two modules (an encoder and its classification head) is split by name: the body
    `skip`s the head's tensors, the head reads `only` its own; each is strict about its part."""
    expected = model.state_dict()
    slot_counts = Counter(target for target, _ in model.fused.values())
    parts: dict[str, dict[int, Tensor]] = defaultdict(dict)
    state: dict[str, Tensor] = {}
    unknown: list[str] = []
    for file, raw_name in _tensor_names(folder):
        name = _strip_prefix(raw_name, model.prefixes)
        if name.startswith((*model.ignored, *skip)) or (only is not None and not name.startswith(only)):
            continue
        target, slot = _fused_name(name, model.fused)
        if target not in expected:
            unknown.append(raw_name)
            continue
        # Opened per tensor: safetensors maps the whole file, and the pages read stay resident until it is
        # closed; one tensor's pages at a time keep a GPU load's host memory flat whatever the shard size.
        with safe_open(file, framework="pt", device=str(device)) as f:
            parts[target][slot] = _Part(raw_name, f.get_tensor(raw_name).to(dtype))
        count = slot_counts.get(_owner(target), 1)
        if len(parts[target]) == count:
            state[target] = _join(target, parts.pop(target), count, expected[target].shape)
    if unknown:
        raise CheckpointError(f"Checkpoint in {folder} has tensors the fast backend does not know: {unknown}")
    for name, slots in parts.items():  # fused tensors with parts missing: the error names them
        _join(name, slots, slot_counts.get(_owner(name), 1), expected[name].shape)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"Checkpoint in {folder} lacks tensors: {missing}")
    model.load_state_dict(state, strict=True, assign=True)
    return sorted(state)


def read_tensors(folder: Path, names: set[str], device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """The checkpoint's tensors of these names (as it names them) that it has, read onto `device` in `dtype`."""
    found = {}
    for file, name in _tensor_names(folder):
        if name in names:
            with safe_open(file, framework="pt", device=str(device)) as f:
                found[name] = f.get_tensor(name).to(dtype)
    return found


def _tensor_names(folder: Path) -> list[tuple[Path, str]]:
    names = []
    for file in checkpoint_files(folder):
        with safe_open(file, framework="pt") as f:
            names += [(file, name) for name in f.keys()]  # noqa: SIM118 (safe_open is not a mapping)
    return names


def _owner(name: str) -> str:
    """'layers.0.self_attn.qkv_proj.weight' -> 'qkv_proj', the key of a fused table entry."""
    return name.split(".")[-2] if "." in name else name


def _strip_prefix(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _fused_name(name: str, fused: dict[str, tuple[str, int]]) -> tuple[str, int]:
    """'layers.0.self_attn.k_proj.weight' -> ('layers.0.self_attn.qkv_proj.weight', 1)."""
    pieces = name.split(".")
    for i, piece in enumerate(pieces):
        if piece in fused:
            target, slot = fused[piece]
            return ".".join([*pieces[:i], target, *pieces[i + 1 :]]), slot
    return name, 0


class _Part(NamedTuple):
    name: str  # as the checkpoint names it
    tensor: Tensor


def _join(name: str, slots: dict[int, _Part], count: int, shape: torch.Size) -> Tensor:
    if sorted(slots) != list(range(count)):
        raise CheckpointError(f"{name}: the checkpoint has parts {sorted(slots)} of {count}")
    parts = [slots[i] for i in range(count)]
    fits = parts[0].tensor.shape == shape if count == 1 else _rows_join(parts, shape)
    if not fits:
        found = ", ".join(f"{part.name} {tuple(part.tensor.shape)}" for part in parts)
        implied = f"{tuple(shape)} in all" if count > 1 else f"{tuple(shape)}"
        raise CheckpointError(f"{name}: checkpoint shape {found}, the config implies {implied}")
    return parts[0].tensor if count == 1 else torch.cat([part.tensor for part in parts], dim=0)


def _rows_join(parts: list[_Part], shape: torch.Size) -> bool:
    """Whether the parts, joined along dim 0, have `shape`."""
    same_rest = all(part.tensor.dim() == len(shape) > 0 and part.tensor.shape[1:] == shape[1:] for part in parts)
    return same_rest and sum(part.tensor.shape[0] for part in parts) == shape[0]
