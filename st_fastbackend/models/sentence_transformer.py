"""`SentenceTransformer` with `backend="fast"`: the same class, the packed engine inside.

With backend "torch", "onnx" or "openvino" this is exactly sentence-transformers' class. With "fast", the
Transformer module of modules.json becomes PackedTransformer and the Pooling module PackedPooling; every other
module (Dense, Normalize, ...) stays as it is. The rest of what "fast" means is models/fast.py's.
"""

from __future__ import annotations

from typing import Any

import sentence_transformers
import torch
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.util.tensor import _tensor_to_numpy
from torch import Tensor

from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.models.chunked import aggregate, chunk_vectors, pipeline_normalizes
from st_fastbackend.models.chunking import Chunking, Chunks
from st_fastbackend.models.fast import FastModel, PackRows, fast_method, text_tokens
from st_fastbackend.modules import PackedPooling, PackedTransformer

OUTPUT_VALUES = ("sentence_embedding", "token_embeddings", None)


class SentenceTransformer(FastModel, sentence_transformers.SentenceTransformer):
    fast_modules = {Transformer: PackedTransformer, Pooling: PackedPooling}
    served_outputs = ("sentence_embedding", "token_embeddings")

    def _check_fast_pipeline(self, modules: list) -> None:
        super()._check_fast_pipeline(modules)
        if len(modules) > 1 and not isinstance(modules[1], PackedPooling):
            raise UnsupportedModelError(f"{type(modules[1]).__name__} after the Transformer module")

    def default_modules(self, model_name_or_path: str, kwargs: dict[str, dict]) -> tuple[list, dict]:
        """A bare Hugging Face checkpoint, built as plain sentence-transformers builds it: the Transformer from its
        constructor (sentence_bert_config.json is not read on this path, so max_seq_length is the tokenizer's,
        capped at the positions), last-token pooling for causal LMs, mean otherwise."""
        transformer = PackedTransformer(model_name_or_path, **kwargs)
        architectures = transformer.config.architectures or [""]
        causal = architectures[0].endswith("ForCausalLM") and getattr(transformer.config, "is_causal", True)
        pooling = PackedPooling(transformer.get_embedding_dimension(), "lasttoken" if causal else "mean")
        return [transformer, pooling], {}

    def _packed_inference(self, inputs: list, *, output_value: str | None, chunking: Chunking | None = None, **kwargs):
        """encode(): FastModel's loop with this class's row rule, or with `chunking` one vector per text."""
        if output_value not in OUTPUT_VALUES:
            raise ValueError(f"output_value must be one of {OUTPUT_VALUES}, got {output_value!r}.")
        if chunking is None:
            return super()._packed_inference(inputs, output_value=output_value, **kwargs)
        return self._aggregated(inputs, chunking, output_value, **kwargs)

    def served_options(self, output: str) -> dict[str, Any]:
        return {"output_value": output, "save_to_cpu": False, "truncate_dim": None, "normalize_embeddings": False}

    def pack_rows(self, prompt: str | None, options: dict) -> PackRows:
        """Each text's sentence embedding (truncated, normalised, on the host as asked), token embeddings or dict of
        outputs, as sentence-transformers' encode() gives them."""
        output_value, to_cpu = options.pop("output_value"), options.pop("save_to_cpu")
        truncate_dim, normalize = options.pop("truncate_dim"), options.pop("normalize_embeddings")
        dense = output_value == "sentence_embedding"

        def finish(results: list, device: torch.device) -> list | Tensor:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the rows left on the GPU, if any, are complete
            if dense:
                return torch.stack(results) if results else torch.tensor([], device=device)
            return results

        return PackRows(text_tokens(self[0].texts, prompt),
                        lambda out: (_rows(out, output_value, truncate_dim, normalize, to_cpu), None), finish,
                        copied_to_host=dense and to_cpu)  # fmt: skip

    def encode_chunks(
        self, inputs: list[str], chunking: Chunking | None = None, *, prompt_name: str | None = None,
        prompt: str | None = None, batch_size: int = 32, show_progress_bar: bool = False,
        convert_to_tensor: bool = False, device: str | None = None, normalize_embeddings: bool = False,
        truncate_dim: int | None = None, max_tokens_per_batch: int | None = None,
    ) -> list[Chunks]:  # fmt: skip
        """One `Chunks` per text: every chunk's vector (numpy, or tensors with convert_to_tensor) with its character
        and token spans. The chunks of all texts run through the one packing schedule."""
        if self.backend != "fast":
            raise UnsupportedModelError('encode_chunks() (it needs backend="fast")')
        truncate_dim = truncate_dim if truncate_dim is not None else self.truncate_dim
        prompt = self._resolve_prompt(prompt, prompt_name)
        found, _ = self._chunked(inputs, chunking or Chunking(aggregate=None), prompt, truncate_dim,
                                 normalize_embeddings, not convert_to_tensor, device=device,
                                 max_tokens_per_batch=max_tokens_per_batch, batch_size=batch_size,
                                 show_progress_bar=show_progress_bar)  # fmt: skip
        as_output = (lambda t: t) if convert_to_tensor else _tensor_to_numpy
        return [Chunks(as_output(vectors), chars, spans) for vectors, spans, chars in found]

    @torch.inference_mode()
    def _aggregated(
        self, inputs: list, chunking: Chunking, output_value: str | None, *, prompt: str | None, batch_size: int,
        show_progress_bar: bool, save_to_cpu: bool, normalize_embeddings: bool, truncate_dim: int | None,
        device: str | torch.device | None = None, max_tokens_per_batch: int | None = None, **kwargs,
    ) -> Tensor:  # fmt: skip
        """encode(chunking=...): one vector per text, its chunks' aggregate."""
        self.refuse_processing_kwargs(kwargs.pop("processing_kwargs", None))
        if chunking.aggregate is None:
            raise ValueError("encode(chunking=Chunking(aggregate=None)) gives several vectors per text: call "
                             "encode_chunks(), or give Chunking.aggregate ('mean', 'max' or 'first').")  # fmt: skip
        if output_value != "sentence_embedding":
            raise ValueError(f"encode(chunking=...) gives sentence embeddings; output_value={output_value!r} with it.")
        found, device = self._chunked(inputs, chunking, prompt, truncate_dim, normalize_embeddings, save_to_cpu,
                                      device=device, max_tokens_per_batch=max_tokens_per_batch, batch_size=batch_size,
                                      show_progress_bar=show_progress_bar, **kwargs)  # fmt: skip
        normalizes = pipeline_normalizes(self, normalize_embeddings)
        vectors = [aggregate(rows, spans, chunking.aggregate, normalizes) for rows, spans, _ in found]
        return torch.stack(vectors) if vectors else torch.tensor([], device=device)

    @torch.inference_mode()
    def _chunked(
        self, inputs: list, chunking: Chunking, prompt: str | None, truncate_dim: int | None, normalize: bool,
        to_cpu: bool, *, device, max_tokens_per_batch: int | None, **run,
    ) -> tuple[list, torch.device]:  # fmt: skip
        """Per text its chunks' rows, token spans and character spans (models/chunked.py chunk_vectors), complete
        also on a GPU; and the device they ran on. Started as every packed call starts (_inference_start)."""
        device, max_tokens = self._inference_start(inputs, device, max_tokens_per_batch)
        rows, run = _chunk_rows(truncate_dim, normalize), {**run, "device": device, "max_tokens": max_tokens}
        found = chunk_vectors(self, inputs, chunking, prompt, rows, to_cpu, **run)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return found, device

    @fast_method
    def get_model_kwargs(self) -> list[str]:
        return [*super().get_model_kwargs(), "chunking"]


def _chunk_rows(truncate_dim: int | None, normalize: bool):
    """A pack's rows for chunking, left on the device (models/chunked.py moves them)."""
    return lambda out: _rows(out, "sentence_embedding", truncate_dim, normalize, False)


def _rows(out: dict[str, Any], output_value: str | None, truncate_dim, normalize: bool, to_cpu: bool) -> list | Tensor:
    """One batch's results, one row per text, as sentence-transformers' encode() returns them."""
    if truncate_dim is not None:
        out["sentence_embedding"] = out["sentence_embedding"][:, :truncate_dim]
    if output_value != "sentence_embedding":
        return _per_text_outputs(out, output_value)
    rows = out["sentence_embedding"]
    if normalize:
        rows = torch.nn.functional.normalize(rows, p=2, dim=1)
    # From a GPU: copied without waiting for it (HostRows waits, a few packs behind).
    return rows.to("cpu", non_blocking=True) if to_cpu else rows


def per_text_tokens(out: dict[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
    """Each text's token ids [len_i] and token embeddings [len_i, hidden], every token of prompt + text as plain
    sentence-transformers gives them: in a pack after a prompt computed once, the prompt's own rows first."""
    lengths = list(out["packed"].lengths)
    ids, tokens = out["packed"].input_ids.split(lengths), out["token_embeddings"].split(lengths)  # [T] -> B x [len_i]
    prefix = out.get("prefix")
    if prefix is None:
        return list(ids), list(tokens)
    head = torch.tensor(prefix.ids, device=ids[0].device)
    return [torch.cat([head, i]) for i in ids], [torch.cat([prefix.states.to(t.dtype), t]) for t in tokens]


def _per_text_outputs(out: dict[str, Any], output_value: str | None) -> list:
    """Unpadded per-text results: token embeddings [len_i, hidden], or a dict of everything."""
    input_ids, tokens = per_text_tokens(out)
    if output_value == "token_embeddings":
        return tokens
    per_text = []
    for i, (ids, token_embeddings) in enumerate(zip(input_ids, tokens, strict=True)):
        item = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_embeddings": token_embeddings}
        item["sentence_embedding"] = out["sentence_embedding"][i]
        item.update({k: v for k, v in out.items() if k not in item and k != "packed"})
        per_text.append(item)
    return per_text
