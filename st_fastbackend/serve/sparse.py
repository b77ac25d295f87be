"""text-embeddings-inference's `POST /embed_sparse` over a SparseEncoder: per input its active dimensions as
[{"index", "value"}], on the worker, guard, limits, metrics and prompts of the other routes. TEI's request
fields (inputs, truncate, truncation_direction, prompt_name) and error shape (serve/tei.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from st_fastbackend.serve.routes import Served, json_response
from st_fastbackend.serve.tei import EmbedAllRequest, embed_request

PATHS = ("/embed_sparse",)


def sparse_routes(served: Served) -> APIRouter:
    router = APIRouter()

    @router.post("/embed_sparse")
    async def embed_sparse(body: EmbedAllRequest, request: Request) -> Response:
        served.metrics.requests.labels(endpoint="/embed_sparse").inc()
        rows = await embed_request(served, body, request, "sparse")
        if rows is None:
            return Response(status_code=499)
        values = [[{"index": i, "value": v} for i, v in zip(index.tolist(), value.tolist(), strict=True)]
                  for (index, value), _ in rows]  # fmt: skip
        return json_response(values)

    return router
