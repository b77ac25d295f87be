"""What the fast backend accepts of sentence-transformers' options for its Transformer module:
model_kwargs, sentence_bert_config.json keys and the Hub's keyword arguments. Anything that would change
the math and is not implemented is refused by name."""

from __future__ import annotations

from typing import Any

import torch
from sentence_transformers.base.modules.transformer import TRANSFORMER_TASK_DEFAULTS

from st_fastbackend.engine.spec import UnsupportedModelError

# What sentence-transformers adds to model/processor/config kwargs for the Hub.
_HUB_KWARGS = {"subfolder", "token", "cache_dir", "revision", "local_files_only", "trust_remote_code"}
# model_kwargs that do not change the math, and "quantize" and "calibration" (engine/quantize.py and
# engine/calibration.py check their values); any other is refused. ("device_map" naming one device: where the
# weights are read to.)
_NEUTRAL_MODEL_KWARGS = _HUB_KWARGS | {
    "quantize",
    "calibration",
    "dtype",
    "torch_dtype",
    "attn_implementation",
    "low_cpu_mem_usage",
    "device_map",
}
# sentence_bert_config.json keys read here; any other key with a non-default value is refused.
_DEFAULT_MODULE_CONFIG = {
    "transformer_task": "feature-extraction",
    "module_output_name": "token_embeddings",
    "processing_kwargs": {},
    "unpad_inputs": None,
    "query_length": None,
    "document_length": None,
    "query_expansion": None,
}
_TEXT_MODALITY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
_INIT_KEYS = {"max_seq_length", "do_lower_case", "model_kwargs", "processor_kwargs", "config_kwargs"}


def module_config(config: dict[str, Any]) -> dict[str, Any]:
    """sentence_bert_config.json as sentence-transformers' Transformer reads it -> our __init__ kwargs."""
    config.pop("backend")
    if (modalities := config.pop("modality_config", _TEXT_MODALITY)) != _TEXT_MODALITY:
        raise UnsupportedModelError(f"modality_config {modalities}")
    for key, default in _DEFAULT_MODULE_CONFIG.items():
        if (value := config.pop(key, default)) not in (default, None):
            raise UnsupportedModelError(f"{key}={value!r} in sentence_bert_config.json")
    if unknown := set(config) - _INIT_KEYS:
        raise UnsupportedModelError(f"sentence_bert_config.json keys {sorted(unknown)}")
    return config


def task_config(config: dict[str, Any], default_task: str) -> dict[str, Any]:
    """sentence_bert_config.json of a Transformer with a transformer_task (a cross-encoder's, SPLADE's) -> its
    task and our __init__ kwargs: the outputs sentence-transformers writes for that task are its defaults."""
    task = config.pop("transformer_task", default_task)
    modalities, output = TRANSFORMER_TASK_DEFAULTS.get(task, (None, None))
    if config.get("module_output_name") == output:
        config.pop("module_output_name")
    saved = config.get("modality_config")
    if saved == modalities or (isinstance(saved, dict) and _text_and_message(saved, modalities)):
        config.pop("modality_config")  # a chat template's message modality: the tokenizer's template says it
    return {"transformer_task": task, **module_config(config)}


def _text_and_message(saved: dict, text_only: dict | None) -> bool:
    """The task's text modality and a chat template's message modality with the same output, as
    sentence-transformers infers them for a tokenizer with a chat template."""
    message = saved.get("message") or {}
    others = {key: value for key, value in saved.items() if key != "message"}
    return text_only is not None and others == text_only and message.get("method_output_name") == (
        text_only["text"]["method_output_name"])  # fmt: skip


def check_model_kwargs(model_kwargs: dict[str, Any]) -> None:
    if unknown := set(model_kwargs) - _NEUTRAL_MODEL_KWARGS:
        raise UnsupportedModelError(f"model_kwargs {sorted(unknown)}")


def without_hub_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The folder is already resolved; keyword arguments for the Hub do not apply to it."""
    return {k: v for k, v in kwargs.items() if k not in _HUB_KWARGS}


def load_device(device_map) -> torch.device:
    """Where the weights are read to: sentence-transformers' device_map naming one device (our
    SentenceTransformer sets it to the model's device), else the CPU."""
    if device_map is None:
        return torch.device("cpu")
    try:
        return torch.device(device_map)
    except (TypeError, RuntimeError, ValueError):
        raise UnsupportedModelError(f"device_map={device_map!r} (one device, e.g. 'cuda:1', is supported)") from None
