"""What the server's worker and routes use of the model they serve: an embedding model's Embedder (embedder.py), a
CrossEncoder's Reranker (serve/rerank.py). A pack's rows are what the model's class's one row rule gives
(FastModel.served_rows), so a class of a new kind is served without a change here."""

from __future__ import annotations

from typing import Protocol

import torch

from st_fastbackend.engine.schedule import Schedule
from st_fastbackend.modules.tokenizer import TextTokenizer


class Servable(Protocol):
    texts: TextTokenizer  # the model's tokenizer
    dimension: int
    vocab_size: int
    normalizes: bool  # the model's own vectors are unit length
    device: torch.device
    outputs: tuple[str, ...]  # what its packs give per text (its class's served_outputs), the first its main output

    def compiles_seams(self) -> bool: ...

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None: ...

    def tokenize(self, texts: list[str], prompt: str | None, max_length: int | None = None) -> list[list[int]]: ...

    def schedule(self, prompt: str | None, max_texts: int, max_tokens: int) -> Schedule:
        """The packing schedule (engine/schedule.py) for sequences tokenized with `prompt`, its forward passes given
        what the model's class serves them with besides the pack (FastModel.served_kwargs)."""
        ...

    def rows(self, output: str, out: dict) -> list:
        """A pack's rows for `output`, one per sequence, on the host, as the model's class declares them."""
        ...
