"""Rerank endpoints for a cross-encoder folder: `POST /v1/rerank` (Cohere's and Jina's shape) and `POST /rerank`
(text-embeddings-inference's), on the embeddings server's worker, batching, guard, limits, metrics and errors.

`Reranker` is what the worker and the request tokenizer use of a CrossEncoder (serve/servable.py's Servable, as
st_fastbackend/embedder.py's Embedder is of an embedding model): its packs' rows are each pair's raw scores (the
class's served rows); the model's activation is applied here, per request, unless the client asks for raw scores.
"""

from __future__ import annotations

import uuid

import sentence_transformers
import torch
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from st_fastbackend.engine.schedule import Schedule
from st_fastbackend.serve.endpoints import Call, Endpoints, Served
from st_fastbackend.serve.errors import ApiError
from st_fastbackend.serve.pairs import PairReader, pair_ids
from st_fastbackend.serve.routes import check_model, json_response
from st_fastbackend.serve.schema import check_unicode
from st_fastbackend.serve.tei import tei_shape


def is_cross_encoder(model) -> bool:
    return isinstance(model, sentence_transformers.CrossEncoder)


class Document(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    text: str


class RerankRequest(BaseModel):
    """Cohere's /v1/rerank (and Jina's): documents as strings or {"text": ...}."""

    model_config = ConfigDict(extra="allow", strict=True)
    query: str
    documents: list[str | Document]
    model: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False


class TeiRerankRequest(BaseModel):
    """text-embeddings-inference's /rerank."""

    model_config = ConfigDict(extra="allow", strict=True)
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = True  # like sentence-transformers' CrossEncoder: pairs cut longest_first at max_length


class Reranker:
    """What the server uses of a CrossEncoder loaded with backend="fast"."""

    def __init__(self, model) -> None:
        if model.backend != "fast":
            raise TypeError('Reranker needs a CrossEncoder loaded with backend="fast".')
        self._model = model
        self.texts = model[0].texts  # the warm-up request is a single text
        self.dimension: int = model.num_labels
        self.vocab_size: int = model[0].config.vocab_size
        self.normalizes = False
        self.device: torch.device = model.device
        self.outputs: tuple[str, ...] = model.served_outputs
        self.forward_kwargs: dict = model.served_kwargs()
        self.activation_fn = model.activation_fn
        self.pair_reader = PairReader(model[0])

    def compiles_seams(self) -> bool:
        return self._model[0].runtime.fused

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        return self._model._resolve_prompt(prompt, prompt_name) or None

    def tokenize(self, texts: list[str], prompt: str | None, max_length: int | None = None) -> list[list[int]]:
        return self.texts.encode(texts, prompt, max_length)

    def schedule(self, prompt: str | None, max_texts: int, max_tokens: int) -> Schedule:
        return Schedule(self._model, prompt, self.device, max_texts, max_tokens, self.forward_kwargs)

    def rows(self, output: str, out: dict) -> list:
        return self._model.served_rows(output, out)


ENDPOINTS = Endpoints()  # a cross-encoder's


@ENDPOINTS.post("/v1/rerank", output="scores")
async def rerank(call: Call, body: RerankRequest) -> Response:
    check_model(call.served, body.model)
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    scores, tokens = await _score(call, body.query, documents, "documents", True)
    ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[: body.top_n]
    results = [{"index": i, "relevance_score": scores[i]} for i in ranked]
    if body.return_documents:
        for result in results:
            result["document"] = {"text": documents[result["index"]]}
    usage = {"total_tokens": tokens}
    payload = {"id": str(uuid.uuid4()), "model": call.served.name, "results": results, "usage": usage}
    return json_response(payload)


@ENDPOINTS.post("/rerank", output="scores", shape=tei_shape)
async def rerank_tei(call: Call, body: TeiRerankRequest) -> Response:
    scores, _ = await _score(call, body.query, body.texts, "texts", body.truncate, raw=body.raw_scores)
    ranked = sorted(range(len(body.texts)), key=lambda i: -scores[i])
    results = [{"index": i, "score": scores[i]} for i in ranked]
    if body.return_text:
        for result in results:
            result["text"] = body.texts[result["index"]]
    return json_response(results)


async def _score(
    call: Call, query: str, documents: list[str], field: str, truncate: bool, raw: bool = False
) -> tuple[list[float], int]:
    """Each document's score against the query (the model's activation unless `raw`), and the pairs' tokens."""
    served = call.served
    reranker: Reranker = served.embedder
    if reranker.dimension != 1:
        raise ApiError(400, f"This model scores {reranker.dimension} labels per pair; rerank needs one.")
    _check(served, query, documents, field)
    try:
        ids = await pair_ids(served.tokenizer, reranker.pair_reader, query, documents, field, truncate)
    except ValueError as error:  # a pair without tokens
        raise ApiError(400, str(error)) from error
    rows = await call.rows(ids, None, "tokens of pairs")
    logits = torch.stack([row for row, _ in rows])  # [N]: one label
    scores = logits if raw or reranker.activation_fn is None else reranker.activation_fn(logits)
    return scores.tolist(), sum(n for _, n in rows)


def _check(served: Served, query: str, documents: list[str], field: str) -> None:
    if not documents:
        raise ApiError(400, f"{field} is empty.", code="empty_input")
    if len(documents) > served.max_batch_size:
        message = f"{len(documents)} {field} in one request; the limit is {served.max_batch_size}."
        raise ApiError(400, message, code="too_many_inputs")
    limit = served.limits.max_request_chars
    if (chars := len(query) * len(documents) + sum(map(len, documents))) > limit:  # the query goes with each
        message = f"{chars} characters of query (once per pair) and {field} in one request; the limit is {limit}."
        raise ApiError(413, message, code="request_too_large")
    check_unicode(query, "The query")
    for index, text in enumerate(documents):
        check_unicode(text, f"{field}[{index}]")
