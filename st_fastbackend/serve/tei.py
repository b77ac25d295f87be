"""text-embeddings-inference's routes over an embedding model: `POST /embed`, `/embed_all`, `/tokenize`, `/decode` and
`GET /info`, on the worker, guard, limits, metrics and prompts of /v1/embeddings (serve/routes.py).

Field names, defaults and errors follow TEI's router (router/src/http/types.rs, server.rs): `truncate` defaults
to false (an over-long input is an error), `truncation_direction` "Right" or "Left" (Left keeps the input's end;
here its special tokens and the prompt stay, see serve/tokens.py), errors are {"error", "error_type"} with TEI's
types and statuses (400 Empty, 413 too many inputs as TEI's API documents it, 422 Validation, 424 Backend,
503 Unhealthy). Where TEI's own code and its documentation differ, the documentation is followed.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import torch
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from st_fastbackend import __version__
from st_fastbackend.modules.tokenizer import TextTokenizer
from st_fastbackend.serve.endpoints import Call, Endpoints, Served
from st_fastbackend.serve.errors import ApiError
from st_fastbackend.serve.routes import check_dimensions, embed_inputs, json_response, resolve_prompt
from st_fastbackend.serve.schema import request_inputs

ROOT_PATHS = ("/", "/invocations")  # where huggingface_hub's InferenceClient(model=URL) posts its embeddings requests
# /embed_all's values (tokens x values per token) in one request at most: about 180 MB of JSON.
MAX_TOKEN_VALUES = 2**24


class EmbedAllRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    inputs: str | list[str] | list[int] | list[list[int]]
    truncate: bool | None = None  # TEI's --auto-truncate, off by default
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"
    prompt_name: str | None = None


class EmbedRequest(EmbedAllRequest):
    normalize: bool = True
    dimensions: int | None = Field(default=None, ge=1)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


def tei_shape(error: ApiError) -> tuple[int, dict]:
    """Our error as TEI answers it: TEI's status for the kind of error, and its body."""
    if error.code == "empty_input":
        status, kind = 400, "Empty"
    elif error.status == 413 or error.code == "too_many_inputs":
        status, kind = 413, "Validation"
    elif error.status == 400 and error.code not in ("invalid_json", "invalid_body"):
        status, kind = 422, "Validation"  # the request parses but TEI would refuse it
    elif error.status == 503:
        status, kind = 503, "Unhealthy"
    elif error.status >= 500:
        status, kind = 424, "Backend"
    else:  # 400 unparsable body, 401, 404, 405, 408, 415: ours, in TEI's body
        status, kind = error.status, "Overloaded" if error.status == 429 else "Validation"
    return status, {"error": error.message, "error_type": kind}


# An embedding model's TEI endpoints; /embed_sparse (serve/sparse.py) and /rerank (serve/rerank.py) answer in TEI's
# shape too.
ENDPOINTS = Endpoints(tei_shape)


# TEI answers an embedding model's root (and SageMaker's /invocations) as /embed.
@ENDPOINTS.post("/embed", output="sentence_embedding", also=ROOT_PATHS)
async def embed(call: Call, body: EmbedRequest) -> Response:
    check_dimensions(call.served, body.dimensions)
    rows = await embed_request(call, body)
    return json_response([_sized(row, body.dimensions, body.normalize) for row, _ in rows])


@ENDPOINTS.post("/embed_all", output="token_embeddings")
async def embed_all(call: Call, body: EmbedAllRequest) -> Response:
    rows = await embed_request(call, body, max_tokens=MAX_TOKEN_VALUES // call.served.embedder.token_dimension)
    return json_response([row.numpy() for row, _ in rows])  # per input [tokens, values]


@ENDPOINTS.post("/tokenize")
async def tokenize(call: Call, body: TokenizeRequest) -> Response:
    served = call.served
    prompt = resolve_prompt(served.embedder, None, body.prompt_name)
    limits = served.limits
    texts, _ = request_inputs(body.inputs, served.max_batch_size, limits.max_request_chars, prompt, "inputs")
    limit = served.tokenizer.max_chars
    for index, text in enumerate(texts):
        if len(text) > limit:  # as TEI bounds what it tokenizes
            raise ApiError(400, f"inputs[{index}] has {len(text)} characters; the limit is {limit}.")
    loop, pool, special = asyncio.get_running_loop(), served.tokenizer.pool, body.add_special_tokens
    found = [loop.run_in_executor(pool, tokens, served.embedder.texts, text, prompt, special) for text in texts]
    return json_response(await asyncio.gather(*found))  # a task per text: other requests' tokenizing goes between


@ENDPOINTS.post("/decode")
async def decode(call: Call, body: DecodeRequest) -> Response:
    batch = body.ids if body.ids and isinstance(body.ids[0], list) else [body.ids]
    _check_ids(call.served, batch, body.ids)
    tokenizer = call.served.embedder.texts

    def run() -> list[str]:
        with tokenizer.lock:
            return tokenizer.tokenizer.batch_decode(batch, skip_special_tokens=body.skip_special_tokens)

    return json_response(await asyncio.get_running_loop().run_in_executor(call.served.tokenizer.pool, run))


@ENDPOINTS.get("/info")
async def info(call: Call) -> Response:
    return json_response(_info(call.served))


async def embed_request(call: Call, body: EmbedAllRequest, max_tokens: int | None = None) -> list:
    """What TEI's embedding routes run: the body's inputs, prompt and truncation through the worker, for the
    endpoint's output (at most `max_tokens` tokens a request, where given)."""
    return await embed_inputs(call, body.inputs, prompt_name=body.prompt_name, truncate=bool(body.truncate),
                              keep_end=body.truncation_direction.lower() == "left", field="inputs",
                              max_tokens=max_tokens)  # fmt: skip


def _sized(row: torch.Tensor, dimensions: int | None, normalize: bool):
    """TEI's order: the first `dimensions` values, then unit length where asked (as encode(truncate_dim=...,
    normalize_embeddings=...) does); without `normalize` the model's own output, normalized or not."""
    vector = row[:dimensions] if dimensions else row
    return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).numpy()


def tokens(texts: TextTokenizer, text: str, prompt: str | None, add_special_tokens: bool) -> list[dict]:
    """TEI's tokens of prompt + text: id, text, special; start and stop as byte offsets into the UTF-8 of
    prompt + text (None for a special token, whose text is its token string). With special tokens, the ids are
    those encode() embeds, untruncated."""
    full = prompt + text if prompt else text
    whole = texts.whole(full, add_special_tokens)
    names = texts.tokenizer.convert_ids_to_tokens(whole.ids)
    at = _byte_offsets(full)
    return [
        {"id": i, "text": name, "special": True, "start": None, "stop": None}
        if is_special
        else {"id": i, "text": full[a:b], "special": False, "start": at[a], "stop": at[b]}
        for i, (a, b), is_special, name in zip(whole.ids, whole.offsets, whole.special, names, strict=True)
    ]


def _byte_offsets(text: str) -> list[int] | range:
    """Each character position's offset in the text's UTF-8 bytes (TEI's offsets are the Rust tokenizer's)."""
    if text.isascii():
        return range(len(text) + 1)
    at = [0]
    for char in text:
        at.append(at[-1] + len(char.encode("utf-8", "surrogatepass")))
    return at


def _check_ids(served: Served, batch: list[list[int]], given) -> None:
    if not given:
        raise ApiError(400, "ids is empty.", code="empty_input")
    if len(batch) > served.max_batch_size:
        message = f"{len(batch)} inputs in one request; the limit is {served.max_batch_size}."
        raise ApiError(400, message, code="too_many_inputs")
    vocab = served.embedder.vocab_size
    for index, ids in enumerate(batch):
        if not all(0 <= t < vocab for t in ids):
            raise ApiError(400, f"ids[{index}] has token ids outside the vocabulary (0 to {vocab - 1}).")


def _info(served: Served) -> dict:
    """TEI's Info, and what runs (ours): kernel, dtypes, device."""
    ran = served.embedder.describe()
    return {
        "model_id": served.name,
        "model_sha": None,
        "model_dtype": ran["dtype"],
        "served_model_name": served.name,
        "model_type": {"embedding": {"pooling": ran["pooling"]}},
        "max_concurrent_requests": None,  # not bounded per request; the CLI's --max-connections bounds clients
        "max_input_length": served.tokenizer.limit,
        "max_batch_tokens": served.batcher.max_tokens_per_batch,
        "max_batch_requests": None,
        "max_client_batch_size": served.max_batch_size,
        "auto_truncate": False,
        "tokenization_workers": 1,
        "version": __version__,
        "sha": None,
        "docker_label": None,
        "backend": {"name": "st_fastbackend", **ran},
    }
