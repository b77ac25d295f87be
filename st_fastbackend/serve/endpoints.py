"""The one way an endpoint is written, in any dialect: an async function of (call, body), its body a pydantic
schema, declared with its path, the output its jobs ask the worker for, and its dialect's error shape (its module's):

    ENDPOINTS = Endpoints(tei_shape)

    @ENDPOINTS.post("/embed_sparse", output="sparse")
    async def embed_sparse(call: Call, body: EmbedAllRequest) -> Response: ...

What every endpoint does besides is here, once: the request counted under its path (embedding_requests_total),
the request's tokens bounded by --max-request-tokens, 499 when the client leaves before its rows are ready, and every
failure an ApiError, which the app answers in the shape of the path's dialect (serve/errors.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from inspect import Parameter, Signature
from typing import get_type_hints

from fastapi import APIRouter, Request
from fastapi.responses import Response

from st_fastbackend.serve.batcher import LATE_CHUNKS, Batcher, ClientLeft, Job, ShuttingDown
from st_fastbackend.serve.errors import ApiError, Shape, openai_shape, server_error
from st_fastbackend.serve.limits import Limits
from st_fastbackend.serve.metrics import Metrics
from st_fastbackend.serve.servable import Servable
from st_fastbackend.serve.tokens import InputError, RequestTokenizer

logger = logging.getLogger(__name__)


@dataclass
class Served:
    """What the endpoints serve: the model (through its narrow interface), under its name, with the
    request tokenizer, the worker, the limits and the metrics."""

    embedder: Servable
    name: str
    tokenizer: RequestTokenizer
    batcher: Batcher
    limits: Limits
    max_batch_size: int
    metrics: Metrics
    ready: bool = False  # the model has answered its warm-up request


@dataclass(frozen=True)
class Call:
    """One request to an endpoint: the server it reached, the request, and the output its jobs ask for."""

    served: Served
    request: Request
    output: str | None

    def check_tokens(self, tokens: int, what: str = "tokens", at_least: bool = False) -> None:
        """413 for a request that holds more model work than --max-request-tokens (`what` the tokens are)."""
        limit = self.served.limits.max_request_tokens
        if tokens > limit:
            found = f"{'At least ' if at_least else ''}{tokens:,} {what}"
            raise ApiError(413, f"{found} in one request; the limit is {limit:,} (--max-request-tokens).",
                           code="request_too_large")  # fmt: skip

    async def rows(
        self, ids: list[list[int]], prompt: str | None, what: str = "tokens", spans: list | None = None
    ) -> list:
        """Each sequence's (row, tokens) from the worker: the endpoint's output, or with `spans` (per sequence its
        chunks' token spans) its late chunks. The sequences are bounded first (check_tokens). ClientLeft once the
        client disconnects: a job the worker has not taken yet is then cancelled and never reaches the model, one
        it is running stops before its next pack."""
        self.check_tokens(sum(map(len, ids)), what)
        job = Job(ids, prompt, output=self.output if spans is None else LATE_CHUNKS, spans=spans)
        result = asyncio.wrap_future(self.served.batcher.submit(job))
        left = asyncio.ensure_future(_disconnect(self.request))
        try:
            await asyncio.wait({result, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
        if result.done():
            return result.result()
        result.cancel()  # cancels the job too, unless the worker is running it
        job.left = True
        raise ClientLeft("The client disconnected.")


async def _disconnect(request: Request) -> None:
    """Returns when the client goes: the body is read, so the server's next event is http.disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


Handler = Callable[..., Awaitable]  # (call, body) -> a Response or what FastAPI encodes; (call) without a body


@dataclass(frozen=True)
class Endpoint:
    path: str  # its label in embedding_requests_total, whichever of `paths` it is asked at
    handler: Handler
    shape: Shape  # its dialect's errors
    output: str | None  # what its jobs ask the worker for (one of Servable.outputs)
    methods: tuple[str, ...]
    paths: tuple[str, ...]  # where it answers: `path` and its aliases

    def answer(self, served: Served) -> Callable:
        """The endpoint as FastAPI runs it on `served`: its signature names the handler's body schema (read with
        get_type_hints: the handler's annotations must be importable names, not under TYPE_CHECKING)."""

        async def answer(request: Request, **body) -> Response:  # body: {"body": the parsed schema}, or none
            served.metrics.requests.labels(endpoint=self.path).inc()
            try:
                return await self.handler(Call(served, request, self.output), **body)
            except ClientLeft:
                return Response(status_code=499)  # nginx's "client closed request"; no one reads it
            except ApiError:
                raise
            except InputError as error:
                raise ApiError(400, str(error)) from error
            except ShuttingDown as error:
                raise ApiError(503, str(error), type="server_error") from error
            except Exception as error:
                logger.exception("Request failed")
                raise server_error(error) from error

        schema = get_type_hints(self.handler).get("body")
        parameters = [Parameter("request", Parameter.KEYWORD_ONLY, annotation=Request)]
        if schema is not None:
            parameters.append(Parameter("body", Parameter.KEYWORD_ONLY, annotation=schema))
        answer.__signature__ = Signature(parameters)
        return answer


class Endpoints(list[Endpoint]):
    """A dialect module's endpoints, declared with `post` and `get`; their errors in `shape` unless one says
    otherwise."""

    def __init__(self, shape: Shape = openai_shape) -> None:
        super().__init__()
        self.shape = shape

    def post(self, path: str, *, output: str | None = None, shape: Shape | None = None, also: tuple[str, ...] = ()):
        return self._declare(path, ("POST",), output, shape, also)

    def get(self, path: str):
        return self._declare(path, ("GET",), None, None, ())

    def _declare(self, path, methods, output, shape, also) -> Callable[[Handler], Handler]:
        def declare(handler: Handler) -> Handler:
            self.append(Endpoint(path, handler, shape or self.shape, output, methods, (path, *also)))
            return handler

        return declare


def router(served: Served, endpoints: list[Endpoint]) -> APIRouter:
    found = APIRouter()
    for endpoint in endpoints:
        for path in endpoint.paths:
            found.add_api_route(path, endpoint.answer(served), methods=list(endpoint.methods),
                                name=endpoint.handler.__name__)  # fmt: skip
    return found


def error_shapes(endpoints: list[Endpoint]) -> dict[str, Shape]:
    """Each path's error shape, for serve/errors.py's ErrorResponses (and the guard, before any route)."""
    return {path: endpoint.shape for endpoint in endpoints for path in endpoint.paths}
