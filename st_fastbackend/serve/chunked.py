"""/v1/embeddings with a `chunking` object (issue 31): each text cut into chunks on its one tokenization (on the
request tokenizer's thread), every chunk of the request one job of the batcher (the one packing schedule), then
each text's chunks aggregated (OpenAI's response shape) or returned as `chunks: [{embedding, text_span}]`.

Late chunking: the job's sequences are windows of consecutive whole chunks, as encode_chunks() makes them, each
with its chunks' spans; the worker pools each span of the window's token embeddings (the "late_chunks" output).
A window holds at most `chunking.context` tokens, by default the server's --max-input-tokens (and never more):
the same vectors as encode_chunks(chunking=Chunking(late=True, context=that)).

What a request may cost (issue 44): its texts are read a piece at a time (modules/long_text.py), a task of about
CHUNK_CHARS characters on the tokenizer's thread, so another request's tokenization waits for one task at most; and
its chunks' (or windows') tokens count against --max-request-tokens, a 413 as soon as the tokens read pass it, so a
text of millions of characters is refused after the first pieces past the bound, not tokenized whole. A tokenizer
whose tokens may cross words (long_text.whole_reason, logged at start) reads each text whole, in one task.
The worker runs the request's sequences as it runs any request's texts, a pack at a time among other requests'.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import torch

from st_fastbackend.models.chunked import aggregate
from st_fastbackend.models.chunking import Chunking, char_spans, chunk_size, cut, windows
from st_fastbackend.modules.long_text import DocumentReader
from st_fastbackend.modules.tokenizer import DocumentTokens, NoTokensError
from st_fastbackend.serve.errors import ApiError
from st_fastbackend.serve.tokens import CHUNK_CHARS, InputError, RequestTokenizer


def parse(options: dict) -> Chunking:
    try:
        return Chunking.from_dict(options)
    except (TypeError, ValueError) as error:
        raise ApiError(400, f"chunking: {error}") from error


async def chunk_plan(
    tokenizer: RequestTokenizer, texts: list[str], prompt: str | None, chunking: Chunking,
    check_tokens: Callable[..., None],
):  # fmt: skip
    """(every sequence's token ids, per text its token spans and character spans, and for late chunking per
    sequence its chunks' spans within it, else None), tokenized on the request tokenizer's one thread; a sequence
    holds at most the server's --max-input-tokens. `check_tokens` (serve/endpoints.py's Call.check_tokens) bounds the
    tokens read so far (413 past --max-request-tokens); the sequences' own are bounded when they go to the worker."""
    limit = tokenizer.limit
    if chunking.late and (chunking.context or limit) > limit:
        raise InputError(f"chunking.context={chunking.context} is more than the server's {limit} input tokens.")
    late = replace(chunking, context=chunking.context or limit) if chunking.late else None
    loop = asyncio.get_running_loop()
    readers = [DocumentReader(tokenizer.embedder.texts, text, prompt, tokenizer.piece_chars, tokenizer.max_chars)
               for text in texts]  # fmt: skip
    while readers and not readers[-1].done:
        await loop.run_in_executor(tokenizer.pool, _read_some, readers, tokenizer.bound())
        check_tokens(sum(_tokens_at_least(reader) for reader in readers), "tokens of chunks", at_least=True)

    def plan():
        sequences, found, within = [], [], []
        for index, reader in enumerate(readers):
            document = reader.document()
            if not (document.head or document.ids or document.tail):
                raise InputError(str(NoTokensError(index, texts[index])))
            try:
                spans = cut(len(document.ids), chunk_size(chunking, document, limit), chunking.overlap)
                room = tokenizer.embedder.late_room(late, document, limit) if late else None
            except ValueError as error:
                raise InputError(f"chunking: {error}") from error
            for window in windows(index, document, spans, room):
                sequences.append(window.sequence)
                head = len(document.head)
                within.append([(head + spans[c][0] - window.start, head + spans[c][1] - window.start)
                               for c in window.chunks])  # fmt: skip
            found.append((spans, char_spans(document, spans)))
        return sequences, found, within if late else None

    return await loop.run_in_executor(tokenizer.pool, plan)


def _read_some(readers: list[DocumentReader], bound: str) -> None:
    """Pieces of the texts not yet read, in order, until about CHUNK_CHARS characters are read (one task); `bound`
    names the characters a word may hold."""
    read = 0
    for index, reader in enumerate(readers):
        while not reader.done and read < CHUNK_CHARS:
            try:
                read += max(reader.step(), 1)
            except ValueError as error:  # a prompt merging into the text, or no word ends within the bound
                raise InputError(f"chunking: input {index} ({len(reader.text):,} characters): {error} (the most "
                                 f"a word may hold: {bound}).") from error  # fmt: skip
        if read >= CHUNK_CHARS:
            return


def _tokens_at_least(reader: DocumentReader) -> int:
    """What the text's sequences hold at least, from what is read of it: each of its tokens once (chunks overlap,
    windows do not), in one sequence or more, each with the special and prompt tokens."""
    first: DocumentTokens | None = reader.first
    return 0 if first is None else len(first.head) + len(reader.ids) + len(first.tail)


def per_chunk(rows: list) -> list:
    """The worker's late-chunking rows (per window: its chunks' vectors [k, dim], its tokens) -> per chunk (vector,
    tokens), a window's tokens counted once."""
    return [(vector, tokens if i == 0 else 0) for vectors, tokens in rows for i, vector in enumerate(vectors)]


def per_text(rows: list, found: list, chunking: Chunking, normalizes: bool) -> list:
    """The batcher's (vector, tokens) per chunk -> per text: (its aggregate, its tokens), or (its chunks' vectors
    [k, dim], its tokens, its character spans) without an aggregate."""
    out, first = [], 0
    for spans, chars in found:
        own = rows[first : first + len(spans)]
        first += len(spans)
        vectors, tokens = torch.stack([row for row, _ in own]), sum(n for _, n in own)
        if chunking.aggregate is None:
            out.append((vectors, tokens, chars))
        else:
            out.append((aggregate(vectors, spans, chunking.aggregate, normalizes), tokens))
    return out
