"""text-embeddings-inference's `POST /embed_sparse` over a SparseEncoder: per input its active dimensions as
[{"index", "value"}], on the worker, guard, limits, metrics and prompts of the other routes. TEI's request
fields (inputs, truncate, truncation_direction, prompt_name) and error shape (serve/tei.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from st_fastbackend.serve.routes import Served, embed_inputs, resolve_prompt
from st_fastbackend.serve.tei import EmbedAllRequest, _json

PATHS = ("/embed_sparse",)


def sparse_routes(served: Served) -> APIRouter:
    router = APIRouter()

    @router.post("/embed_sparse")
    async def embed_sparse(body: EmbedAllRequest, request: Request) -> Response:
        served.metrics.requests.labels(endpoint="/embed_sparse").inc()
        prompt = resolve_prompt(served.embedder, None, body.prompt_name)
        rows = await embed_inputs(served, body.inputs, request, prompt=prompt, truncate=bool(body.truncate),
                                  keep_end=body.truncation_direction.lower() == "left", output="sparse",
                                  field="inputs")  # fmt: skip
        if rows is None:
            return Response(status_code=499)
        values = [[{"index": i, "value": v} for i, v in zip(index.tolist(), value.tolist(), strict=True)]
                  for (index, value), _ in rows]  # fmt: skip
        return _json(values)

    return router
