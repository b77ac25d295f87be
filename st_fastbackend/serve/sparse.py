"""text-embeddings-inference's `POST /embed_sparse` over a SparseEncoder: per input its active dimensions as
[{"index", "value"}], on the worker, guard, limits, metrics and prompts of the other routes. TEI's request
fields (inputs, truncate, truncation_direction, prompt_name) and error shape (serve/tei.py). And `POST /embed_hybrid`
over a HybridEncoder (BGE-M3): per input its dense vector (as /embed), lexical weights (as /embed_sparse) and ColBERT
vectors (as /embed_all), from one pass."""

from __future__ import annotations

from fastapi.responses import Response

from st_fastbackend.serve.endpoints import Call, Endpoints
from st_fastbackend.serve.routes import json_response
from st_fastbackend.serve.tei import MAX_TOKEN_VALUES, EmbedAllRequest, embed_request, tei_shape

ENDPOINTS = Endpoints(tei_shape)


@ENDPOINTS.post("/embed_sparse", output="sparse")
async def embed_sparse(call: Call, body: EmbedAllRequest) -> Response:
    rows = await embed_request(call, body)
    return json_response([_index_values(index, value) for (index, value), _ in rows])


@ENDPOINTS.post("/embed_hybrid", output="hybrid")
async def embed_hybrid(call: Call, body: EmbedAllRequest) -> Response:
    rows = await embed_request(call, body, max_tokens=MAX_TOKEN_VALUES // call.served.embedder.token_dimension)
    return json_response([{"dense": dense.numpy(), "sparse": _index_values(*lexical), "multi_vector": vectors.numpy()}
                          for (dense, lexical, vectors), _ in rows])  # fmt: skip


def _index_values(index, value) -> list[dict]:
    return [{"index": i, "value": v} for i, v in zip(index.tolist(), value.tolist(), strict=True)]
