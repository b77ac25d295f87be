"""Cohere's embed API, `POST /v2/embed`, on the worker, guard, limits, metrics and prompts of /v1/embeddings
(serve/routes.py), for Cohere-shaped clients (the official `cohere` package's ClientV2, LangChain's and
LlamaIndex's Cohere integrations).

- `input_type` picks the model's prompt as sentence-transformers' encode_query / encode_document do:
  "search_query" its "query" prompt, "search_document" the first of "document", "passage", "corpus";
  "classification" and "clustering" the prompt of that name; without one, the model's default prompt (encode()).
- `embedding_types`: "float", "base64" (the float32 values' little-endian bytes), and sentence-transformers'
  quantize_embeddings of the float vectors for "int8", "uint8", "binary" and "ubinary". Its int8/uint8 ranges
  are the minimum and maximum of each dimension over the request's texts (quantize_embeddings without `ranges`):
  they need two texts or more, and vectors quantized in different requests are on different scales. Cohere's
  own int8 uses a fixed calibration, which a model of ours does not have. binary/ubinary depend on the vector alone.
- `output_dimension`: the first values, unit length again where the model normalizes (Matryoshka).
- `truncate`: "END" (default) cuts an over-long input's end, "START" its start (its special tokens and the prompt
  stay), "NONE" refuses it.
- Errors: {"id", "message"} with the status of /v1/embeddings' error.
"""

from __future__ import annotations

import base64
import uuid
from typing import Literal

import numpy as np
import torch
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from sentence_transformers import quantize_embeddings

from st_fastbackend.embedder import DOCUMENT_PROMPTS
from st_fastbackend.serve.endpoints import Call, Endpoints, Served
from st_fastbackend.serve.errors import ApiError
from st_fastbackend.serve.routes import check_dimensions, check_model, embed_inputs, json_response, matryoshka

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
# input_type -> the model's prompts it takes, the first the model has (encode_query / encode_document's order)
PROMPT_NAMES = {"search_query": ("query",), "search_document": DOCUMENT_PROMPTS,
                "classification": ("classification",), "clustering": ("clustering",)}  # fmt: skip


class CohereEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    texts: list[str] | None = None
    model: str | None = None  # Cohere requires it; this server serves one model
    input_type: str | None = None
    embedding_types: list[EmbeddingType] = Field(default_factory=lambda: ["float"], min_length=1)
    output_dimension: int | None = Field(default=None, ge=1)
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = Field(default=None, ge=1)
    images: list | None = None
    inputs: list | None = None


def cohere_shape(error: ApiError) -> tuple[int, dict]:
    return error.status, {"id": str(uuid.uuid4()), "message": error.message}


ENDPOINTS = Endpoints(cohere_shape)


@ENDPOINTS.post("/v2/embed", output="sentence_embedding")
async def embed(call: Call, body: CohereEmbedRequest) -> Response:
    served = call.served
    _check(served, body)
    rows = await embed_inputs(call, body.texts, prompt_name=_prompt_name(served, body.input_type),
                              truncate=body.truncate != "NONE", keep_end=body.truncate == "START",
                              field="texts")  # fmt: skip
    vectors = torch.stack([matryoshka(row, body.output_dimension, served.embedder.normalizes) for row, _ in rows])
    payload = {
        "id": str(uuid.uuid4()),
        "embeddings": {kind: _typed(vectors.numpy(), kind) for kind in dict.fromkeys(body.embedding_types)},
        "texts": body.texts,
        "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": sum(n for _, n in rows)}},
        "response_type": "embeddings_by_type",
    }
    return json_response(payload)


def _check(served: Served, body: CohereEmbedRequest) -> None:
    check_model(served, body.model)
    if body.images or body.inputs:
        raise ApiError(400, "This server embeds text: send `texts` (images and `inputs` are not supported).")
    if body.texts is None:
        raise ApiError(400, "texts is required.")
    check_dimensions(served, body.output_dimension, "output_dimension")
    if body.max_tokens is not None and body.max_tokens < served.tokenizer.limit:
        raise ApiError(400, f"max_tokens={body.max_tokens} is below this server's input limit, "
                            f"{served.tokenizer.limit} tokens (--max-input-tokens); a lower one per request is not "
                            "supported.")  # fmt: skip
    quantized = {"int8", "uint8"} & set(body.embedding_types)
    if quantized and len(body.texts) == 1:
        raise ApiError(400, f"embedding_types {sorted(quantized)} take their ranges from the request's texts, as "
                            "sentence-transformers' quantize_embeddings does: send two texts or more.")  # fmt: skip


def _prompt_name(served: Served, input_type: str | None) -> str | None:
    if input_type is None:
        return None
    if input_type not in PROMPT_NAMES:
        raise ApiError(400, f"input_type {input_type!r} is not served; use one of {sorted(PROMPT_NAMES)}.")
    return next((name for name in PROMPT_NAMES[input_type] if name in served.embedder.prompts), None)


def _typed(vectors: np.ndarray, kind: str):
    """[N, dim] float32 -> the embedding type's values per text."""
    if kind == "float":
        return vectors
    if kind == "base64":
        return [base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") for vector in vectors]
    # int8/uint8: the ranges quantize_embeddings computes from the vectors themselves, given (without its warning)
    low, high = vectors.min(axis=0), vectors.max(axis=0)
    ranges = np.vstack((low, np.where(high > low, high, low + 1)))  # a dimension all texts share: its lowest code
    return quantize_embeddings(vectors, precision=kind, ranges=ranges)
