"""The endpoints: OpenAI's /v1/embeddings and /v1/models, plus /health and /metrics."""

from __future__ import annotations

import asyncio
import base64
import logging
from dataclasses import dataclass

import numpy as np
import orjson
import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from st_fastbackend.embedder import Embedder
from st_fastbackend.models.chunking import Chunking
from st_fastbackend.serve import chunked
from st_fastbackend.serve.batcher import LATE_CHUNKS, Batcher, Job, ShuttingDown
from st_fastbackend.serve.errors import ApiError, server_error, too_many_tokens
from st_fastbackend.serve.limits import Limits
from st_fastbackend.serve.metrics import Metrics
from st_fastbackend.serve.schema import EmbeddingRequest, check_unicode, request_inputs
from st_fastbackend.serve.tokens import InputError, RequestTokenizer

logger = logging.getLogger(__name__)


@dataclass
class Served:
    """What the endpoints serve: the model (through its narrow interface), under its name, with the
    request tokenizer, the worker, the limits and the metrics."""

    embedder: Embedder
    name: str
    tokenizer: RequestTokenizer
    batcher: Batcher
    limits: Limits
    max_batch_size: int
    metrics: Metrics
    ready: bool = False  # the model has answered its warm-up request


def routes(served: Served) -> APIRouter:
    router = APIRouter()

    @router.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with HEAD
    async def health() -> Response:
        if served.batcher.failure is not None:  # the server is on its way out, to be restarted
            return JSONResponse({"status": "unhealthy", "error": str(served.batcher.failure)}, status_code=503)
        return JSONResponse({"status": "ok" if served.ready else "loading"}, status_code=200 if served.ready else 503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models() -> dict:
        served.metrics.requests.labels(endpoint="/v1/models").inc()
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "st_fastbackend"}
        return {"object": "list", "data": [card]}

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        served.metrics.requests.labels(endpoint="/v1/embeddings").inc()
        if body.model_extra:
            logger.debug(f"Ignored request fields: {sorted(body.model_extra)}")
        rows = await _embed(served, body, request)
        if rows is None:
            return Response(status_code=499)  # nginx's "client closed request"; no one reads it
        return _response(rows, body, served.name, served.embedder.normalizes)

    return router


async def _embed(served: Served, body: EmbeddingRequest, request: Request) -> list | None:
    """(embedding, token count) per input, or None when the client left first."""
    check_model(served, body.model)
    check_dimensions(served, body.dimensions)
    chunking = chunked.parse(body.chunking) if body.chunking is not None else None
    return await embed_inputs(served, body.input, request, prompt=body.prompt, prompt_name=body.prompt_name,
                              truncate=body.truncate, chunking=chunking)  # fmt: skip


def check_model(served: Served, model: str | None) -> None:
    if model is not None and model != served.name:
        raise ApiError(404, f"The model {model!r} does not exist; this server serves {served.name!r}.",
                       code="model_not_found")  # fmt: skip


def check_dimensions(served: Served, dimensions: int | None, field: str = "dimensions") -> None:
    if dimensions is not None and dimensions > served.embedder.dimension:
        raise ApiError(400, f"{field}={dimensions} exceeds the model's {served.embedder.dimension}.")


async def embed_inputs(
    served: Served, value, request: Request, *, prompt: str | None = None, prompt_name: str | None = None,
    truncate: bool, keep_end: bool = False, output: str = "sentence_embedding", chunking: Chunking | None = None,
    field: str = "input", max_tokens: int | None = None,
) -> list | None:  # fmt: skip
    """What every dialect's embedding route runs: the request's inputs (texts or token ids) checked, tokenized
    with the prompt encode() resolves from `prompt` and `prompt_name`, through the worker; per input (its `output`
    row, its token count), or None when the client left first. An input over the limit is cut (`truncate`; keeping
    its last tokens with `keep_end`), else 400. `field`: the dialect's name for the inputs, in errors;
    `max_tokens`: the most tokens the request may hold (413 past it)."""
    if output not in served.embedder.outputs:
        raise ApiError(400, wrong_route(served.embedder.kind), code="wrong_route")
    limits = served.limits
    asked, prompt = prompt is not None or prompt_name is not None, resolve_prompt(served.embedder, prompt, prompt_name)
    texts, token_ids = request_inputs(value, served.max_batch_size, limits.max_request_chars, prompt, field)
    if token_ids is not None:
        if asked:  # whatever the prompt named holds, "" included
            raise ApiError(400, "prompt and prompt_name apply to text input, not to token ids.")
        prompt = None  # ids are embedded as given: the model's default prompt does not apply either
    if chunking is not None and token_ids is not None:
        raise ApiError(400, "chunking applies to text input, not to token ids.")
    try:
        if chunking is None:
            ids = await served.tokenizer(texts, token_ids, prompt, truncate, keep_end=keep_end)
            tokens = sum(map(len, ids))
            if max_tokens is not None and tokens > max_tokens:
                message = f"{tokens} tokens in one request; the limit for {output} is {max_tokens}."
                raise ApiError(413, message, code="request_too_large")
            if tokens > limits.max_request_tokens:
                raise too_many_tokens(f"{tokens:,} tokens", limits.max_request_tokens)
            return await _unless_client_left(served.batcher, Job(ids, prompt, output=output), request)
        ids, found, within = await chunked.chunk_plan(served.tokenizer, texts, prompt, chunking,
                                                      limits.max_request_tokens)  # fmt: skip
        late = {"output": LATE_CHUNKS, "spans": within} if within is not None else {}
        rows = await _unless_client_left(served.batcher, Job(token_ids=ids, prompt=prompt, **late), request)
        if rows is None:
            return None
        return chunked.per_text(chunked.per_chunk(rows) if late else rows, found, chunking, served.embedder.normalizes)
    except ApiError:
        raise
    except InputError as error:
        raise ApiError(400, str(error)) from error
    except ShuttingDown as error:
        raise ApiError(503, str(error), type="server_error") from error
    except Exception as error:
        logger.exception("Request failed")
        raise server_error(error) from error


def wrong_route(kind: str) -> str:
    """Where a model's vectors are, for a request on a route that does not serve them."""
    if kind == "sparse":
        return "This server serves a sparse model (SparseEncoder): its vectors are at POST /embed_sparse."
    if kind == "multi_vector":
        return "This server serves a multi-vector model (MultiVectorEncoder): its vectors are at POST /embed_all."
    return "This server serves a dense embedding model: POST /v1/embeddings, /embed, /embed_all or /v2/embed."


async def _unless_client_left(batcher: Batcher, job: Job, request: Request) -> list | None:
    """The job's result, or None once the client disconnects; a job the worker has not taken yet is then
    cancelled and never reaches the model, one it is running stops before its next pack."""
    result = asyncio.wrap_future(batcher.submit(job))
    left = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({result, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if result.done():
        return result.result()
    result.cancel()  # cancels the job too, unless the worker is running it
    job.left = True
    return None


async def _disconnect(request: Request) -> None:
    """Returns when the client goes: the body is read, so the server's next event is http.disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def resolve_prompt(embedder: Embedder, prompt: str | None, prompt_name: str | None) -> str | None:
    """As encode() resolves it (the model's default prompt without either); 400 for an unknown name."""
    try:
        prompt = embedder.resolve_prompt(prompt, prompt_name)
    except ValueError as error:
        raise ApiError(400, str(error)) from error
    if prompt:
        check_unicode(prompt, "The prompt")
    return prompt


def _response(rows: list, body: EmbeddingRequest, served_model_name: str, normalizes: bool) -> Response:
    data = []
    for index, (row, _, *spans) in enumerate(rows):
        if spans:  # chunking without an aggregate: the text's chunks [k, dim] and their characters
            chunks = [{"embedding": _encode(_sized(vector, body, normalizes), body.encoding_format),
                       "text_span": list(span)} for vector, span in zip(row, spans[0], strict=True)]  # fmt: skip
            data.append({"object": "embedding", "index": index, "chunks": chunks})
            continue
        vector = _sized(row, body, normalizes)
        data.append({"object": "embedding", "index": index, "embedding": _encode(vector, body.encoding_format)})
    tokens = sum(row[1] for row in rows)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    payload = {"object": "list", "data": data, "model": served_model_name, "usage": usage}
    return json_response(payload)


def json_response(payload) -> Response:
    """Every dialect's JSON body: orjson writes float32 arrays directly (the shortest form that reads back to the
    same float32), skipping FastAPI's encoder walk and a Python float per value."""
    return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


def _sized(row: torch.Tensor, body: EmbeddingRequest, normalizes: bool) -> torch.Tensor:
    return matryoshka(row, body.dimensions, normalizes)


def matryoshka(row: torch.Tensor, dimensions: int | None, normalizes: bool) -> torch.Tensor:
    """The first `dimensions` values, unit length again where the model's own output is."""
    vector = row[:dimensions] if dimensions else row
    return torch.nn.functional.normalize(vector, dim=0) if dimensions and normalizes else vector


def _encode(vector: torch.Tensor, encoding_format: str) -> np.ndarray | str:
    array = vector.numpy().astype("<f4")
    if encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
        return base64.b64encode(array.tobytes()).decode("ascii")
    return array
