"""Where a model's files are: a local folder, or a Hub snapshot of just the files the engine reads."""

from __future__ import annotations

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
