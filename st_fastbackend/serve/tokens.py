"""A request's token ids, computed on a thread of their own: off the event loop, and off the worker that
runs the model. One thread, because a Hugging Face fast tokenizer keeps its truncation setting in shared
state and must not run in two threads at once. What one request may cost it is bounded twice:

- no text is read past `max_chars` characters (`max_text_chars`), with or without whitespace in it;
- a request's texts go to the thread in chunks of about CHUNK_CHARS characters, each chunk its own task.
  The thread runs tasks in the order they come, so another request's tokenization waits for one chunk of
  this one at most (milliseconds), not for all of it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from st_fastbackend.embedder import Embedder
from st_fastbackend.modules.long_text import whole_reason
from st_fastbackend.modules.tokenizer import NoTokensError, WholeTokens, clip_text

logger = logging.getLogger(__name__)
_WORD = re.compile(r"(?<=\s)\S")  # where a word begins after whitespace
_SPACE = re.compile(r"\s")
_FIRST_WORD = re.compile(r"\s*\S*")


# Characters tokenized per task. At the worst rate measured (a text of one WordPiece token per character,
# ~3 us a character in all-MiniLM-L6-v2's tokenizer on the 2-core EPYC) a chunk takes under 0.1 s.
CHUNK_CHARS = 32_768
# A token covers at most the vocabulary's longest token of a text; whitespace between tokens and the word a
# cut leaves out are allowed three times as much again.
SLACK = 4


class InputError(ValueError):
    """The request's own fault (too long, no tokens, ids outside the vocabulary): answered with 400."""


def max_text_chars(tokenizer, max_input_tokens: int) -> int:
    """The characters of an input the server reads at most: SLACK x max_input_tokens x the vocabulary's
    longest token (18 characters for all-MiniLM-L6-v2: 18,432 characters at 256 tokens)."""
    return SLACK * max_input_tokens * max(map(len, tokenizer.get_vocab()))


class RequestTokenizer:
    def __init__(self, embedder: Embedder, max_input_tokens: int):
        self.embedder = embedder
        self.limit = max_input_tokens
        self.vocab_size = embedder.vocab_size
        self.longest_token = max(map(len, embedder.texts.tokenizer.get_vocab()))
        self.max_chars = max_text_chars(embedder.texts.tokenizer, max_input_tokens)
        # Characters of a chunked text tokenized per task (modules/long_text.py), or None: each text whole, in one
        if reason := whole_reason(embedder.texts):
            logger.warning(f"Chunked texts are tokenized whole, each in one task of the tokenizer's thread: {reason}.")
        self.piece_chars = None if reason else CHUNK_CHARS
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def __call__(
        self, texts: list[str] | None, token_ids: list[list[int]] | None, prompt: str | None, truncate: bool,
        keep_end: bool = False,
    ) -> list[list[int]]:  # fmt: skip
        """Token ids for texts (with the prompt), or the client's own ids checked; cut at the input limit
        where `truncate`, else InputError for an input over it. `keep_end`: a cut input keeps its special
        tokens and the prompt, and the last of its own tokens that fit (text-embeddings-inference's
        truncation_direction "Left", Cohere's truncate "START")."""
        loop = asyncio.get_running_loop()
        if token_ids is not None:
            return await loop.run_in_executor(self.pool, self._checked, token_ids, truncate, keep_end)
        if prompt and len(prompt) > self.max_chars:  # never truncated: pooling and prefix use all its tokens
            raise InputError(f"The prompt has {len(prompt):,} characters; the limit is {self.max_chars:,}"
                             f" ({self.bound()}).")  # fmt: skip
        if prompt and (alone := await loop.run_in_executor(self.pool, self._prompt_alone, prompt, truncate)):
            if keep_end:
                raise InputError(f"The prompt alone has more than {self.limit} tokens: keeping the end of an input "
                                 "leaves no room for it.")  # fmt: skip
            return [list(alone) for _ in texts]
        ids = []
        for first, chunk in self.chunks(texts, prompt):
            ids += await loop.run_in_executor(self.pool, self._tokenized, chunk, prompt, truncate, first, keep_end)
        return ids

    def close(self) -> None:
        self.pool.shutdown()

    def bound(self) -> str:
        return f"{SLACK} x --max-input-tokens {self.limit} x {self.longest_token}, the vocabulary's longest token"

    def chunks(self, texts: list[str], prompt: str | None) -> Iterator[tuple[int, list[str]]]:
        """(position of the first, texts) with about CHUNK_CHARS characters to tokenize each."""
        first, size = 0, 0
        for index, text in enumerate(texts):
            if index > first and size >= CHUNK_CHARS:
                yield first, texts[first:index]
                first, size = index, 0
            size += min(len(text), self.max_chars) + len(prompt or "")
        yield first, texts[first:]

    def _checked(self, token_ids: list[list[int]], truncate: bool, keep_end: bool = False) -> list[list[int]]:
        for index, seq in enumerate(token_ids):
            if not all(0 <= t < self.vocab_size for t in seq):
                raise InputError(f"Input {index} has token ids outside the vocabulary (0 to {self.vocab_size - 1}).")
            self._check_length(index, seq, truncate)
        return [seq[-self.limit :] if keep_end else seq[: self.limit] for seq in token_ids]

    def _prompt_alone(self, prompt: str, truncate: bool) -> list[int] | None:
        """The token ids of every input when the prompt alone has more than the limit's tokens before its
        last word (which an input may continue): computed once for the request. None otherwise."""
        before_last = prompt[: self._word_start(prompt)]
        if self._count(before_last, None, self.limit + 1) <= self.limit:
            return None
        if not truncate:
            raise InputError(f"The prompt alone has more than {self.limit} tokens and truncate is false.")
        return self._tokenize([before_last], None, self.limit)[0]

    def _tokenized(
        self, texts: list[str], prompt: str | None, truncate: bool, first: int, keep_end: bool = False
    ) -> list[list[int]]:
        # One token past the limit tells "too long" apart from "exactly at the limit".
        over = self.limit + 1
        clipped = [self._clipped(first + i, text, prompt) for i, text in enumerate(texts)]
        ids = self._tokenize(clipped, prompt, over, first)
        too_long = [i for i, seq in enumerate(ids) if self._check_length(first + i, seq, truncate)]
        if too_long and keep_end:
            for i in too_long:
                ids[i] = self._end_kept(first + i, texts[i], prompt)
        elif too_long:  # tokenized again at the limit: special tokens at the end stay, as in encode()
            again = self._tokenize([clipped[i] for i in too_long], prompt, self.limit, first)
            for i, seq in zip(too_long, again, strict=True):
                ids[i] = seq
        return ids

    def _end_kept(self, index: int, text: str, prompt: str | None) -> list[int]:
        """An over-long input cut from its start: its leading special tokens and the prompt's, then the last of
        its own tokens that fit, then its trailing special tokens. Without a prompt these are the ids of Hugging
        Face's truncation_side="left". Of a text over max_chars characters only the end is read, from a word on:
        the tokens after that word are the whole text's, as each tokenizer here splits words at whitespace."""
        prompt, texts = prompt or "", self.embedder.texts
        settled = 0  # the tokens starting at character `settled` on are the whole text's
        if len(text) > self.max_chars:
            begin = _WORD.search(text, len(text) - self.max_chars)
            if (gap := begin and _SPACE.search(text, begin.start())) is None:
                raise InputError(f"Input {index} ({len(text):,} characters): no word begins in its last "
                                 f"{self.max_chars:,} characters to cut it at ({self.bound()}).")  # fmt: skip
            settled = len(prompt) + gap.start() - begin.start()
            # How the whole text begins: the prompt's last token may merge with its first word
            start = texts.whole(prompt + _FIRST_WORD.match(text, 0, self.max_chars).group())
            whole = texts.whole(prompt + text[begin.start() :])
        else:
            start = whole = texts.whole(prompt + text)
        head = start.ids[: self._head_length(start, prompt)]
        ids, end = whole.ids, len(whole.ids)
        while end and whole.special[end - 1]:
            end -= 1
        room = self.limit - len(head) - (len(ids) - end)
        first = next((i for i in range(len(head), end) if whole.offsets[i][0] >= settled), end)
        if room < 1 or end - first < room:
            raise InputError(f"Input {index} cannot keep its last {max(room, 0)} tokens within the last "
                             f"{self.max_chars:,} characters it is read in ({self.bound()}).")  # fmt: skip
        return head + ids[end - room :]

    def _head_length(self, tokens: WholeTokens, prompt: str) -> int:
        """Its leading special tokens and the prompt's own (the prompt's last may merge with the text's first)."""
        lead = next((i for i, special in enumerate(tokens.special) if not special), len(tokens.ids))
        if not prompt:
            return lead
        ids, own = tokens.ids, self.embedder.texts.prompt_ids(prompt)
        return max(lead, next((i for i, (a, b) in enumerate(zip(ids, own, strict=False)) if a != b), len(own)))

    def _clipped(self, index: int, text: str, prompt: str | None) -> str:
        """The text, or a prefix of it with the same first `limit` tokens; InputError if none is found in
        its first max_chars characters."""
        offset = len(prompt or "")

        def word_start(prefix: str) -> int:
            return max(0, self._word_start((prompt or "") + prefix) - offset)

        count = lambda prefix: self._count(prefix, prompt, self.limit + 1)  # noqa: E731
        clipped = clip_text(text, self.limit, count, max_chars=self.max_chars, word_start=word_start)
        if clipped is None:
            raise InputError(
                f"Input {index} ({len(text):,} characters) cannot be cut at {self.limit} tokens within its first "
                f"{self.max_chars:,} characters: they hold too few tokens, or no word ends after {self.limit} of "
                f"them. The server reads at most {self.max_chars:,} characters of an input ({self.bound()})."
            )
        return clipped

    def _check_length(self, index: int, seq: list[int], truncate: bool) -> bool:
        if len(seq) > self.limit and not truncate:
            raise InputError(f"Input {index} has more than {self.limit} tokens and truncate is false.")
        return len(seq) > self.limit

    def _word_start(self, text: str) -> int:
        return self.embedder.texts.word_start(text)  # locked: the worker may measure a prompt meanwhile

    def _count(self, text: str, prompt: str | None, max_length: int) -> int:
        return self.embedder.texts.count(text, prompt, max_length)

    def _tokenize(self, texts: list[str], prompt: str | None, max_length: int, first: int = 0) -> list[list[int]]:
        """encode()'s tokenization (prompt, special tokens, no-token check) at a length limit; `first`
        numbers the texts in errors."""
        try:
            return self.embedder.tokenize(texts, prompt, max_length)
        except NoTokensError as error:
            raise InputError(str(NoTokensError(first + error.index, error.text))) from error
        except ValueError as error:
            raise InputError(str(error)) from error
