"""/v1/embeddings with a `chunking` object (issue 31): each text cut into chunks on its one tokenization (on the
request tokenizer's thread), every chunk of the request one job of the batcher (the one packing schedule), then
each text's chunks aggregated (OpenAI's response shape) or returned as `chunks: [{embedding, text_span}]`.

Late chunking is not served: the worker returns pooled vectors, not the token embeddings it would pool over each
chunk's span; a request asking for it is refused, never answered with other numbers.
"""

from __future__ import annotations

import asyncio

import torch

from st_fastbackend.models.chunked import aggregate
from st_fastbackend.models.chunking import Chunking, char_spans, chunk_size, cut
from st_fastbackend.modules.tokenizer import NoTokensError
from st_fastbackend.serve.errors import ApiError
from st_fastbackend.serve.tokens import InputError, RequestTokenizer


def parse(options: dict) -> Chunking:
    try:
        chunking = Chunking.from_dict(options)
    except (TypeError, ValueError) as error:
        raise ApiError(400, f"chunking: {error}") from error
    if chunking.late:
        raise ApiError(400, "chunking.late is not served (the server's worker pools whole inputs); "
                            "late chunking runs in encode_chunks() and embed-corpus --late.")  # fmt: skip
    return chunking


async def chunk_plan(tokenizer: RequestTokenizer, texts: list[str], prompt: str | None, chunking: Chunking):
    """(every chunk's token ids, per text its token spans and character spans), tokenized on the request
    tokenizer's one thread; a chunk holds at most the server's --max-input-tokens."""
    texts_tokenizer = tokenizer.embedder.texts

    def plan():
        sequences, found = [], []
        for index, text in enumerate(texts):
            document = texts_tokenizer.document(text, prompt)
            if not (document.head or document.ids or document.tail):
                raise InputError(str(NoTokensError(index, text)))
            try:
                spans = cut(len(document.ids), chunk_size(chunking, document, tokenizer.limit), chunking.overlap)
            except ValueError as error:
                raise InputError(f"chunking: {error}") from error
            sequences += [document.head + document.ids[s:e] + document.tail for s, e in spans]
            found.append((spans, char_spans(document, spans)))
        return sequences, found

    return await asyncio.get_running_loop().run_in_executor(tokenizer.pool, plan)


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
