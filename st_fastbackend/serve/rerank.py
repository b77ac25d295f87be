"""Rerank endpoints for a cross-encoder folder: `POST /v1/rerank` (Cohere's and Jina's shape) and `POST /rerank`
(text-embeddings-inference's), on the embeddings server's worker, batching, guard, limits, metrics and errors.

`Reranker` is what the worker and the request tokenizer use of a CrossEncoder (the narrow interface
st_fastbackend/embedder.py gives them of an embedder): its packs' rows are each pair's raw scores; the
model's activation is applied here, per request, unless the client asks for raw scores.
"""

from __future__ import annotations

import uuid

import sentence_transformers
import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from st_fastbackend.engine.schedule import Schedule
from st_fastbackend.serve.batcher import Job, ShuttingDown
from st_fastbackend.serve.errors import ApiError, server_error, too_many_tokens
from st_fastbackend.serve.pairs import PairReader, pair_ids
from st_fastbackend.serve.routes import Served, _unless_client_left, json_response, routes
from st_fastbackend.serve.schema import check_unicode


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


class ScoringSchedule(Schedule):
    """The one schedule; the worker keeps each pack's `sentence_embedding` rows, which here are the scores."""

    def run(self, sequences, **kwargs):
        for picked, out in super().run(sequences, **kwargs):
            out["sentence_embedding"] = out["scores"]  # [B, num_labels], raw
            yield picked, out


class Reranker:
    """What the server uses of a CrossEncoder loaded with backend="fast"."""

    def __init__(self, model) -> None:
        if model.backend != "fast":
            raise TypeError('Reranker needs a CrossEncoder loaded with backend="fast".')
        self._model = model
        self.texts = model[0].texts  # the warm-up request is a single text
        self.dimension: int = model.num_labels
        self.vocab_size: int = model[0].config.vocab_size
        self.max_seq_length: int = model.max_seq_length
        self.normalizes = False
        self.device: torch.device = model.device
        self.activation_fn = model.activation_fn
        self.pair_reader = PairReader(model[0])

    def compiles_seams(self) -> bool:
        return self._model[0].runtime.fused

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        return self._model._resolve_prompt(prompt, prompt_name) or None

    def tokenize(self, texts: list[str], prompt: str | None, max_length: int | None = None) -> list[list[int]]:
        return self.texts.encode(texts, prompt, max_length)

    def schedule(self, prompt: str | None, max_texts: int, max_tokens: int) -> Schedule:
        return ScoringSchedule(self._model, prompt, self.device, max_texts, max_tokens)


def rerank_routes(served: Served) -> APIRouter:
    """/health, /metrics and /v1/models as every server has them, the two rerank endpoints, no embeddings."""
    router = routes(served)
    router.routes = [route for route in router.routes if getattr(route, "path", None) != "/v1/embeddings"]

    @router.post("/v1/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Response:
        served.metrics.requests.labels(endpoint="/v1/rerank").inc()
        if body.model is not None and body.model != served.name:
            raise ApiError(404, f"The model {body.model!r} does not exist; this server serves {served.name!r}.",
                           code="model_not_found")  # fmt: skip
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        scored = await _score(served, body.query, documents, "documents", True, request)
        if scored is None:
            return Response(status_code=499)
        scores, tokens = scored
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[: body.top_n]
        results = [{"index": i, "relevance_score": scores[i]} for i in ranked]
        if body.return_documents:
            for result in results:
                result["document"] = {"text": documents[result["index"]]}
        usage = {"total_tokens": tokens}
        payload = {"id": str(uuid.uuid4()), "model": served.name, "results": results, "usage": usage}
        return json_response(payload)

    @router.post("/rerank")
    async def rerank_tei(body: TeiRerankRequest, request: Request) -> Response:
        served.metrics.requests.labels(endpoint="/rerank").inc()
        scored = await _score(served, body.query, body.texts, "texts", body.truncate, request, raw=body.raw_scores)
        if scored is None:
            return Response(status_code=499)
        scores = scored[0]
        ranked = sorted(range(len(body.texts)), key=lambda i: -scores[i])
        results = [{"index": i, "score": scores[i]} for i in ranked]
        if body.return_text:
            for result in results:
                result["text"] = body.texts[result["index"]]
        return json_response(results)

    return router


async def _score(
    served: Served, query: str, documents: list[str], field: str, truncate: bool, request: Request, raw: bool = False
) -> tuple[list[float], int] | None:
    """Each document's score against the query (the model's activation unless `raw`), and the pairs' tokens."""
    reranker: Reranker = served.embedder
    if reranker.dimension != 1:
        raise ApiError(400, f"This model scores {reranker.dimension} labels per pair; rerank needs one.")
    _check(served, query, documents, field)
    try:
        ids = await pair_ids(served.tokenizer, reranker.pair_reader, query, documents, field, truncate)
        if (tokens := sum(map(len, ids))) > served.limits.max_request_tokens:
            raise too_many_tokens(f"{tokens:,} tokens of pairs", served.limits.max_request_tokens)
        rows = await _unless_client_left(served.batcher, Job(token_ids=ids, prompt=None), request)
    except (ApiError, ShuttingDown) as error:
        if isinstance(error, ShuttingDown):
            raise ApiError(503, str(error), type="server_error") from error
        raise
    except ValueError as error:  # a pair without tokens
        raise ApiError(400, str(error)) from error
    except Exception as error:
        raise server_error(error) from error
    if rows is None:
        return None
    logits = torch.stack([row for row, _ in rows])  # [N, 1]
    scores = logits if raw or reranker.activation_fn is None else reranker.activation_fn(logits)
    return scores.squeeze(-1).tolist(), sum(n for _, n in rows)


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
