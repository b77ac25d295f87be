"""`MultiVectorEncoder` with `backend="fast"`: the same class, the packed engine inside.

With backend "torch", "onnx" or "openvino" this is exactly sentence-transformers' class. With "fast", the
Transformer becomes PackedMultiVectorTransformer and MultiVectorMask PackedMultiVectorMask
(modules/multi_vector.py); a token-level Dense and Normalize run on packed tokens as they are. encode(),
encode_query() and encode_document() are the parent's; their inner loop is the packed one of models/fast.py, and
each text's vectors are its packed rows the scoring mask keeps.
"""

from __future__ import annotations

import sentence_transformers
import torch
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
from torch import Tensor

from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.models.fast import FastModel, PackRows
from st_fastbackend.modules.multi_vector import PackedMultiVectorMask, PackedMultiVectorTransformer, scored_rows


class MultiVectorEncoder(FastModel, sentence_transformers.MultiVectorEncoder):
    fast_modules = {Transformer: PackedMultiVectorTransformer, MultiVectorMask: PackedMultiVectorMask}
    prompt_reuse = False  # engine/prefix.py is for causal decoders, and a prompt's tokens are among the vectors
    output_kind = "multi_vector"
    served_outputs = ("token_embeddings",)  # encode()'s output_value="token_embeddings"

    def _check_fast_pipeline(self, modules: list) -> None:
        super()._check_fast_pipeline(modules)
        for module in modules[1:]:
            token_level = isinstance(module, (Dense, Normalize)) and module.module_input_name == "token_embeddings"
            if not (token_level or isinstance(module, PackedMultiVectorMask)):
                raise UnsupportedModelError(f"{type(module).__name__} in a MultiVectorEncoder pipeline")

    def default_modules(self, model_name_or_path: str, kwargs: dict[str, dict]) -> tuple[list, dict]:
        """A bare checkpoint gets an untrained projection: nothing to be exact about."""
        raise UnsupportedModelError("A bare checkpoint as a MultiVectorEncoder (it gets an untrained projection)")

    def served_options(self, output: str) -> dict:
        """Per text its scored token vectors [n_i, dim], as they leave the model (one copy per pack)."""
        return {"output_value": output, "save_to_cpu": False, "normalize_embeddings": False, "token_pooling": None}

    def document_tokens(self, texts: list[str], prompt: str | None) -> list:
        """Each text's tokens as encode_document() runs it with `prompt` (the corpus job counts them)."""
        return self[0].encode_task(texts, prompt, "document", 0)

    def pack_rows(self, prompt: str | None, options: dict) -> PackRows:
        """Per text its [len_i, dim] scored token vectors (normalised, pooled, on the host as asked)."""
        if options.pop("output_value") is None:
            raise UnsupportedModelError("output_value=None (padded per-batch feature dicts) in MultiVectorEncoder")
        to_cpu, normalize = options.pop("save_to_cpu"), options.pop("normalize_embeddings")
        token_pooling, task, transformer = options.pop("token_pooling"), options.get("task"), self[0]

        def tokenize(chunk: list[str], positions: range) -> list[list[int]]:
            return transformer.encode_task(chunk, prompt, task, first_index=positions.start)

        def rows(out: dict) -> tuple[Tensor, list[int]]:
            rows, counts = scored_rows(out)  # [K, dim], each text's n_i
            if normalize:
                rows = torch.nn.functional.normalize(rows, p=2, dim=-1)
            if token_pooling is not None:
                vectors = token_pooling.pool(list(rows.split(counts)), task=task)
                rows, counts = torch.cat(vectors), [len(v) for v in vectors]
            # From a GPU: one copy per pack, without waiting for it (HostRows waits, a few packs behind, and splits).
            return (rows.to("cpu", non_blocking=True) if to_cpu else rows), counts

        return PackRows(tokenize, rows, lambda results, device: results, copied_to_host=to_cpu)
