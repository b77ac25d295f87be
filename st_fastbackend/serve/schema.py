"""The /v1/embeddings request: OpenAI's fields with strict types, and the checks on its inputs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from st_fastbackend.modules.inputs import lone_surrogate
from st_fastbackend.serve.errors import ApiError


class EmbeddingRequest(BaseModel):
    # strict: no coercion, so [true, false] is not token ids [1, 0] and "8" is not 8. Fields OpenAI's API
    # has and this server does not are accepted and ignored (logged at DEBUG), as OpenAI, vLLM and TEI do.
    model_config = ConfigDict(extra="allow", strict=True)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None  # optional: this server serves one model
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted and ignored, as OpenAI documents it
    truncate: bool = True  # like sentence-transformers: cut at max_seq_length (--max-input-tokens)
    prompt_name: str | None = None  # sentence-transformers extensions
    prompt: str | None = None
    chunking: dict | None = None  # issue 31: models/chunking.py's fields, checked by serve/chunked.py


def request_inputs(
    value, max_inputs: int, max_chars: int, prompt: str | None = None, field: str = "input"
) -> tuple[list[str] | None, list[list[int]] | None]:
    """(texts, None) or (None, token id lists), after the checks that need no tokenizer. The request's
    `prompt` counts towards `max_chars` with its inputs; `field` is the dialect's name for the inputs."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):  # one text, or one input's token ids
        value = [value]
    if not value:
        raise ApiError(400, f"{field} is empty.", code="empty_input")
    if len(value) > max_inputs:
        message = f"{len(value)} inputs in one request; the limit is {max_inputs}."
        raise ApiError(400, message, code="too_many_inputs")
    if isinstance(value[0], list):
        if any(not ids for ids in value):
            raise ApiError(400, f"{field} contains an empty list of token ids.")
        return None, value
    if any(text == "" for text in value):
        raise ApiError(400, f"{field} contains an empty string.")
    if (chars := sum(map(len, value)) + len(prompt or "")) > max_chars:
        message = f"{chars} characters of input and prompt in one request; the limit is {max_chars}."
        raise ApiError(413, message, code="request_too_large")
    for index, text in enumerate(value):
        check_unicode(text, f"Input {index}")
    return value, None


def check_unicode(text: str, what: str) -> None:
    if message := lone_surrogate(text, what):
        raise ApiError(400, message)
