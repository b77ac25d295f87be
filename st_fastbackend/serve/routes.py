"""OpenAI's endpoints, /v1/embeddings and /v1/models, the embedding request every dialect runs (embed_inputs), and
/health and /metrics."""

from __future__ import annotations

import base64
import logging

import numpy as np
import orjson
import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from st_fastbackend.embedder import Embedder
from st_fastbackend.models.chunking import Chunking
from st_fastbackend.serve import chunked
from st_fastbackend.serve.endpoints import Call, Endpoints, Served
from st_fastbackend.serve.errors import ApiError
from st_fastbackend.serve.schema import EmbeddingRequest, check_unicode, request_inputs

logger = logging.getLogger(__name__)
SHARED = Endpoints()  # every server's, whatever its model
ENDPOINTS = Endpoints()  # an embedding model's


def health_routes(served: Served) -> APIRouter:
    """/health and /metrics: not counted, not in any dialect."""
    router = APIRouter()

    @router.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with HEAD
    async def health() -> Response:
        if served.batcher.failure is not None:  # the server is on its way out, to be restarted
            return JSONResponse({"status": "unhealthy", "error": str(served.batcher.failure)}, status_code=503)
        return JSONResponse({"status": "ok" if served.ready else "loading"}, status_code=200 if served.ready else 503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router


@SHARED.get("/v1/models")
async def models(call: Call) -> dict:
    card = {"id": call.served.name, "object": "model", "created": 0, "owned_by": "st_fastbackend"}
    return {"object": "list", "data": [card]}


@ENDPOINTS.post("/v1/embeddings", output="sentence_embedding")
async def embeddings(call: Call, body: EmbeddingRequest) -> Response:
    if body.model_extra:
        logger.debug(f"Ignored request fields: {sorted(body.model_extra)}")
    check_model(call.served, body.model)
    check_dimensions(call.served, body.dimensions)
    chunking = chunked.parse(body.chunking) if body.chunking is not None else None
    rows = await embed_inputs(call, body.input, prompt=body.prompt, prompt_name=body.prompt_name,
                              truncate=body.truncate, chunking=chunking)  # fmt: skip
    return _response(rows, body, call.served.name, call.served.embedder.normalizes)


def check_model(served: Served, model: str | None) -> None:
    if model is not None and model != served.name:
        raise ApiError(404, f"The model {model!r} does not exist; this server serves {served.name!r}.",
                       code="model_not_found")  # fmt: skip


def check_dimensions(served: Served, dimensions: int | None, field: str = "dimensions") -> None:
    if dimensions is not None and dimensions > served.embedder.dimension:
        raise ApiError(400, f"{field}={dimensions} exceeds the model's {served.embedder.dimension}.")


async def embed_inputs(
    call: Call, value, *, prompt: str | None = None, prompt_name: str | None = None, truncate: bool,
    keep_end: bool = False, chunking: Chunking | None = None, field: str = "input", max_tokens: int | None = None,
) -> list:  # fmt: skip
    """What every dialect's embedding route runs: the request's inputs (texts or token ids) checked, tokenized
    with the prompt encode() resolves from `prompt` and `prompt_name`, through the worker; per input (its row of the
    endpoint's output, its token count). An input over the limit is cut (`truncate`; keeping its last tokens with
    `keep_end`), else 400. `field`: the dialect's name for the inputs, in errors; `max_tokens`: the most tokens the
    request may hold for this output (413 past it)."""
    served = call.served
    if call.output not in served.embedder.outputs:
        raise ApiError(400, wrong_route(served.embedder.kind), code="wrong_route")
    asked, prompt = prompt is not None or prompt_name is not None, resolve_prompt(served.embedder, prompt, prompt_name)
    texts, token_ids = request_inputs(value, served.max_batch_size, served.limits.max_request_chars, prompt, field)
    if token_ids is not None:
        if asked:  # whatever the prompt named holds, "" included
            raise ApiError(400, "prompt and prompt_name apply to text input, not to token ids.")
        prompt = None  # ids are embedded as given: the model's default prompt does not apply either
    if chunking is not None and token_ids is not None:
        raise ApiError(400, "chunking applies to text input, not to token ids.")
    if chunking is None:
        ids = await served.tokenizer(texts, token_ids, prompt, truncate, keep_end=keep_end)
        if max_tokens is not None and (tokens := sum(map(len, ids))) > max_tokens:
            message = f"{tokens} tokens in one request; the limit for {call.output} is {max_tokens}."
            raise ApiError(413, message, code="request_too_large")
        return await call.rows(ids, prompt)
    ids, found, within = await chunked.chunk_plan(served.tokenizer, texts, prompt, chunking, call.check_tokens)
    rows = await call.rows(ids, prompt, "tokens of chunks", spans=within)
    rows = chunked.per_chunk(rows) if within is not None else rows
    return chunked.per_text(rows, found, chunking, served.embedder.normalizes)


def wrong_route(kind: str) -> str:
    """Where a model's vectors are, for a request on a route that does not serve them."""
    if kind == "sparse":
        return "This server serves a sparse model (SparseEncoder): its vectors are at POST /embed_sparse."
    if kind == "multi_vector":
        return "This server serves a multi-vector model (MultiVectorEncoder): its vectors are at POST /embed_all."
    return "This server serves a dense embedding model: POST /v1/embeddings, /embed, /embed_all or /v2/embed."


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
