"""Long documents without silent truncation: what a chunking asks for (`Chunking`), what a document's chunks are
(`Chunks`), and how a document's one tokenization is cut into the sequences that run (`plan`).

A chunk is `tokens` consecutive text tokens of the document's one tokenization (neighbours share `overlap`), run
as head (special tokens and the prompt) + its tokens + tail, so the first chunk is exactly what truncation keeps.
With `late=True` the document runs in windows of up to `context` tokens holding whole chunks, and each chunk's
vector is the pooling over its own span of the window's token embeddings (models/chunked.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from st_fastbackend.modules.tokenizer import DocumentTokens

AGGREGATES = ("mean", "max", "first", None)


@dataclass(frozen=True)
class Chunking:
    """tokens: text tokens per chunk (default: what max_seq_length leaves after special tokens and the prompt);
    overlap: tokens shared by neighbouring chunks; aggregate: "mean" (weighted by the chunks' token counts),
    "max", "first" or None (one vector per chunk, encode_chunks); late: late chunking, the document run in
    windows of `context` tokens (default: the model's positions) and each chunk pooled over its span."""

    tokens: int | None = None
    overlap: int = 0
    aggregate: str | None = "mean"
    late: bool = False
    context: int | None = None

    def __post_init__(self) -> None:
        for name in ("tokens", "context"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"Chunking.{name} must be a positive integer or None, got {value!r}.")
        if not _is_int(self.overlap) or self.overlap < 0:
            raise ValueError(f"Chunking.overlap must be a non-negative integer, got {self.overlap!r}.")
        if self.tokens is not None and self.overlap >= self.tokens:
            raise ValueError(
                f"Chunking.overlap ({self.overlap}) must be smaller than Chunking.tokens ({self.tokens})."
            )
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"Chunking.aggregate must be one of {AGGREGATES}, got {self.aggregate!r}.")
        if not isinstance(self.late, bool):
            raise ValueError(f"Chunking.late must be True or False, got {self.late!r}.")
        if self.context is not None and not self.late:
            raise ValueError("Chunking.context is the window of late chunking: give it with late=True.")

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> Chunking:
        """From a request's or a job's JSON object; an unknown field is an error that names it."""
        known = {field.name for field in fields(cls)}
        if unknown := sorted(set(options) - known):
            raise ValueError(f"Unknown chunking field {unknown[0]!r}; the fields are {sorted(known)}.")
        return cls(**options)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Chunks:
    """One document's chunks: embeddings [k, dim] (as encode() types them), and for each chunk its (start, end)
    characters in the text and (start, end) text tokens (counted from 0, special tokens and prompt excluded)."""

    embeddings: Any
    char_spans: list[tuple[int, int]]
    token_spans: list[tuple[int, int]]


def cut(num_tokens: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """Token spans of `size` tokens, each starting `size - overlap` after the previous one, the last one ending at
    the document's end; a document without text tokens is one empty chunk (what plain encode embeds)."""
    spans, start = [], 0
    while True:
        end = min(start + size, num_tokens)
        spans.append((start, end))
        if end == num_tokens:
            return spans
        start += size - overlap


@dataclass
class Window:
    """One sequence to run: the document `doc`'s tokens from `start`, holding chunks `chunks` (their indices in the
    document's chunk list); `sequence` is head + the window's tokens + tail."""

    doc: int
    start: int
    chunks: list[int]
    sequence: list[int]


def chunk_size(chunking: Chunking, document: DocumentTokens, max_seq_length: int) -> int:
    """Text tokens per chunk: as asked, else what max_seq_length leaves; a chunk never exceeds max_seq_length."""
    room = max_seq_length - len(document.head) - len(document.tail)
    size = chunking.tokens if chunking.tokens is not None else room
    if size < 1 or size > room:
        raise ValueError(
            f"Chunking.tokens={size} does not fit max_seq_length {max_seq_length} with the "
            f"{len(document.head) + len(document.tail)} special and prompt tokens every chunk repeats "
            f"(at most {room})."
        )
    if chunking.overlap >= size:
        raise ValueError(f"Chunking.overlap ({chunking.overlap}) must be smaller than the chunk size ({size}).")
    return size


def windows(doc: int, document: DocumentTokens, spans: list[tuple[int, int]], room: int | None) -> list[Window]:
    """The sequences that run: one per chunk (room None), or windows of at most `room` text tokens holding as many
    consecutive whole chunks as fit (late chunking)."""
    out: list[Window] = []
    for index, (start, end) in enumerate(spans):
        if room is not None and out and end - out[-1].start <= room:
            out[-1].chunks.append(index)
            continue
        out.append(Window(doc, start, [index], []))
    for window in out:
        end = spans[window.chunks[-1]][1]
        window.sequence = document.head + document.ids[window.start : end] + document.tail
    return out


def char_spans(document: DocumentTokens, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each chunk's characters: from its first token's start to its last token's end ((0, 0) for no token)."""
    return [(document.spans[s][0], document.spans[e - 1][1]) if e > s else (0, 0) for s, e in spans]
