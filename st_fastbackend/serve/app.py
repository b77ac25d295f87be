"""The HTTP API: OpenAI's /v1/embeddings request and response shapes, plus /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from typing import Literal

import numpy as np
import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sentence_transformers.base.modules import Normalize
from starlette.datastructures import Headers

from st_fastbackend.serve.batcher import Batcher, InputError, Job

MAX_BODY_BYTES = 8 * 2**20


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted and ignored, as OpenAI documents it
    truncate: bool = True  # like sentence-transformers: cut at max_seq_length (--max-input-tokens)
    prompt_name: str | None = None  # sentence-transformers extensions
    prompt: str | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def create_app(
    model,
    served_model_name: str,
    max_batch_tokens: int,
    max_batch_size: int,
    max_input_tokens: int,
    api_key: str | None = None,
    dynamic_batching: bool = True,
) -> FastAPI:
    registry = CollectorRegistry()
    requests_total = Counter("embedding_requests_total", "Requests by endpoint", ["endpoint"], registry=registry)
    errors_total = Counter("embedding_errors_total", "Error responses by type", ["type"], registry=registry)
    batcher = Batcher(model, max_batch_tokens, max_batch_size, max_input_tokens, registry, dynamic_batching)
    normalizes = any(isinstance(module, Normalize) for module in model)
    dimension = model.get_embedding_dimension()
    state = {"ready": False}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        await asyncio.wrap_future(batcher.submit(Job(texts=["warm up"], token_ids=None, prompt=None, truncate=True)))
        state["ready"] = True
        yield
        state["ready"] = False
        await asyncio.to_thread(batcher.stop)  # uvicorn has let in-flight requests finish by now

    app = FastAPI(title="st_fastbackend", lifespan=lifespan)

    def fail(status: int, message: str, type: str, code: str | None = None) -> JSONResponse:
        errors_total.labels(type=code or type).inc()
        return JSONResponse(error_body(message, type, code), status_code=status)

    def guard(app_next):
        """Body size and API key, checked on the headers before the body is read. A plain ASGI wrapper:
        Starlette's @app.middleware("http") costs a noticeable share of a small request."""

        async def asgi(scope, receive, send):
            if scope["type"] == "http":
                headers = Headers(scope=scope)
                length = headers.get("content-length")
                if length is not None and int(length) > MAX_BODY_BYTES:
                    message = f"Request body over {MAX_BODY_BYTES} bytes."
                    return await fail(413, message, "invalid_request_error", "body_too_large")(scope, receive, send)
                authorized = api_key is None or headers.get("authorization") == f"Bearer {api_key}"
                if scope["path"].startswith("/v1/") and not authorized:
                    message = "Missing or wrong API key."
                    return await fail(401, message, "authentication_error", "invalid_api_key")(scope, receive, send)
            await app_next(scope, receive, send)

        return asgi

    app.add_middleware(guard)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return fail(400, f"Invalid request: {details}", "invalid_request_error")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return fail(exc.status, exc.message, exc.type, exc.code)

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
    async def embeddings(body: EmbeddingRequest) -> Response:
        requests_total.labels(endpoint="/v1/embeddings").inc()
        if body.model is not None and body.model != served_model_name:
            raise ApiError(404, f"The model {body.model!r} does not exist; this server serves {served_model_name!r}.",
                           code="model_not_found")  # fmt: skip
        texts, token_ids = _inputs(body.input)
        count = len(texts if texts is not None else token_ids)
        if count > max_batch_size:
            raise ApiError(400, f"{count} inputs in one request; the limit is {max_batch_size}.")
        if body.dimensions is not None and body.dimensions > dimension:
            raise ApiError(400, f"dimensions={body.dimensions} exceeds the model's {dimension}.")
        prompt = _prompt(model, body)
        if prompt and token_ids is not None:
            raise ApiError(400, "prompt and prompt_name apply to text input, not to token ids.")
        job = Job(texts=texts, token_ids=token_ids, prompt=prompt, truncate=body.truncate)
        try:
            rows = await asyncio.wrap_future(batcher.submit(job))
        except InputError as error:
            raise ApiError(400, str(error)) from error
        except RuntimeError as error:
            raise ApiError(503, str(error), type="server_error") from error
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

    app.state.batcher = batcher
    return app


def _inputs(value) -> tuple[list[str] | None, list[list[int]] | None]:
    if isinstance(value, str):
        value = [value]
    if not value:
        raise ApiError(400, "input is empty.")
    if isinstance(value[0], str):
        if any(text == "" for text in value):
            raise ApiError(400, "input contains an empty string.")
        return value, None
    if isinstance(value[0], int):
        return None, [value]
    if any(not ids for ids in value):
        raise ApiError(400, "input contains an empty list of token ids.")
    return None, value


def _prompt(model, body: EmbeddingRequest) -> str | None:
    """As encode() resolves it: prompt, else prompt_name, else the model's default prompt."""
    try:
        return model._resolve_prompt(body.prompt, body.prompt_name) or None
    except ValueError as error:
        raise ApiError(400, str(error)) from error


def _encode(vector: torch.Tensor, encoding_format: str) -> np.ndarray | str:
    array = vector.numpy().astype("<f4")
    if encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
        return base64.b64encode(array.tobytes()).decode("ascii")
    return array
