"""What the server and the corpus job use of a fast embedding model, and nothing else of it: prompt resolution,
tokenization, the vocabulary, the output's shape, packed runs through the one packing schedule, and each pack's rows
as the model's class declares them (the server's Servable, serve/servable.py)."""

from __future__ import annotations

import torch
from sentence_transformers.base.modules import Normalize

from st_fastbackend.engine.schedule import Schedule
from st_fastbackend.models import SentenceTransformer
from st_fastbackend.models.chunked import late_room, span_vectors
from st_fastbackend.models.chunking import Chunking
from st_fastbackend.modules import PackedTransformer
from st_fastbackend.modules.tokenizer import DocumentTokens, TextTokenizer

DOCUMENT_PROMPTS = ("document", "passage", "corpus")  # encode_document's prompt names, the first found taken


class Embedder:
    def __init__(self, model: SentenceTransformer) -> None:
        if not isinstance(getattr(model, "packed_input", None), PackedTransformer):
            raise TypeError('Embedder needs a model loaded with backend="fast".')
        if model.output_kind == "scores":
            raise TypeError(f"Embedder serves embedding models; a {type(model).__name__} gives scores "
                            "(serve/rerank.py's Reranker serves it).")  # fmt: skip
        self._model = model
        packed = model.packed_input
        self.texts: TextTokenizer = packed.texts
        self.dimension: int = model.get_embedding_dimension()
        self.vocab_size: int = packed.config.vocab_size
        self.max_seq_length: int = model.max_seq_length
        self.normalizes: bool = any(isinstance(module, Normalize) for module in model)
        self.device: torch.device = model.device
        self.prompts: dict[str, str] = dict(model.prompts)
        self.kind: str = model.output_kind
        # A document encoder (SparseEncoder, MultiVectorEncoder: it declares document_tokens) is served as
        # encode_document() encodes; any other as encode().
        self.documents: bool = callable(getattr(model, "document_tokens", None))
        self.outputs: tuple[str, ...] = model.served_outputs  # the outputs routes ask for, the first its main one
        self.forward_kwargs: dict = model.served_kwargs()
        self.token_dimension: int = self.dimension if self.documents else packed.get_embedding_dimension()
        self.document_length: int | None = getattr(packed, "document_length", None)  # a MultiVectorEncoder's

    def describe(self) -> dict:
        """What runs: device, the weights' dtype, pooling, the attention kernel, the products' dtype, int8 or not."""
        transformer = self._model.packed_input
        runtime = transformer.runtime
        pooling = next((module.pooling_mode for module in self._model if hasattr(module, "pooling_mode")), None)
        pooling = {"sparse": "splade", "multi_vector": "none"}.get(self.kind, pooling)  # as TEI names them
        return {
            "device": str(self.device),
            "dtype": str(runtime.dtype).removeprefix("torch."),
            "pooling": pooling,
            "attention_kernel": runtime.kernel,
            "product_dtype": str(transformer.product_dtype).removeprefix("torch."),
            "quantize": transformer.quantize,
            "runtime": str(runtime),
        }

    def compiles_seams(self) -> bool:
        """Whether packs of engine/fused.py's MIN_TOKENS tokens or more run compiled layer seams, compiled at the first
        such pack."""
        return self._model.packed_input.runtime.fused

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """As encode() resolves it: `prompt`, else the model's prompt named `prompt_name`, else the model's
        default prompt; None for none. ValueError for an unknown name. A sparse or multi-vector model is served
        as encode_document() encodes: without either, its first of DOCUMENT_PROMPTS."""
        if prompt is None and prompt_name is None and self.documents:
            prompt_name = next((name for name in DOCUMENT_PROMPTS if name in self.prompts), None)
        return self._model._resolve_prompt(prompt, prompt_name) or None

    def tokenize(self, texts: list[str], prompt: str | None, max_length: int | None = None) -> list[list[int]]:
        """Token ids of prompt + text as encode() makes them (a multi-vector model's documents at its
        document_length); ValueError names an input without tokens."""
        if prompt:  # measured (and cached) here, on the caller's thread, so packing never tokenizes
            self.texts.prompt_length(prompt)
        if self.document_length is not None:
            max_length = min(max_length or self.document_length, self.document_length)
        return self.texts.encode(texts, prompt, max_length)

    def late_room(self, chunking: Chunking, document: DocumentTokens, max_seq_length: int) -> int:
        """Text tokens a late-chunking window holds for chunks cut for `max_seq_length`; ValueError for a pooling
        without meaning over a span."""
        return late_room(self._model, chunking, document, max_seq_length)

    def late_chunks(self, out: dict, spans: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
        """Per pack row, its spans' vectors [k, dim] (float, on the host): each span of the row's token embeddings
        pooled and run through the modules after Pooling, as encode_chunks(late=True) makes them."""
        vectors = span_vectors(self._model, out, spans, lambda features: features["sentence_embedding"])
        return list(vectors.float().cpu().split([len(row) for row in spans]))

    def schedule(self, prompt: str | None, max_texts: int, max_tokens: int) -> Schedule:
        """The packing schedule (engine/schedule.py) for sequences tokenized with `prompt`."""
        return Schedule(self._model, prompt, self.device, max_texts, max_tokens, self.forward_kwargs)

    def rows(self, output: str, out: dict) -> list:
        """A pack's rows for `output`, one per sequence, on the host, as the model's class declares them."""
        return self._model.served_rows(output, out)
