"""A rerank request's pairs as CrossEncoder.predict() tokenizes them, each text read only as far as the cut needs.

predict() cuts a pair with truncation="longest_first" at max_length (modules/scoring.py longest_first), which looks
at a text's token count only while it is short, and at which text is longer once both are long. So each text is
read as /v1/embeddings reads an input (clip_text): a prefix cut where a word begins that holds more than max_length
of its own tokens, or the whole text where it holds fewer, never past `max_chars` characters (a text that cannot be
cut within them is a 400 naming the bound). A pair is then the first tokens longest_first keeps of each, joined by
the tokenizer's pair template: the ids encode_pairs gives the whole texts. One case asks for more: both texts over
max_length tokens and an odd budget, where the longer keeps the odd token. Which is longer is then counted (the
shorter whole, the longer only past the shorter's count), within the same bound, or the request is refused naming it.

With a chat template (Qwen3-Reranker) a pair is rendered and truncated as one sequence at max_length: the prefixes
go through encode_pairs as they are, each holding more than the max_length tokens the rendering keeps.

The query is read once per request, the documents a chunk of them per task of the request tokenizer's one thread,
so another request's tokenization waits for one chunk at most (serve/tokens.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import tokenizers
from packaging.version import Version

from st_fastbackend.engine.batch import Tokens
from st_fastbackend.modules.scoring import PackedScoringTransformer, longest_first
from st_fastbackend.modules.tokenizer import clip_text
from st_fastbackend.serve.errors import ApiError
from st_fastbackend.serve.tokens import SLACK, InputError, RequestTokenizer, max_text_chars

LONGEST_FIRST_SINCE = "0.23.3"  # the longest_first rule modules/scoring.py follows (pyproject.toml's serve extra)


@dataclass
class Read:
    """A text as far as it was read: `text` itself or a prefix of it cut where a word begins; `ids` its first own
    tokens, all of them (`exact`) or max_length + 1; `count` the whole text's, where they had to be counted."""

    whole: str
    text: str
    ids: list[int]
    exact: bool
    count: int | None = None


class PairReader:
    """What the request tokenizer's thread runs for a rerank request, on the model's first module."""

    def __init__(self, scoring: PackedScoringTransformer) -> None:
        if Version(tokenizers.__version__) < Version(LONGEST_FIRST_SINCE):
            raise RuntimeError(f"tokenizers {tokenizers.__version__}: the server cuts rerank pairs as tokenizers >= "
                               f"{LONGEST_FIRST_SINCE} does (0.23.2 cuts some differently); pip install "
                               "'st_fastbackend[serve]' brings it.")  # fmt: skip
        self.scoring, self.texts = scoring, scoring.texts
        self.max_length = scoring.tokenizer.model_max_length
        self.max_chars = max_text_chars(scoring.tokenizer, self.max_length)
        self.longest_token = max(map(len, scoring.tokenizer.get_vocab()))

    def read(self, text: str, what: str) -> Read:
        """The text's first max_length + 1 own tokens, from a prefix of at most max_chars characters."""
        counted: dict[str, list[int]] = {}  # the last prefix counted: its ids are the ones kept

        def count(prefix: str) -> int:
            counted.clear()
            counted[prefix] = self.texts.own_ids(prefix, self.max_length + 1)
            return len(counted[prefix])

        prefix = clip_text(text, self.max_length, count, max_chars=self.max_chars, word_start=self.texts.word_start)
        if prefix is None:
            raise InputError(f"{what} ({len(text):,} characters) cannot be cut at {self.max_length} tokens within "
                             f"its first {self.max_chars:,} characters: they hold too few tokens, or no word ends "
                             f"after {self.max_length} of them ({self._bound()}).")  # fmt: skip
        ids = counted[prefix] if prefix in counted else self.texts.own_ids(prefix, self.max_length + 1)
        return Read(text, prefix, ids, exact=len(ids) <= self.max_length)

    def pairs(self, query: Read, documents: list[str], first: int, field: str, truncate: bool) -> list[Tokens]:
        """The pairs of the query with documents `first`, `first + 1`, ... (named `field`[i] in errors)."""
        names = [f"{field}[{first + i}]" for i in range(len(documents))]
        read = [self.read(text, name) for text, name in zip(documents, names, strict=True)]
        if not truncate:
            for document, name in zip(read, names, strict=True):
                self._check_length(query, document, name)
        if self.scoring.pair_formatter is not None:
            return self.scoring.encode_pairs([(query.text, document.text) for document in read], None, first)
        return [self._joined(query, document, name) for document, name in zip(read, names, strict=True)]

    def _joined(self, query: Read, document: Read, what: str) -> Tokens:
        a, b, budget = len(query.ids), len(document.ids), self.scoring.pair_budget
        both_long = not (query.exact or document.exact)  # both counts are max_length + 1: which is longer is unknown
        first_longer = self._query_longer(query, document, what) if both_long and budget % 2 else a > b
        kept_a, kept_b = longest_first(a, b, budget, first_longer)
        ids = self.scoring.join_pair(query.ids[:kept_a], document.ids[:kept_b])
        if not ids:
            raise InputError(f"The query with {what} has no tokens; there is nothing to score.")
        return ids

    def _check_length(self, query: Read, document: Read, what: str) -> None:
        """truncate: false refuses a pair over max_length, naming its tokens (or that it has more than that)."""
        if not (query.exact and document.exact):
            raise self._too_long(what, f"more than {self.max_length}")
        if self.scoring.pair_formatter is not None:
            length = self.scoring.pair_lengths([(query.whole, document.whole)])[0]
        else:
            length = len(query.ids) + len(document.ids) + self.scoring.tokenizer.num_special_tokens_to_add(pair=True)
        if length > self.max_length:
            raise self._too_long(what, length)

    def _too_long(self, what: str, length: int | str) -> ApiError:
        return ApiError(413, f"{what} with the query is {length} tokens; the model takes {self.max_length} (truncate: "
                             "true cuts it).")  # fmt: skip

    def _query_longer(self, query: Read, document: Read, what: str) -> bool:
        """Whether the query holds more own tokens than the document, both holding more than max_length: one is
        counted whole (at most max_chars characters), the other only until it passes that count."""
        if (count := self._count(document)) is not None:
            return self._more_than(query, count, what)
        if (count := self._count(query)) is not None:
            return not self._more_than(document, count - 1, what)
        raise InputError(self._unknown(what))

    def _count(self, read: Read) -> int | None:
        """The whole text's own tokens, counted once, where it has at most max_chars characters."""
        if read.count is None and len(read.whole) <= self.max_chars:
            read.count = len(self.texts.own_ids(read.whole))
        return read.count

    def _more_than(self, read: Read, tokens: int, what: str) -> bool:
        if read.count is not None:
            return read.count > tokens
        count = lambda prefix: len(self.texts.own_ids(prefix, tokens + 1))  # noqa: E731
        prefix = clip_text(read.whole, tokens, count, max_chars=self.max_chars, word_start=self.texts.word_start)
        if prefix is None:
            raise InputError(self._unknown(what))
        return prefix is not read.whole or count(read.whole) > tokens

    def _unknown(self, what: str) -> str:
        return (f"The query and {what} both hold more than {self.max_length} tokens, and which holds more decides "
                f"where the pair is cut (truncation longest_first): that is not told within the {self.max_chars:,} "
                f"characters the server reads of a text ({self._bound()}).")  # fmt: skip

    def _bound(self) -> str:
        return f"{SLACK} x max_length {self.max_length} x {self.longest_token}, the vocabulary's longest token"


async def pair_ids(
    tokenizer: RequestTokenizer, reader: PairReader, query: str, documents: list[str], field: str, truncate: bool
) -> list[list[int]]:
    """Each (query, document) pair's token ids, on the request tokenizer's thread: the query read once, then a chunk
    of about CHUNK_CHARS characters of documents per task."""
    loop = asyncio.get_running_loop()
    read = await loop.run_in_executor(tokenizer.pool, reader.read, query, "The query")
    ids = []
    for first, chunk in tokenizer.chunks(documents, read.text):
        ids += await loop.run_in_executor(tokenizer.pool, reader.pairs, read, chunk, first, field, truncate)
    return ids
