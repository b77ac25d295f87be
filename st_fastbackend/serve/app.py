"""The server: OpenAI's /v1/embeddings over a fast model, with text-embeddings-inference's and Cohere's routes
beside it, assembled from the guard (keys, body limits), the endpoints, errors in each dialect's shape, the request
tokenizer and the batching worker."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from fastapi import FastAPI

from st_fastbackend.embedder import Embedder
from st_fastbackend.engine.fused import MIN_TOKENS
from st_fastbackend.serve import cohere, rerank, routes, sparse, tei
from st_fastbackend.serve.batcher import PACK_SECONDS, Batcher, Job
from st_fastbackend.serve.endpoints import Served, error_shapes, router
from st_fastbackend.serve.errors import ErrorResponses, add_error_handlers
from st_fastbackend.serve.guard import Guard
from st_fastbackend.serve.limits import Limits, default_request_tokens
from st_fastbackend.serve.metrics import Metrics
from st_fastbackend.serve.rerank import Reranker, is_cross_encoder
from st_fastbackend.serve.tokens import RequestTokenizer

# An embedding model's endpoints. One that does not serve the model's kind (a dense vector, sparse, multi-vector) names
# the one that does.
EMBEDDING = [*routes.SHARED, *routes.ENDPOINTS, *tei.ENDPOINTS, *cohere.ENDPOINTS, *sparse.ENDPOINTS]
RERANKING = [*routes.SHARED, *rerank.ENDPOINTS]  # a cross-encoder's
# The error shape of every path (OpenAI's on any other), whatever the model: a path this model is not served on answers
# its 404 in the dialect asked.
ERROR_SHAPES = error_shapes([*EMBEDDING, *RERANKING])


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
    pack_seconds: float = PACK_SECONDS,
) -> FastAPI:
    """`model`: a SentenceTransformer loaded with backend="fast". After a device failure (serve/batcher.py)
    every request is a 503 and /health says unhealthy; `app.state.batcher.on_failure` is then called, from
    the worker's thread (the CLI stops the server with it). An embedding model is also served on TEI's routes
    (serve/tei.py) and Cohere's /v2/embed (serve/cohere.py); a CrossEncoder on /v1/rerank and /rerank
    (serve/rerank.py)."""
    cross_encoder = is_cross_encoder(model)
    adapter = Reranker if cross_encoder else Embedder
    limits, metrics, embedder = limits or Limits(), Metrics(), adapter(model)
    if limits.max_request_tokens is None:
        default = default_request_tokens(embedder.device.type, max_batch_size, max_input_tokens)
        limits = dataclasses.replace(limits, max_request_tokens=default)
    batcher = Batcher(embedder, max_tokens_per_batch, max_batch_size, metrics, dynamic_batching,
                      pack_seconds=pack_seconds)  # fmt: skip
    tokenizer = RequestTokenizer(embedder, max_input_tokens)
    served = Served(embedder, served_model_name, tokenizer, batcher, limits, max_batch_size, metrics)
    app = FastAPI(title="st_fastbackend", lifespan=_lifespan(served))
    fail = ErrorResponses(metrics.errors, ERROR_SHAPES)
    public = {"/health", "/metrics"} if public_metrics else {"/health"}
    app.add_middleware(Guard, fail=fail, api_key=api_key, public_paths=public, max_body_bytes=limits.max_body_bytes,
                       body_timeout=limits.body_timeout)  # fmt: skip
    add_error_handlers(app, fail)
    app.include_router(routes.health_routes(served))
    app.include_router(router(served, RERANKING if cross_encoder else EMBEDDING))
    app.state.batcher, app.state.metrics, app.state.fail = batcher, metrics, fail
    return app


def _lifespan(served: Served):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        served.batcher.start()
        # A short text; where the layer seams are compiled (engine/fused.py), copies of it adding up to a pack
        # they run for, in one batch where --max-batch-size allows: they compile here, not in the first request.
        ids = await served.tokenizer(["warm up"], None, None, truncate=True)
        if served.embedder.compiles_seams():
            ids = ids * -(-MIN_TOKENS // len(ids[0]))
        warm_up = Job(token_ids=ids, prompt=None, output=served.embedder.outputs[0])  # the model's main output
        await asyncio.wrap_future(served.batcher.submit(warm_up))
        served.ready = True
        yield
        served.ready = False
        await asyncio.to_thread(served.batcher.stop)  # uvicorn has let in-flight requests finish by now
        served.tokenizer.close()

    return lifespan
