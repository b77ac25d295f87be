"""A real `st-fastbackend serve` process on loopback, and a one-word probe of it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def start_server(model: str, *extra: str, **popen) -> tuple[subprocess.Popen, str]:
    """The server on a free port with `extra` arguments (`popen` to subprocess.Popen), once /health answers."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "st_fastbackend.cli", "serve", model, "--port", str(port), "--device", "cpu"]
    process = subprocess.Popen([*command, *extra], **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.terminate()
    raise TimeoutError("server did not start")


def probe(url: str, timeout: float = 60) -> float:
    """Seconds for a one-word request, which must succeed."""
    import httpx

    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/embeddings", json={"input": "one word"}, timeout=timeout)
    assert response.status_code == 200, response.text
    return time.perf_counter() - start
