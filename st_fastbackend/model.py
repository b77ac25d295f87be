"""`SentenceTransformer` with `backend="fast"`: the same class, the packed engine inside.

With backend "torch", "onnx" or "openvino" this is exactly sentence-transformers' class. With
"fast", the Transformer module of modules.json becomes PackedTransformer and the Pooling module
PackedPooling; every other module (Dense, Normalize, ...) stays as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import sentence_transformers
import torch
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from torch import Tensor
from tqdm.autonotebook import trange

from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.modules import PackedPooling, PackedTransformer, check_texts

FAST_MODULES: dict[type, type] = {Transformer: PackedTransformer, Pooling: PackedPooling}


class SentenceTransformer(sentence_transformers.SentenceTransformer):
    def __init__(self, model_name_or_path: str | None = None, *, backend: str = "torch", **kwargs: Any) -> None:
        super().__init__(model_name_or_path, backend=backend, **kwargs)
        if backend == "fast":
            self._check_fast_pipeline()

    def _check_fast_pipeline(self) -> None:
        modules = list(self._modules.values())
        if not modules or not isinstance(modules[0], PackedTransformer):
            first = type(modules[0]).__name__ if modules else "nothing"
            raise UnsupportedModelError(f"A pipeline starting with {first} (the fast backend replaces Transformer)")
        if len(modules) > 1 and not isinstance(modules[1], PackedPooling):
            raise UnsupportedModelError(f"{type(modules[1]).__name__} after the Transformer module")

    # -- loading: swap sentence-transformers' Transformer and Pooling for the packed ones ---------

    def _load_module_class_from_ref(self, class_ref: str, *args, **kwargs) -> type:
        module_class = super()._load_module_class_from_ref(class_ref, *args, **kwargs)
        return FAST_MODULES.get(module_class, module_class) if self.backend == "fast" else module_class

    def _load_default_modules(self, model_name_or_path: str, **kwargs) -> tuple[list, dict]:
        """A bare Hugging Face checkpoint: last-token pooling for causal LMs, mean otherwise (as plain ST)."""
        if self.backend != "fast":
            return super()._load_default_modules(model_name_or_path, **kwargs)
        cache_folder = kwargs.pop("cache_folder", None)
        transformer = PackedTransformer.load(model_name_or_path, cache_folder=cache_folder, **kwargs)
        architectures = transformer.config.architectures or [""]
        causal = architectures[0].endswith("ForCausalLM") and getattr(transformer.config, "is_causal", True)
        pooling = PackedPooling(transformer.get_embedding_dimension(), "lasttoken" if causal else "mean")
        return [transformer, pooling], {}

    # -- saving: canonical sentence-transformers types, so plain sentence-transformers loads it ----

    def save(self, path: str, *args, **kwargs) -> None:
        super().save(path, *args, **kwargs)
        if self.backend == "fast":
            _rewrite_module_types(path)

    # -- inference ----------------------------------------------------------------------------

    @torch.inference_mode()
    def _inference(
        self,
        inputs: list,
        *,
        prompt: str | None,
        batch_size: int,
        show_progress_bar: bool,
        output_value: str | None,
        save_to_cpu: bool,
        normalize_embeddings: bool,
        truncate_dim: int | None,
        device: str | torch.device | None = None,
        **kwargs,
    ) -> list | Tensor:
        if self.backend != "fast":
            return super()._inference(
                inputs,
                prompt=prompt,
                batch_size=batch_size,
                show_progress_bar=show_progress_bar,
                output_value=output_value,
                save_to_cpu=save_to_cpu,
                normalize_embeddings=normalize_embeddings,
                truncate_dim=truncate_dim,
                device=device,
                **kwargs,
            )
        check_texts(inputs)  # before sorting, so an error names the caller's index
        device = self._resolve_inference_device(device)
        self.eval()
        order = np.argsort([-self._input_length(text) for text in inputs], kind="stable")
        results: list = [None] * len(inputs)
        for start in trange(0, len(inputs), batch_size, desc="Batches", disable=not show_progress_bar):
            indices = order[start : start + batch_size]
            features = self.preprocess([inputs[i] for i in indices], prompt=prompt, **kwargs)
            features["packed"] = features["packed"].to(device, non_blocking=True)
            out = self(features, **kwargs)
            if truncate_dim is not None:
                out["sentence_embedding"] = out["sentence_embedding"][:, :truncate_dim]
            if output_value == "sentence_embedding":
                rows = out["sentence_embedding"]
                if normalize_embeddings:
                    rows = torch.nn.functional.normalize(rows, p=2, dim=1)
                rows = rows.cpu() if save_to_cpu else rows
            else:
                rows = _per_text_outputs(out, output_value)
            for index, row in zip(indices, rows, strict=True):
                results[index] = row
        if output_value == "sentence_embedding":
            return torch.stack(results) if results else torch.tensor([], device=device)
        return results


def _per_text_outputs(out: dict[str, Any], output_value: str | None) -> list:
    """Unpadded per-text results: token embeddings [len_i, hidden], or a dict of everything."""
    lengths = list(out["packed"].lengths)
    tokens = out["token_embeddings"].split(lengths)  # [T, H] -> B x [len_i, H]
    if output_value == "token_embeddings":
        return list(tokens)
    input_ids = out["packed"].input_ids.split(lengths)
    per_text = []
    for i, (ids, token_embeddings) in enumerate(zip(input_ids, tokens, strict=True)):
        item = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_embeddings": token_embeddings}
        item["sentence_embedding"] = out["sentence_embedding"][i]
        item.update({k: v for k, v in out.items() if k not in item and k != "packed"})
        per_text.append(item)
    return per_text


def _rewrite_module_types(path: str) -> None:
    canonical = {
        f"{cls.__module__}.{cls.__name__}": f"{base.__module__}.{base.__name__}" for base, cls in FAST_MODULES.items()
    }
    modules_json = Path(path) / "modules.json"
    modules = json.loads(modules_json.read_text())
    for module in modules:
        module["type"] = canonical.get(module["type"], module["type"])
    modules_json.write_text(json.dumps(modules, indent=2))
