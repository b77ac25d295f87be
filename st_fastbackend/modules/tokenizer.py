"""Reading only the start of a long text when it will be truncated anyway.

A tokenizer reads the whole text before it truncates: an 8 MB string costs seconds even with a limit of
256 tokens. `clip_text` finds a prefix of the text that already holds more than the limit's tokens, cut
where whitespace begins, so the truncated token ids are those of the full text.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_WHITESPACE = re.compile(r"\s")


def clip_text(text: str, max_tokens: int, count: Callable[[str], int], chars_per_token: int = 8) -> str:
    """A prefix of `text` whose first `max_tokens` tokens are the text's own, or `text` itself.

    `count(prefix)` is the number of tokens of `prefix` as the caller tokenizes it (with its prompt and
    special tokens) truncated at `max_tokens + 1`. Pre-tokenizers split at whitespace, so a prefix that
    ends where whitespace begins has the full text's tokens, except maybe its last one (a trailing-space
    rule); a prefix with more than `max_tokens` tokens therefore truncates to the full text's first
    `max_tokens`. The prefix grows 4x per try from `chars_per_token * max_tokens` characters, so the
    work stays proportional to what is kept; a text with no whitespace to cut at is returned whole.
    """
    chars = chars_per_token * max_tokens
    while chars < len(text):
        prefix = cut_at_whitespace(text, chars)
        if prefix and count(prefix) > max_tokens:
            return prefix
        chars *= 4
    return text


def cut_at_whitespace(text: str, max_chars: int) -> str:
    """The longest prefix of at most `max_chars` characters that ends a word: its last character is not
    whitespace and the next one is ("" if there is none)."""
    window = text[max_chars::-1]  # the first max_chars + 1 characters, backwards
    found = _WHITESPACE.search(window)
    return text[: len(window) - 1 - found.start()].rstrip() if found else ""
