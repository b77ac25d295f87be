"""`SparseEncoder` with `backend="fast"`: the same class, the packed engine inside.

With backend "torch", "onnx" or "openvino" this is exactly sentence-transformers' class. With "fast":
- SPLADE (a fill-mask Transformer, or the legacy MLMTransformer, then SpladePooling): PackedMaskedLM and
  PackedSpladePooling (modules/splade.py), the vocabulary projection fused with the pooling;
- CSR (a Transformer, Pooling, then SparseAutoEncoder): PackedTransformer and PackedPooling, the autoencoder as
  it is on each pack's [B, dim];
- inference-free SPLADE (a Router whose query route is a SparseStaticEmbedding): the document route as above,
  the query route sentence-transformers' own (a lookup per token: queries never touch a transformer).
encode(), encode_query() and encode_document() are the parent's; their inner loop is the packed one of
models/fast.py.
"""

from __future__ import annotations

import sentence_transformers
import torch
from sentence_transformers.base.modules import Router, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.sparse_encoder.modules import MLMTransformer, SparseAutoEncoder, SpladePooling
from sentence_transformers.util import select_max_active_dims
from torch import Tensor

from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.models.fast import FastModel, PackRows, check_budget, text_tokens
from st_fastbackend.modules import PackedPooling, PackedTransformer
from st_fastbackend.modules.files import architectures
from st_fastbackend.modules.options import task_config
from st_fastbackend.modules.splade import PackedMaskedLM, PackedSpladePooling


class PackedSparseInput(PackedTransformer):
    """What a SparseEncoder's Transformer becomes: a fill-mask one SPLADE's PackedMaskedLM, any other task
    the plain PackedTransformer (CSR)."""

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs) -> PackedTransformer:
        init_kwargs = Transformer._load_init_kwargs(model_name_or_path, subfolder=subfolder, **kwargs)
        config = task_config(init_kwargs, "feature-extraction")
        if config["transformer_task"] == "fill-mask":
            return PackedMaskedLM(model_name_or_path, **config)
        if (task := config.pop("transformer_task")) != "feature-extraction":
            raise UnsupportedModelError(f"A SparseEncoder Transformer with transformer_task={task!r}")
        return PackedTransformer(model_name_or_path, **config)


class SparseEncoder(FastModel, sentence_transformers.SparseEncoder):
    output_kind = "sparse"
    served_outputs = ("sparse",)  # per text its active dimensions and their values
    fast_modules = {Transformer: PackedSparseInput, MLMTransformer: PackedMaskedLM, Pooling: PackedPooling,
                    SpladePooling: PackedSpladePooling}  # fmt: skip
    prompt_reuse = False  # engine/prefix.py is for causal decoders; SPLADE and CSR sit on encoders

    def saved_types(self) -> dict[type, type]:
        return {PackedMaskedLM: Transformer, PackedTransformer: Transformer, PackedPooling: Pooling,
                PackedSpladePooling: SpladePooling}  # fmt: skip

    def _check_fast_pipeline(self, modules: list) -> None:
        if len(modules) == 1 and isinstance(modules[0], Router):
            routes = modules[0].sub_modules
            packed = [route for route in routes.values() if isinstance(route[0], PackedTransformer)]
            if len(packed) != 1:  # one tokenizer and one engine pack a call (packed_input), whatever its task
                raise UnsupportedModelError(f"A Router with {len(packed)} Transformer routes (one is taken)")
            for route in packed:
                self._check_route(list(route))
            return
        super()._check_fast_pipeline(modules)
        self._check_route(modules)

    def _check_route(self, modules: list) -> None:
        first, rest = modules[0], [type(m) for m in modules[1:]]
        if isinstance(first, PackedMaskedLM) and rest == [PackedSpladePooling]:
            return
        csr = rest[:1] == [PackedPooling] and set(rest[1:]) <= {SparseAutoEncoder}
        if not isinstance(first, PackedMaskedLM) and csr:
            return
        after = ", ".join(cls.__name__ for cls in rest) or "nothing"
        raise UnsupportedModelError(f"A SparseEncoder pipeline of {type(first).__name__} followed by {after}")

    def default_modules(self, model_name_or_path: str, kwargs: dict[str, dict]) -> tuple[list, dict]:
        """A bare Hugging Face checkpoint, as plain sentence-transformers builds it: a *ForMaskedLM as a fill-mask
        Transformer with max SpladePooling. (Any other it gives an untrained SparseAutoEncoder: refused.)"""
        found = architectures(model_name_or_path, kwargs["config_kwargs"])
        if not any(name.endswith("ForMaskedLM") for name in found):
            raise UnsupportedModelError("A bare checkpoint that is not a *ForMaskedLM as a SparseEncoder (sentence-"
                                        "transformers puts an untrained SparseAutoEncoder on it)")  # fmt: skip
        return [PackedMaskedLM(model_name_or_path, **kwargs), PackedSpladePooling(pooling_strategy="max")], {}

    @property
    def packed_input(self) -> PackedTransformer:
        """A Router's Transformer route (inference-free SPLADE: its document side)."""
        if isinstance(self[0], Router):
            return next(r[0] for r in self[0].sub_modules.values() if isinstance(r[0], PackedTransformer))
        return self[0]

    def _route(self, task: str | None) -> list:
        if not isinstance(self[0], Router):
            return list(self._modules.values())
        return list(self[0].sub_modules[self[0]._resolve_route(task=task)])  # as its forward() resolves it

    def _packed_inference(self, inputs: list, **kwargs) -> Tensor:
        """encode(): FastModel's loop with this class's row rule; a route without the packed engine (a
        SparseStaticEmbedding) runs sentence-transformers' own (processing_kwargs refused there too, as everywhere)."""
        if not isinstance(self._route(kwargs.get("task"))[0], PackedTransformer):
            self.refuse_processing_kwargs(kwargs.pop("processing_kwargs", None))
            check_budget(kwargs.pop("max_tokens_per_batch", None))  # (nothing to bound there: no packs)
            return sentence_transformers.SparseEncoder._inference(self, inputs, **kwargs)
        return super()._packed_inference(inputs, **kwargs)

    def document_tokens(self, texts: list[str], prompt: str | None) -> list[list[int]]:
        """Each text's tokens as encode_document() runs it with `prompt` (the corpus job counts them)."""
        return self.packed_input.texts.encode(texts, prompt)

    def served_options(self, output: str) -> dict:
        """The model's max_active_dims kept, as encode() keeps them."""
        return {"convert_to_sparse_tensor": True, "save_to_cpu": False, "max_active_dims": self.max_active_dims}

    def served_kwargs(self) -> dict:
        """Its max_active_dims, a SparseAutoEncoder's k, as encode() passes it."""
        return {} if self.max_active_dims is None else {"max_active_dims": self.max_active_dims}

    def pack_rows(self, prompt: str | None, options: dict) -> PackRows:
        """Each text's row as the parent makes it: top max_active_dims kept, sparse, on the CPU as asked."""
        to_sparse, to_cpu = options.pop("convert_to_sparse_tensor"), options.pop("save_to_cpu")
        max_active_dims = options.pop("max_active_dims")
        if max_active_dims is not None:
            options["max_active_dims"] = max_active_dims  # SparseAutoEncoder's k
        route = self._route(options.get("task"))

        def rows(out: dict) -> tuple[Tensor, None]:
            embeddings = out["sentence_embedding"]
            if max_active_dims is not None:
                embeddings = select_max_active_dims(embeddings, max_active_dims=max_active_dims)
            if to_sparse:
                embeddings = embeddings.to_sparse()
            return (embeddings.cpu() if to_cpu else embeddings), None

        def finish(results: list, device: torch.device) -> Tensor:
            if results:
                return torch.stack(results)
            empty = torch.tensor([], device="cpu" if to_cpu else device)
            return empty.to_sparse() if to_sparse else empty

        return PackRows(text_tokens(route[0].texts, prompt), rows, finish)
