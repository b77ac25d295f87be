"""A long text's one tokenization (TextTokenizer.document), read a piece at a time: the server's chunking reads a
request's texts in tasks of bounded work, letting other requests' tokenization in between, and stops reading once a
request holds more tokens than it may (serve/chunked.py).

A tokenizer tokenizes its words one by one (clip_text's premise, modules/tokenizer.py): the tokens of a string up to
where its last word begins are those of any longer text that starts with it. The same holds at a string's start
from its second word on; only its first word may be tokenized as a text's start is (a normalizer that prepends "▁",
a prefix space). So each piece after the first is tokenized from the start of the word before the one it continues
from, and keeps its tokens from that one up to where the piece's last word begins: together, the whole text's
tokens, with the same character spans. A tokenizer without a pre-tokenizer (Llama 2's) holds a piece as one word:
its pieces are cut where whitespace begins, as clip_text cuts such a text. The first piece is tokenized with the
prompt and the special tokens, as document() tokenizes the whole, and gives the head and tail every chunk repeats.

That premise is checked once per tokenizer (`whole_reason`): a pre-tokenizer that splits at whitespace makes it hold
by construction (the model runs on each word alone); without one, a BPE or Unigram model holds it where no token of
its vocabulary runs from a word into the whitespace after it (Llama 2's: "▁" begins a token, never ends one). A
tokenizer trained without a pre-tokenizer has such tokens ("w▁"), and RoBERTa's and GPT-2's trim the whitespace off
their tokens' spans, so that a span no longer tells where its word begins: their texts are read whole.
"""

from __future__ import annotations

import json
import re
import weakref

from tokenizers import Tokenizer

from st_fastbackend.modules.tokenizer import DocumentTokens, TextTokenizer, WholeTokens

_REASONS: weakref.WeakKeyDictionary[TextTokenizer, str | None] = weakref.WeakKeyDictionary()


def whole_reason(texts: TextTokenizer) -> str | None:
    """Why a text must be tokenized whole by this tokenizer (its words' tokens may depend on the words around
    them), or None where DocumentReader may read it a piece at a time. Decided once per tokenizer."""
    if texts not in _REASONS:
        backend = getattr(texts.tokenizer, "backend_tokenizer", None)
        _REASONS[texts] = _whole_reason(backend) if backend is not None else "it is not a Rust (fast) tokenizer"
    return _REASONS[texts]


def _whole_reason(backend: Tokenizer) -> str | None:
    if _trims_offsets(json.loads(backend.to_str()).get("post_processor")):
        return "its post-processor trims the whitespace off its tokens' spans (trim_offsets), hiding where words begin"
    if backend.pre_tokenizer is not None and len(backend.pre_tokenizer.pre_tokenize_str("a b")) > 1:
        return None
    model = type(backend.model).__name__
    if model not in ("BPE", "Unigram"):
        return f"no pre-tokenizer splits its words, and its {model} model reads a text as one word"
    spaces = set()
    for gap in (" ", "\n", "\t"):  # what whitespace becomes before the model sees it ("▁", "Ġ", "Ċ", itself)
        seen = backend.normalizer.normalize_str(f"a{gap}b") if backend.normalizer else f"a{gap}b"
        if backend.pre_tokenizer is not None:
            seen = "".join(piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(seen))
        if not (between := seen[seen.find("a") + 1 : seen.rfind("b")]):
            return f"no pre-tokenizer splits its words, and {gap!r} between two words is gone before its model"
        spaces.update(between)
    space = "".join(sorted(map(re.escape, spaces)))
    into = re.compile(f"[^{space}][{space}]")
    if crossing := next((token for token in backend.get_vocab(with_added_tokens=False) if into.search(token)), None):
        return (f"no pre-tokenizer splits its words, and its vocabulary has tokens that run from a word into the "
                f"whitespace after it ({crossing!r})")  # fmt: skip
    return None


def _trims_offsets(post_processor: dict | list | None) -> bool:
    """RoBERTa's and GPT-2's post-processors trim a token's span to its non-whitespace characters (" foo" -> "foo")."""
    if isinstance(post_processor, dict):
        return post_processor.get("trim_offsets") is True or any(map(_trims_offsets, post_processor.values()))
    return isinstance(post_processor, list) and any(map(_trims_offsets, post_processor))


class DocumentReader:
    """document(text, prompt), a piece of about `piece_chars` characters per step() (None: the whole text in one);
    a word (what the tokenizer tokenizes on its own) of more than `max_word_chars` characters is a ValueError, and so
    are pieces asked of a tokenizer that must read the text whole (whole_reason)."""

    def __init__(
        self, texts: TextTokenizer, text: str, prompt: str | None, piece_chars: int | None, max_word_chars: int
    ) -> None:
        if piece_chars is not None and (reason := whole_reason(texts)):
            raise ValueError(f"This tokenizer cannot read a text a piece at a time: {reason}.")
        piece_chars = piece_chars or max(len(text), 1)
        self.texts, self.text, self.prompt = texts, text, prompt
        self.piece_chars, self.max_word_chars = piece_chars, max_word_chars
        self.first: DocumentTokens | None = None  # the first piece's: head and tail
        self.ids: list[int] = []  # the text's own tokens read so far
        self.spans: list[tuple[int, int]] = []
        self.read_to = 0  # the tokens of the characters before it are read
        self.restart = 0  # where the next piece is tokenized from: a word start before read_to
        self.done = False

    def step(self) -> int:
        """Read the next piece; the characters it took the text on by."""
        before, window = self.read_to, self.piece_chars
        while not self.done and self.read_to == before:
            end = self.read_to + window
            if self.first is None:
                self._first_piece(end)
            else:
                self._next_piece(end)
            if self.read_to == before and not self.done:  # one word fills the window: take more of the text
                if window >= self.max_word_chars:
                    raise ValueError(f"a word (as the tokenizer splits words) of over {self.max_word_chars:,} "
                                     f"characters begins at character {before:,}, and a long text is read a piece "
                                     "at a time, cut where a word begins")  # fmt: skip
                window *= 2
        return self.read_to - before

    def document(self) -> DocumentTokens:
        first = self.first
        return DocumentTokens(first.head, self.ids, first.tail, self.spans)

    def _first_piece(self, end: int) -> None:
        text, prompt = self.text, self.prompt
        if end >= len(text):
            self.first = self.texts.document(text, prompt)
            self.ids, self.spans, self.read_to, self.done = self.first.ids, self.first.spans, len(text), True
            return
        string = prompt + text[:end] if prompt else text[:end]
        whole = self.texts.whole(string)
        piece = self.texts.split(whole, text[:end], prompt)
        own = len(piece.head)  # the index in `whole` of the text's first own token
        cut, restart = _last_words(whole, string, own, len(whole.ids) - len(piece.tail))
        if cut <= own:  # the piece holds one word of the text
            return
        self.first = piece
        self.ids, self.spans = piece.ids[: cut - own], piece.spans[: cut - own]
        self.read_to, self.restart = piece.spans[cut - own][0], piece.spans[restart - own][0]

    def _next_piece(self, end: int) -> None:
        start, last = self.restart, end >= len(self.text)
        whole = self.texts.whole(self.text[start:end], add_special_tokens=False)
        spans = [(a + start, b + start) for a, b in whole.offsets]
        keep = next((i for i, (a, _) in enumerate(spans) if a >= self.read_to), len(spans))
        if keep == len(spans) or spans[keep][0] != self.read_to:  # the premise failed: a boundary moved
            raise ValueError(f"its tokens from character {self.read_to:,} on differ when tokenized from character "
                             f"{start:,}: it cannot be read a piece at a time")  # fmt: skip
        ids = len(whole.ids)
        cut, restart = (ids, None) if last else _last_words(whole, self.text[start:end], keep, ids)
        if cut <= keep:
            return
        self.ids += whole.ids[keep:cut]
        self.spans += spans[keep:cut]
        if last:
            self.read_to, self.done = len(self.text), True
        else:
            self.read_to, self.restart = spans[cut][0], spans[restart][0]


def _last_words(whole: WholeTokens, string: str, first: int, end: int) -> tuple[int, int]:
    """Among tokens [first, end) of `string`: (the index of the first token of the last word, that of the word before
    it, or `first`); (first, first) where they hold one word. Without the tokenizer's words (no pre-tokenizer), where
    whitespace begins after a word stands for where a word begins."""
    words, offsets = whole.words, whole.offsets

    def at_whitespace(i: int) -> bool:
        char = offsets[i][0]
        return 0 < char < len(string) and string[char].isspace() and not string[char - 1].isspace()

    for begins in (lambda i: words[i] != words[i - 1], at_whitespace):
        found = []
        for i in range(end - 1, first, -1):
            if begins(i):
                found.append(i)
                if len(found) == 2:
                    break
        if found:
            return found[0], found[1] if len(found) == 2 else first
    return first, first
