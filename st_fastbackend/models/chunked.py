"""encode() of long documents: every chunk (or late-chunking window) of every text through the one packed loop
(models/fast.py packed_runs, one schedule for the call), then each document's chunk vectors, aggregated or not.

Late chunking (Günther et al. 2024, "Late Chunking"): a window's token embeddings come from one pass over the
whole window; each chunk's vector is the pipeline's Pooling over the chunk's own tokens, then the modules after
Pooling (Dense, Normalize). Pooling modes that read one position (cls, lasttoken) or weigh tokens by their place
in the sequence (weightedmean) have no meaning over a span in the middle of a window, and are refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from sentence_transformers.base.modules import Normalize
from torch import Tensor

from st_fastbackend.engine.batch import PackedBatch, host_to_device
from st_fastbackend.models.chunking import Chunking, Window, char_spans, chunk_size, cut, windows
from st_fastbackend.models.host_rows import HostRows
from st_fastbackend.modules.inputs import naming_lone_surrogates
from st_fastbackend.modules.tokenizer import NoTokensError

SPAN_POOLING = ("mean", "max", "mean_sqrt_len_tokens")  # the modes that pool a span of tokens as they pool a text
Rows = Callable[[dict[str, Any]], Tensor]  # a pack's outputs -> its rows as encode() finishes them


def chunk_vectors(model, inputs: list[str], chunking: Chunking, prompt: str | None, rows: Rows, to_cpu: bool,
                  **run) -> list[tuple[Tensor, list[tuple[int, int]], list[tuple[int, int]]]]:  # fmt: skip
    """Per text: (its chunks' rows [k, dim], their token spans, their character spans). `run`: packed_runs'
    keywords (device, batch_size, max_tokens, show_progress_bar, ...); `rows` leaves them on the device."""
    texts = model[0].texts
    if prompt:  # measured (and cached) now: the tokenizer must not run in two threads at once
        texts.prompt_length(prompt)
    with naming_lone_surrogates(inputs, prompt=prompt):
        documents = [texts.document(text, prompt) for text in inputs]
    for index, document in enumerate(documents):
        if not (document.head or document.ids or document.tail):
            raise NoTokensError(index, inputs[index])
    room = late_room(model, chunking, documents[0]) if chunking.late and documents else None
    head = len(documents[0].head) if documents else 0  # the same for every text: special tokens and the prompt
    spans = [cut(len(d.ids), chunk_size(chunking, d, model[0].max_seq_length), chunking.overlap) for d in documents]
    plan = [w for doc, d in enumerate(documents) for w in windows(doc, d, spans[doc], room)]
    first = list(itertools.accumulate((len(s) for s in spans), initial=0))  # each document's first chunk's row
    results: list = [None] * first[-1]
    landing = HostRows(results, copied_from=run["device"] if to_cpu and run["device"].type == "cuda" else None)
    tokenize = lambda chunk, positions: chunk  # noqa: E731 the sequences are already token ids
    packs = model.packed_runs([w.sequence for w in plan], tokenize, prompt=prompt, **run)
    for picked, out in packs:
        shown = [plan[i] for i in picked]
        chunk_rows = _late_rows(model, out, shown, spans, head, rows) if chunking.late else rows(out)
        chunk_rows = chunk_rows.to("cpu", non_blocking=True) if to_cpu else chunk_rows  # HostRows waits for it
        landing.add([first[w.doc] + c for w in shown for c in w.chunks], chunk_rows)
    landing.finish()
    stacked = [torch.stack(results[first[d] : first[d + 1]]) for d in range(len(documents))]
    return [(stacked[d], spans[d], char_spans(documents[d], spans[d])) for d in range(len(documents))]


def late_room(model, chunking: Chunking, document, max_seq_length: int | None = None) -> int:
    """Text tokens a late-chunking window holds; refuses a pipeline whose pooling has no meaning over a span.
    `max_seq_length`: what the chunks were cut for (default the model's)."""
    modules = list(model._modules.values())
    modes = getattr(modules[1], "pooling_mode", None) if len(modules) > 1 else None
    modes = (modes,) if isinstance(modes, str) else tuple(modes or ("no pooling",))
    if bad := [mode for mode in modes if mode not in SPAN_POOLING]:
        raise ValueError(
            f"Chunking(late=True) pools each chunk's own span of tokens; the pooling mode {bad[0]!r} has no meaning "
            f"over a span (it reads one position or weighs tokens by their place). Modes it takes: {SPAN_POOLING}."
        )
    config = model[0].config
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None:  # RoBERTa's positions start after padding_idx: 514 in its config, 512 to use
        positions -= model[0].model.position_offset
    context = chunking.context or positions
    if context is None:
        raise ValueError("Chunking(late=True) needs Chunking.context: the model's config gives no positions.")
    if positions is not None and context > positions:
        raise ValueError(f"Chunking.context={context} is more than the model's {positions} positions.")
    room = context - len(document.head) - len(document.tail)
    size = chunk_size(chunking, document, max_seq_length or model[0].max_seq_length)
    if size > room:
        raise ValueError(f"Chunking.context={context} holds {room} text tokens, fewer than one chunk's {size}.")
    return room


def _late_rows(model, out: dict[str, Any], shown: list[Window], spans: list, head: int, rows: Rows) -> Tensor:
    """A pack's chunk vectors [chunks, dim], its windows' chunks in order (span_vectors)."""
    within = [[(head + s - w.start, head + e - w.start) for s, e in (spans[w.doc][c] for c in w.chunks)]
              for w in shown]  # fmt: skip
    return span_vectors(model, out, within, rows)


def span_vectors(model, out: dict[str, Any], within: list[list[tuple[int, int]]], rows: Rows) -> Tensor:
    """Per pack row, its spans' vectors, all rows' in order [spans, dim]: each span (token positions within the
    row's whole sequence, prompt included) of the row's token embeddings pooled and run through the modules after
    Pooling. An empty span (a text of no tokens) takes its row's own vector, what plain encode gives that text."""
    tokens: Tensor = out["token_embeddings"]  # [T, H], without a prompt computed once (engine/prefix.py)
    prefix = out.get("prefix")
    skip = prefix.length if prefix is not None else 0  # the pack holds what follows a prompt computed once
    within = [[(s - skip, e - skip) for s, e in row_spans] for row_spans in within]
    starts = itertools.accumulate(out["packed"].lengths, initial=0)
    index, lengths, owner = [], [], []  # owner: the pack row of each empty span, else None
    for row, (row_spans, start) in enumerate(zip(within, starts, strict=False)):
        for s, e in row_spans:
            index.extend(range(start + s, start + e))
            lengths.append(e - s)
            owner.append(row if e == s else None)
    whole = rows(out) if any(o is not None for o in owner) else None
    if not index:
        return whole[owner]  # every span empty
    features = {  # the spans' positions reach the device without the host waiting (engine/batch.py)
        "packed": PackedBatch.from_sequences([[0] * n for n in lengths if n]).to(tokens.device, non_blocking=True),
        "token_embeddings": tokens[host_to_device(torch.tensor(index), tokens.device)],
    }  # fmt: skip  [T', H]
    for module in list(model._modules.values())[1:]:
        features = module(features)
    pooled = iter(rows(features))
    return torch.stack([next(pooled) if o is None else whole[o] for o in owner])


def aggregate(vectors: Tensor, token_spans: list[tuple[int, int]], how: str, normalizes: bool) -> Tensor:
    """One document's vector from its chunks' [k, dim]: "first"; "max" per dimension; "mean" weighted by the
    chunks' token counts (vLLM's rule); re-normalised where the pipeline normalises."""
    if how == "first":
        return vectors[0]
    if how == "max":
        out = vectors.float().amax(0)
    else:
        weights = torch.tensor([max(e - s, 1) for s, e in token_spans], dtype=torch.float32)
        weights = host_to_device(weights, vectors.device)
        out = (vectors.float() * weights[:, None]).sum(0) / weights.sum()
    if normalizes:
        out = torch.nn.functional.normalize(out, p=2, dim=0)
    return out.to(vectors.dtype)


def pipeline_normalizes(model, normalize_embeddings: bool) -> bool:
    return normalize_embeddings or any(isinstance(module, Normalize) for module in model)
