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


def architectures(model_name_or_path: str, config_kwargs: dict) -> list[str]:
    """The `architectures` of the checkpoint's config.json (how sentence-transformers picks a bare checkpoint's
    modules)."""
    from transformers import AutoConfig

    from st_fastbackend.modules.options import without_hub_kwargs

    folder = resolve_folder(model_name_or_path, **config_kwargs)
    return AutoConfig.from_pretrained(folder, **without_hub_kwargs(config_kwargs)).architectures or []
