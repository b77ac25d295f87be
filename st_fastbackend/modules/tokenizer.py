"""Tokenizer checks and repairs around transformers' tokenizers: inputs that are not strings, folders
without tokenizer files, do_lower_case, e5-mistral's BOS/EOS flags; and reading only the start of a long
text when it will be truncated anyway.

A tokenizer reads the whole text before it truncates: an 8 MB string costs seconds even with a limit of
256 tokens, and a text without whitespace holds as many tokens as it has characters (1.95 million `!` are
1.95 million WordPiece tokens, gigabytes of them). `clip_text` finds a prefix of the text that already holds
more than the limit's tokens, cut where whitespace begins or where the tokenizer's last word begins, so the
truncated token ids are those of the full text, and never reads more than a bound of characters.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from st_fastbackend.modules.inputs import naming_lone_surrogates

logger = logging.getLogger(__name__)

_WHITESPACE = re.compile(r"\s")


def clip_text(
    text: str,
    max_tokens: int,
    count: Callable[[str], int],
    chars_per_token: int = 8,
    *,
    max_chars: int,
    word_start: Callable[[str], int] | None = None,
) -> str | None:
    """A prefix of `text` whose first `max_tokens` tokens are the text's own; `text` itself when it has at
    most `max_chars` characters; None when its first `max_chars` characters show no such prefix (the text
    is then too long to truncate within the bound). No callback ever sees more than `max_chars` characters.

    `count(prefix)` is the number of tokens of `prefix` as the caller tokenizes it (with its prompt and
    special tokens) truncated at `max_tokens + 1`; `word_start(prefix)` is where the tokenizer's last word
    of `prefix` begins (`last_word_start`). A tokenizer works word by word, so a prefix cut where a word
    begins (where whitespace begins, or where the pre-tokenizer starts its last word) has the full text's
    tokens up to that word; one with more than `max_tokens` tokens therefore truncates to the full text's
    first `max_tokens`. The prefix grows 4x per try from `chars_per_token * max_tokens` characters, so the
    work stays proportional to what is kept.
    """
    chars = chars_per_token * max_tokens
    while True:
        window = min(chars, max_chars)
        if window >= len(text):
            return text
        if (prefix := cut_at_whitespace(text, window)) and count(prefix) > max_tokens:
            return prefix
        if word_start is not None:  # no whitespace late enough, as in "!!!...": cut at the last word
            prefix = text[: word_start(text[:window])]
            if count(prefix) > max_tokens:
                return prefix
        if window == max_chars:
            return None
        chars *= 4


def cut_at_whitespace(text: str, max_chars: int) -> str:
    """The longest prefix of at most `max_chars` characters that ends a word: its last character is not
    whitespace and the next one is ("" if there is none)."""
    window = text[max_chars::-1]  # the first max_chars + 1 characters, backwards
    found = _WHITESPACE.search(window)
    return text[: len(window) - 1 - found.start()].rstrip() if found else ""


def last_word_start(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """Where the last word of `text` begins, as the tokenizer's pre-tokenizer splits it (BERT's splits at
    every punctuation mark, so "!!!" is three words); 0 for a text of one word or of no token. Words before
    it are tokenized as in any longer text that starts with `text`."""
    encoded = tokenizer(text, add_special_tokens=False, truncation=False, return_offsets_mapping=True,
                        return_attention_mask=False, return_token_type_ids=False)  # fmt: skip
    words = encoded.word_ids()
    if not words:
        return 0
    first = words.index(words[-1])  # the first token of the last word
    return encoded["offset_mapping"][first][0]


# The files one of transformers' tokenizers is built from: a tokenizer.json, or a vocabulary of its own.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.txt",
                   "vocab.json")  # fmt: skip


def check_tokenizer_files(folder: Path) -> None:
    """transformers 5 builds a 5-token tokenizer for a folder without tokenizer files, and every text then
    embeds to nearly the same vector; refuse such a folder instead."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
            "copy the model's tokenizer into the folder."
        )


def lowercase_input(tokenizer: PreTrainedTokenizerBase) -> None:
    """do_lower_case, as sentence-transformers applies it: a Lowercase normalizer in front."""
    from tokenizers.normalizers import Lowercase, Sequence

    normalizer = tokenizer.backend_tokenizer.normalizer
    tokenizer.backend_tokenizer.normalizer = Lowercase() if normalizer is None else Sequence([Lowercase(), normalizer])


def missing_special_tokens(folder: Path, tokenizer: PreTrainedTokenizerBase) -> tuple[bool, bool]:
    """(add BOS, add EOS): what tokenizer_config.json asks for and the loaded tokenizer does not add.

    e5-mistral-7b-instruct sets "add_eos_token": true while its tokenizer.json post-processor adds
    only <s>; transformers >= 5 follows tokenizer.json and drops the </s> that last-token pooling
    reads. The model card tokenizes to max_length - 1 and appends </s>; so do we.
    """
    asked = tokenizer_config(folder)
    probe = tokenizer("a")["input_ids"]
    add_bos = asked.get("add_bos_token") is True and tokenizer.bos_token_id not in (None, probe[0])
    add_eos = asked.get("add_eos_token") is True and tokenizer.eos_token_id not in (None, probe[-1])
    for name, missing in (("BOS", add_bos), ("EOS", add_eos)):
        if missing:
            logger.info(
                f"tokenizer_config.json asks for {name} but the tokenizer does not add it: the fast backend adds it."
            )
    return add_bos, add_eos


def keep_special_token_flags(source: Path, target: Path) -> None:
    """transformers >= 5 drops add_bos_token/add_eos_token when saving a tokenizer; write them back."""
    flags = {k: v for k, v in tokenizer_config(source).items() if k in ("add_bos_token", "add_eos_token")}
    if flags:
        path = target / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **flags}, indent=2))


def tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


class NoTokensError(ValueError):
    """A text that gives no token at all (possible where the tokenizer adds no special token): `index` is its
    position in the texts given."""

    def __init__(self, index: int, text: str) -> None:
        super().__init__(f"Input {index} ({text[:80]!r}) has no tokens; there is nothing to embed.")
        self.index, self.text = index, text

    def about(self, row: str) -> str:
        """The corpus jobs' line for it, `row` naming the text's row (by its id, or its place in a batch)."""
        return f"{row} cannot be embedded: its text {self.text[:80]!r} has no tokens"


@dataclass(frozen=True)
class DocumentTokens:
    """A document's one tokenization: `head` (BOS/CLS and the prompt) + `ids` (the text's tokens, `spans` their
    (start, end) characters in the text) + `tail` (SEP/EOS), as an untruncated encode() would give them."""

    head: list[int]
    ids: list[int]
    tail: list[int]
    spans: list[tuple[int, int]]


@dataclass(frozen=True)
class WholeTokens:
    """A text's tokens: ids, which are special (1), each one's (start, end) characters ((0, 0) for one added), and
    the tokenizer's word each belongs to (None for a special token)."""

    ids: list[int]
    special: list[int]
    offsets: list[tuple[int, int]]
    words: list[int | None]


# The prompts' tokens kept, least recently used dropped first: a server sees any number of distinct prompts.
PROMPT_CACHE_ENTRIES = 256
PROMPT_CACHE_BYTES = 16 * 2**20


class TextTokenizer:
    """Texts -> token ids as the model expects them: the prompt first, BOS/EOS as tokenizer_config.json
    asks, truncated to `max_length` (default max_seq_length, the tokenizer's model_max_length), no padding.
    `encode` is the one way text enters the fast backend (encode(), the server, the corpus job).

    `lock` is held around the tokenizer's calls for `encode`, `count` and `prompt_ids` (and by the server's
    serve/tokens.py around its own): a Hugging Face fast tokenizer keeps its truncation setting in shared
    state, and a prompt dropped from the cache is measured again on whichever thread asks for it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, add_bos: bool, add_eos: bool) -> None:
        self.tokenizer, self.add_bos, self.add_eos = tokenizer, add_bos, add_eos
        self.lock = threading.Lock()
        self._prompts: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._prompt_bytes = 0
        self._prompts_lock = threading.Lock()  # not `lock`: a lookup never waits for another thread's texts

    def __getstate__(self) -> dict:
        """Pickled (multi-process pools) without its locks, which cannot be pickled; the copy makes its own."""
        return {k: v for k, v in self.__dict__.items() if k not in ("lock", "_prompts_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, lock=threading.Lock(), _prompts_lock=threading.Lock())

    def encode(
        self, texts: list[str], prompt: str | None = None, max_length: int | None = None, first_index: int = 0
    ) -> list[list[int]]:
        """Token ids of prompt + text for each text; an input without any token is an error naming it
        (as `first_index` + its position, the caller's numbering)."""
        with naming_lone_surrogates(texts, first_index, prompt):
            sequences = self._token_ids([prompt + text for text in texts] if prompt else texts, max_length)
        for index, ids in enumerate(sequences):
            if not ids:
                raise NoTokensError(first_index + index, texts[index])
        return sequences

    def count(self, text: str, prompt: str | None, max_length: int) -> int:
        """Tokens of prompt + text, counted up to `max_length`."""
        return len(self._token_ids([prompt + text if prompt else text], max_length)[0])

    def own_ids(self, text: str, max_length: int | None = None) -> list[int]:
        """The text's own token ids, without special tokens (what a pair holds of it), its first `max_length`."""
        cut = {"truncation": True, "max_length": max_length} if max_length is not None else {"truncation": False}
        with self.lock:
            return self.tokenizer(text, add_special_tokens=False, verbose=False, return_attention_mask=False,
                                  return_token_type_ids=False, **cut)["input_ids"]  # fmt: skip

    def word_start(self, text: str) -> int:
        """Where the tokenizer's last word of `text` begins (last_word_start), under the lock."""
        with self.lock:
            return last_word_start(self.tokenizer, text)

    def prompt_length(self, prompt: str) -> int:
        return len(self.prompt_ids(prompt))

    def prompt_ids(self, prompt: str) -> tuple[int, ...]:
        """The prompt's tokens as texts begin with them: without a trailing special token (as
        sentence-transformers counts them). Measured once and kept while among the PROMPT_CACHE_ENTRIES
        most recently used, within PROMPT_CACHE_BYTES (the latest always kept)."""
        with self._prompts_lock:
            if (kept := self._prompts.get(prompt)) is not None:
                self._prompts.move_to_end(prompt)
                return kept
        with naming_lone_surrogates([], prompt=prompt):
            ids = self._token_ids([prompt], None)[0]
        trailing_special = bool(ids) and ids[-1] in self.tokenizer.all_special_ids
        kept = tuple(ids[: len(ids) - trailing_special])
        with self._prompts_lock:
            if prompt not in self._prompts:
                self._prompts[prompt] = kept
                self._prompt_bytes += _size(prompt, kept)
            while len(self._prompts) > 1 and (
                len(self._prompts) > PROMPT_CACHE_ENTRIES or self._prompt_bytes > PROMPT_CACHE_BYTES
            ):
                dropped, ids = self._prompts.popitem(last=False)
                self._prompt_bytes -= _size(dropped, ids)
        return kept

    def document(self, text: str, prompt: str | None = None) -> DocumentTokens:
        """prompt + text tokenized whole, without truncation, split into what every chunk of it repeats (special
        tokens and the prompt) and the text's own tokens with their character spans in `text` (chunking)."""
        return self.split(self.whole(prompt + text if prompt else text), text, prompt)

    def split(self, whole: WholeTokens, text: str, prompt: str | None) -> DocumentTokens:
        """The tokens of prompt + text (`whole`) as document() gives them: head, the text's own, tail."""
        ids, special = whole.ids, whole.special
        end = len(ids)
        while end and special[end - 1]:
            end -= 1
        start = next((i for i in range(end) if not special[i]), end)
        if prompt:
            start = len(self.prompt_ids(prompt))
            if tuple(ids[:start]) != self.prompt_ids(prompt):  # the prompt's last token merged with the text's
                raise ValueError(f"The prompt {prompt[:80]!r} does not tokenize apart from the text {text[:80]!r}: "
                                 "its chunks cannot each begin with the prompt's own tokens.")  # fmt: skip
        shift = len(prompt or "")
        spans = [(max(0, a - shift), max(0, b - shift)) for a, b in whole.offsets[start:end]]
        return DocumentTokens(ids[:start], ids[start:end], ids[end:], spans)

    def whole(self, text: str, add_special_tokens: bool = True) -> WholeTokens:
        """`text` tokenized whole, untruncated; with special tokens, BOS/EOS as tokenizer_config.json asks (the
        ids encode() gives, before truncation)."""
        with self.lock:  # as encode(): the tokenizer's truncation setting is shared state
            encoded = self.tokenizer(text, add_special_tokens=add_special_tokens, truncation=False, verbose=False,
                                     return_offsets_mapping=True, return_special_tokens_mask=True,
                                     return_attention_mask=False, return_token_type_ids=False)  # fmt: skip
        bos = [self.tokenizer.bos_token_id] * (self.add_bos and add_special_tokens)
        eos = [self.tokenizer.eos_token_id] * (self.add_eos and add_special_tokens)
        return WholeTokens(
            bos + encoded["input_ids"] + eos,
            [1] * len(bos) + encoded["special_tokens_mask"] + [1] * len(eos),
            [(0, 0)] * len(bos) + encoded["offset_mapping"] + [(0, 0)] * len(eos),
            [None] * len(bos) + encoded.word_ids() + [None] * len(eos),
        )

    def _token_ids(self, texts: list[str], max_length: int | None) -> list[list[int]]:
        extra = int(self.add_bos) + int(self.add_eos)
        limit = {"max_length": (max_length or self.tokenizer.model_max_length) - extra} if extra or max_length else {}
        with self.lock:
            encoded = self.tokenizer(
                texts, truncation="longest_first", return_attention_mask=False, return_token_type_ids=False, **limit
            )["input_ids"]
        bos, eos = [self.tokenizer.bos_token_id] * self.add_bos, [self.tokenizer.eos_token_id] * self.add_eos
        return [bos + ids + eos for ids in encoded] if extra else encoded


def _size(prompt: str, ids: tuple[int, ...]) -> int:
    """Bytes a cached prompt holds, at most: the string, the tuple and an int object per token."""
    return sys.getsizeof(prompt) + sys.getsizeof(ids) + 32 * len(ids)
