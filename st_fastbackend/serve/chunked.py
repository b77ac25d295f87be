"""/v1/embeddings with a `chunking` object (issue 31): each text cut into chunks on its one tokenization (on the
request tokenizer's thread), every chunk of the request one job of the batcher (the one packing schedule), then
each text's chunks aggregated (OpenAI's response shape) or returned as `chunks: [{embedding, text_span}]`.

Late chunking: the job's sequences are windows of consecutive whole chunks, as encode_chunks() makes them, each
with its chunks' spans; the worker pools each span of the window's token embeddings (the "late_chunks" output).
A window holds at most `chunking.context` tokens, by default the server's --max-input-tokens (and never more):
the same vectors as encode_chunks(chunking=Chunking(late=True, context=that)).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import torch

from st_fastbackend.models.chunked import aggregate
from st_fastbackend.models.chunking import Chunking, char_spans, chunk_size, cut, windows
from st_fastbackend.modules.tokenizer import NoTokensError
from st_fastbackend.serve.errors import ApiError
from st_fastbackend.serve.tokens import InputError, RequestTokenizer


def parse(options: dict) -> Chunking:
    try:
        return Chunking.from_dict(options)
    except (TypeError, ValueError) as error:
        raise ApiError(400, f"chunking: {error}") from error


async def chunk_plan(tokenizer: RequestTokenizer, texts: list[str], prompt: str | None, chunking: Chunking):
    """(every sequence's token ids, per text its token spans and character spans, and for late chunking per
    sequence its chunks' spans within it, else None), tokenized on the request tokenizer's one thread; a sequence
    holds at most the server's --max-input-tokens."""
    texts_tokenizer, limit = tokenizer.embedder.texts, tokenizer.limit
    if chunking.late and (chunking.context or limit) > limit:
        raise InputError(f"chunking.context={chunking.context} is more than the server's {limit} input tokens.")
    late = replace(chunking, context=chunking.context or limit) if chunking.late else None

    def plan():
        sequences, found, within = [], [], []
        for index, text in enumerate(texts):
            try:
                document = texts_tokenizer.document(text, prompt)  # ValueError: a prompt merging into the text
                if not (document.head or document.ids or document.tail):
                    raise InputError(str(NoTokensError(index, text)))
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

    return await asyncio.get_running_loop().run_in_executor(tokenizer.pool, plan)


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
