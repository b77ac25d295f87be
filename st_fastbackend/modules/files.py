"""Where a model's files are: a local folder, or a Hub snapshot of just the files the engine reads."""

from __future__ import annotations

import json
from pathlib import Path

ENGINE_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


def resolve_folder(model_name_or_path: str, **hub_kwargs) -> Path:
    """hub_kwargs: sentence-transformers' token, revision, cache_dir, local_files_only (others ignored)."""
    if Path(model_name_or_path).is_dir():
        return Path(model_name_or_path)
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            model_name_or_path,
            allow_patterns=ENGINE_FILES,
            token=hub_kwargs.get("token"),
            revision=hub_kwargs.get("revision"),
            cache_dir=hub_kwargs.get("cache_dir"),
            local_files_only=hub_kwargs.get("local_files_only", False),
        )
    )


def architectures(model_name_or_path: str, config_kwargs: dict) -> list[str]:
    """The `architectures` of the checkpoint's config.json (how sentence-transformers picks a bare checkpoint's
    modules)."""
    from transformers import AutoConfig

    from st_fastbackend.modules.options import without_hub_kwargs

    folder = resolve_folder(model_name_or_path, **config_kwargs)
    return AutoConfig.from_pretrained(folder, **without_hub_kwargs(config_kwargs)).architectures or []


def unreadable_json(model_name_or_path: str) -> ValueError | None:
    """For a JSONDecodeError met while loading (it names a position, not a file): an error naming the file and the
    folder, the first JSON file of a local model folder (its module folders' too) that does not parse. None for a
    Hub id, or where every file parses (the document was not one of them)."""
    folder = Path(model_name_or_path).expanduser()
    if not folder.is_dir():
        return None
    for path in sorted(folder.rglob("*.json")):
        if any(part.startswith(".") for part in path.relative_to(folder).parts):
            continue
        try:
            json.loads(path.read_bytes())
        except ValueError as found:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not text
            return ValueError(f"{path.relative_to(folder)} in the model folder {folder} is not valid JSON ({found}): "
                              "copy that file from the model's source again.")  # fmt: skip
    return None
