"""What one request, and one connection, may cost the server (no FastAPI import: the CLI reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * 2**20
    max_request_chars: int = 2_000_000  # all inputs of one request together
    body_timeout: float = 30.0  # seconds for the whole body to arrive
    # Tokens of model work one request may hold: its inputs, chunks, late-chunking windows or rerank pairs together.
    # None: default_request_tokens (create_app decides, once it knows the device).
    max_request_tokens: int | None = None


# On a CPU a request holds at most this many full-length inputs by default: TEI's default --max-client-batch-size,
# seconds of model work on a few cores (eval/RESULTS.md, "every request bounded (issue 44)"). On a GPU the same
# tokens take a fraction of a second, and the default is --max-batch-size's.
CPU_REQUEST_INPUTS = 32


def default_request_tokens(device_type: str, max_batch_size: int, max_input_tokens: int) -> int:
    inputs = min(max_batch_size, CPU_REQUEST_INPUTS) if device_type == "cpu" else max_batch_size
    return inputs * max_input_tokens


@dataclass(frozen=True)
class ConnectionLimits:
    """What a client may hold before it has sent a request (serve/connections.py)."""

    max_connections: int = 1024  # open at once; over it, the one waiting longest for its request is closed
    max_header_bytes: int = 16 * 2**10  # request line and headers, as h11 and Node.js default to
    max_headers: int = 100  # header fields per request, as Apache's LimitRequestFields
    header_timeout: float = 10.0  # seconds from a request's first byte to the end of its headers
    keep_alive_timeout: float = 5.0  # seconds a connection may wait for its next request (uvicorn's default)
