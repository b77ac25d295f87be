"""What the fast backend takes as input, checked where it enters: texts (or pairs of texts, for a CrossEncoder), each
refused by the caller's index with a TypeError or ValueError that says what is wrong with it."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any


def check_texts(inputs: list) -> None:
    for index, text in enumerate(inputs):
        if not isinstance(text, str):
            raise TypeError(
                f"The fast backend embeds plain strings; input {index} is {kind_of(text)}. "
                'Text pairs and dict inputs are not supported by it; backend="torch" accepts them.'
            )


def kind_of(value: Any) -> str:
    """What an input that is not a text is, for an error naming it."""
    kinds = {dict: "a dict (multimodal input)", list: "a list (a pair of texts?)", tuple: "a tuple (a pair?)"}
    return "None" if value is None else kinds.get(type(value), f"{type(value).__name__} {str(value)[:40]!r}")


# JSON may escape half of a UTF-16 surrogate pair ("\ud800"), and a Python string may hold one; tokenizers refuse it
# with a TypeError ("TextEncodeInput must be Union[...]") that names neither the input nor the character.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str, what: str) -> str | None:
    """A sentence naming `what` and the code point of its first lone surrogate; None for valid Unicode."""
    if found := _LONE_SURROGATE.search(text):
        return f"{what} holds a lone surrogate (U+{ord(found.group()):04X}), which is not Unicode text."
    return None


@contextlib.contextmanager
def naming_lone_surrogates(inputs: list, first_index: int = 0, prompt: str | None = None) -> Iterator[None]:
    """Around a tokenizer call on `inputs` (texts, or pairs of texts) numbered from `first_index`: its TypeError for
    a lone surrogate becomes a ValueError naming the prompt or the input, and the code point. Looked for only once
    the tokenizer has refused: valid input is not scanned twice."""
    try:
        yield
    except TypeError:
        named = [(prompt, "The prompt")] if prompt else []
        for index, item in enumerate(inputs):
            named += [(text, f"Input {first_index + index}") for text in (item if isinstance(item, (list, tuple))
                                                                         else (item,))]  # fmt: skip
        if found := next(filter(None, (lone_surrogate(t, what) for t, what in named if isinstance(t, str))), None):
            raise ValueError(found) from None
        raise


def check_pairs(inputs: list) -> list[tuple[str, str]]:
    """Every input a pair of two texts; anything else a TypeError (not a pair, or not texts) or a ValueError (not
    two) naming the caller's index. Plain sentence-transformers refuses these too (a ValueError naming a type)."""
    for index, pair in enumerate(inputs):
        if not isinstance(pair, (list, tuple)):
            raise TypeError(f"Input {index} is {kind_of(pair)}; CrossEncoder scores pairs of two texts, "
                            "(query, document).")  # fmt: skip
        if len(pair) != 2:
            raise ValueError(f"Input {index} is a {type(pair).__name__} of length {len(pair)}; CrossEncoder scores "
                             "pairs of two texts.")  # fmt: skip
        for position, text in zip(("first", "second"), pair, strict=True):
            if not isinstance(text, str):
                raise TypeError(f"Input {index}: its {position} element is {kind_of(text)}, not a text; the fast "
                                "backend scores pairs of two texts.")  # fmt: skip
    return inputs
