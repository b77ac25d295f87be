"""The HTTP API: OpenAI's /v1/embeddings request and response shapes, plus /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging

import numpy as np
import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from sentence_transformers.base.modules import Normalize

from st_fastbackend.serve.batcher import Batcher, Job, ShuttingDown
from st_fastbackend.serve.errors import ApiError, ErrorResponses, add_error_handlers, server_error
from st_fastbackend.serve.guard import Guard
from st_fastbackend.serve.limits import Limits
from st_fastbackend.serve.schema import EmbeddingRequest, check_unicode, request_inputs
from st_fastbackend.serve.tokens import InputError, RequestTokenizer

logger = logging.getLogger(__name__)


def create_app(
    model,
    served_model_name: str,
    max_tokens_per_batch: int,
    max_batch_size: int,
    max_input_tokens: int,
    api_key: str | None = None,
    dynamic_batching: bool = True,
    limits: Limits | None = None,
    public_metrics: bool = False,
) -> FastAPI:
    limits = limits or Limits()
    registry = CollectorRegistry()
    requests_total = Counter("embedding_requests_total", "Requests by endpoint", ["endpoint"], registry=registry)
    fail = ErrorResponses(registry)
    batcher = Batcher(model, max_tokens_per_batch, max_batch_size, registry, dynamic_batching)
    tokenizer = RequestTokenizer(model, max_input_tokens)
    normalizes = any(isinstance(module, Normalize) for module in model)
    dimension = model.get_embedding_dimension()
    state = {"ready": False}

    app = FastAPI(title="st_fastbackend", lifespan=_lifespan(batcher, tokenizer, state))
    public = {"/health", "/metrics"} if public_metrics else {"/health"}
    app.add_middleware(Guard, fail=fail, api_key=api_key, public_paths=public, max_body_bytes=limits.max_body_bytes,
                       body_timeout=limits.body_timeout)  # fmt: skip

    add_error_handlers(app, fail)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse(
            {"status": "ok" if state["ready"] else "loading"}, status_code=200 if state["ready"] else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        requests_total.labels(endpoint="/v1/models").inc()
        card = {"id": served_model_name, "object": "model", "created": 0, "owned_by": "st_fastbackend"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        requests_total.labels(endpoint="/v1/embeddings").inc()
        if body.model is not None and body.model != served_model_name:
            raise ApiError(404, f"The model {body.model!r} does not exist; this server serves {served_model_name!r}.",
                           code="model_not_found")  # fmt: skip
        texts, token_ids = request_inputs(body.input, max_batch_size, limits.max_request_chars)
        if body.dimensions is not None and body.dimensions > dimension:
            raise ApiError(400, f"dimensions={body.dimensions} exceeds the model's {dimension}.")
        prompt = _prompt(model, body)
        if prompt and token_ids is not None:
            raise ApiError(400, "prompt and prompt_name apply to text input, not to token ids.")
        try:
            ids = await tokenizer(texts, token_ids, prompt, body.truncate)
            rows = await _unless_client_left(batcher.submit(Job(token_ids=ids, prompt=prompt)), request)
        except InputError as error:
            raise ApiError(400, str(error)) from error
        except ShuttingDown as error:
            raise ApiError(503, str(error), type="server_error") from error
        except Exception as error:
            logger.exception("Request failed")
            raise server_error(error) from error
        if rows is None:
            return Response(status_code=499)  # nginx's "client closed request"; no one reads it
        return _response(rows, body, served_model_name, normalizes)

    app.state.batcher = batcher
    return app


def _lifespan(batcher: Batcher, tokenizer: RequestTokenizer, state: dict):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        ids = await tokenizer(["warm up"], None, None, truncate=True)
        await asyncio.wrap_future(batcher.submit(Job(token_ids=ids, prompt=None)))
        state["ready"] = True
        yield
        state["ready"] = False
        await asyncio.to_thread(batcher.stop)  # uvicorn has let in-flight requests finish by now
        tokenizer.close()

    return lifespan


async def _unless_client_left(job: asyncio.Future, request: Request) -> list | None:
    """The job's result, or None once the client disconnects; a job the worker has not taken yet is then
    cancelled and never reaches the model."""
    result = asyncio.wrap_future(job)
    left = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({result, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if result.done():
        return result.result()
    result.cancel()  # cancels the job too, unless the worker is running it
    return None


async def _disconnect(request: Request) -> None:
    """Returns when the client goes: the body is read, so the server's next event is http.disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _prompt(model, body: EmbeddingRequest) -> str | None:
    """As encode() resolves it: prompt, else prompt_name, else the model's default prompt."""
    try:
        prompt = model._resolve_prompt(body.prompt, body.prompt_name) or None
    except ValueError as error:
        raise ApiError(400, str(error)) from error
    if prompt:
        check_unicode(prompt, "The prompt")
    return prompt


def _response(rows: list, body: EmbeddingRequest, served_model_name: str, normalizes: bool) -> Response:
    data = []
    for index, (row, _) in enumerate(rows):
        vector = row[: body.dimensions] if body.dimensions else row
        if body.dimensions and normalizes:
            vector = torch.nn.functional.normalize(vector, dim=0)
        data.append({"object": "embedding", "index": index, "embedding": _encode(vector, body.encoding_format)})
    tokens = sum(n for _, n in rows)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    # orjson writes the float32 arrays directly (shortest form that reads back to the same float32),
    # skipping FastAPI's encoder walk and a Python float per value.
    payload = {"object": "list", "data": data, "model": served_model_name, "usage": usage}
    return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


def _encode(vector: torch.Tensor, encoding_format: str) -> np.ndarray | str:
    array = vector.numpy().astype("<f4")
    if encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
        return base64.b64encode(array.tobytes()).decode("ascii")
    return array
