"""A request's token ids, computed on a thread of their own: off the event loop, and off the worker that
runs the model, so a long text delays no one's forward pass. One thread, because a Hugging Face fast
tokenizer keeps its truncation setting in shared state and must not run in two threads at once."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from st_fastbackend.embedder import Embedder
from st_fastbackend.modules.tokenizer import clip_text


class InputError(ValueError):
    """The request's own fault (too long, no tokens, ids outside the vocabulary): answered with 400."""


class RequestTokenizer:
    def __init__(self, embedder: Embedder, max_input_tokens: int):
        self.embedder = embedder
        self.limit = max_input_tokens
        self.vocab_size = embedder.vocab_size
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def __call__(
        self, texts: list[str] | None, token_ids: list[list[int]] | None, prompt: str | None, truncate: bool
    ) -> list[list[int]]:
        """Token ids for texts (with the prompt), or the client's own ids checked; cut at the input limit
        where `truncate`, else InputError for an input over it."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._token_ids, texts, token_ids, prompt, truncate)

    def close(self) -> None:
        self.pool.shutdown()

    def _token_ids(self, texts, token_ids, prompt, truncate) -> list[list[int]]:
        if token_ids is not None:
            return self._checked(token_ids, truncate)
        return self._tokenized(texts, prompt, truncate)

    def _checked(self, token_ids: list[list[int]], truncate: bool) -> list[list[int]]:
        for index, seq in enumerate(token_ids):
            if not all(0 <= t < self.vocab_size for t in seq):
                raise InputError(f"Input {index} has token ids outside the vocabulary (0 to {self.vocab_size - 1}).")
            self._check_length(index, seq, truncate)
        return [seq[: self.limit] for seq in token_ids]

    def _tokenized(self, texts: list[str], prompt: str | None, truncate: bool) -> list[list[int]]:
        # One token past the limit tells "too long" apart from "exactly at the limit".
        over = self.limit + 1
        texts = [clip_text(text, self.limit, lambda prefix: self._count(prefix, prompt, over)) for text in texts]
        ids = self._tokenize(texts, prompt, over)
        too_long = [i for i, seq in enumerate(ids) if self._check_length(i, seq, truncate)]
        if too_long:  # tokenized again at the limit: special tokens at the end stay, as in encode()
            for i, seq in zip(too_long, self._tokenize([texts[i] for i in too_long], prompt, self.limit), strict=True):
                ids[i] = seq
        return ids

    def _check_length(self, index: int, seq: list[int], truncate: bool) -> bool:
        if len(seq) > self.limit and not truncate:
            raise InputError(f"Input {index} has more than {self.limit} tokens and truncate is false.")
        return len(seq) > self.limit

    def _count(self, text: str, prompt: str | None, max_length: int) -> int:
        return self.embedder.texts.count(text, prompt, max_length)

    def _tokenize(self, texts: list[str], prompt: str | None, max_length: int) -> list[list[int]]:
        """encode()'s tokenization (prompt, special tokens, no-token check) at a length limit."""
        try:
            return self.embedder.tokenize(texts, prompt, max_length)
        except ValueError as error:
            raise InputError(str(error)) from error
