"""What one request may cost the server (no FastAPI import: the CLI reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * 2**20
    max_request_chars: int = 2_000_000  # all inputs of one request together
    body_timeout: float = 30.0  # seconds for the whole body to arrive
