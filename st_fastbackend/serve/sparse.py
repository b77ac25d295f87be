"""text-embeddings-inference's `POST /embed_sparse` over a SparseEncoder: per input its active dimensions as
[{"index", "value"}], on the worker, guard, limits, metrics and prompts of the other routes. TEI's request
fields (inputs, truncate, truncation_direction, prompt_name) and error shape (serve/tei.py)."""

from __future__ import annotations

import torch
from fastapi.responses import Response

from st_fastbackend.serve.endpoints import Call, Endpoints
from st_fastbackend.serve.routes import json_response
from st_fastbackend.serve.tei import EmbedAllRequest, embed_request, tei_shape

ENDPOINTS = Endpoints(tei_shape)


@ENDPOINTS.post("/embed_sparse", output="sparse")
async def embed_sparse(call: Call, body: EmbedAllRequest) -> Response:
    rows = await embed_request(call, body)
    return json_response([_active(row) for row, _ in rows])


def _active(row: torch.Tensor) -> list[dict]:
    """A [vocab] row's active dimensions, ascending, with their values."""
    index = row.nonzero().squeeze(1)
    return [{"index": i, "value": v} for i, v in zip(index.tolist(), row[index].tolist(), strict=True)]
