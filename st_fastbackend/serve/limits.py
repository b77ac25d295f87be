"""What one request, and one connection, may cost the server (no FastAPI import: the CLI reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * 2**20
    max_request_chars: int = 2_000_000  # all inputs of one request together
    body_timeout: float = 30.0  # seconds for the whole body to arrive
    # Tokens of model work one request may hold: its inputs, chunks, late-chunking windows or rerank pairs together.
    # None: --max-batch-size x --max-input-tokens, the most a request without chunking holds (create_app decides).
    max_request_tokens: int | None = None


@dataclass(frozen=True)
class ConnectionLimits:
    """What a client may hold before it has sent a request (serve/connections.py)."""

    max_connections: int = 1024  # open at once; over it, the one waiting longest for its request is closed
    max_header_bytes: int = 16 * 2**10  # request line and headers, as h11 and Node.js default to
    max_headers: int = 100  # header fields per request, as Apache's LimitRequestFields
    header_timeout: float = 10.0  # seconds from a request's first byte to the end of its headers
    keep_alive_timeout: float = 5.0  # seconds a connection may wait for its next request (uvicorn's default)
