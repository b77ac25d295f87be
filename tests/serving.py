"""Running the real server in a subprocess on a loopback port, and talking to it at the HTTP level."""

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from helpers import DEVICE

KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
PROMPTS = {"query": "query: "}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder, *extra: str, launcher: tuple[str, ...] = ("-m", "st_fastbackend.cli"),
                 env: dict | None = None, log=None) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """`launcher`: the Python arguments before the CLI's (a `-c` script may patch the package first); `log`: a
    file its output goes to."""
    port = free_port()
    command = [sys.executable, *launcher, "serve", str(folder), "--port", str(port), "--served-model-name", "tiny",
               "--device", DEVICE, *extra]  # fmt: skip
    process = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, stdout=log,
                               stderr=subprocess.STDOUT if log else None)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        time.sleep(0.2)
    process.kill()
    raise TimeoutError("server did not become healthy")


@contextlib.contextmanager
def app_client(folder, **options):
    """The server's app in process on a fast model of `folder` (a model of its own), through its lifespan (worker
    started, warm-up answered): 64 inputs a request, 256 tokens an input, the key KEY."""
    from fastapi.testclient import TestClient

    from st_fastbackend import SentenceTransformer
    from st_fastbackend.serve.app import create_app

    model = SentenceTransformer(str(folder), backend="fast", device=DEVICE)
    limits = {"max_tokens_per_batch": 4096, "max_batch_size": 64, "max_input_tokens": 256, **options}
    with TestClient(create_app(model, "tiny", api_key=KEY, **limits)) as client:
        yield client


def open_socket(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=20)


def request_head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    return int(data.split(b" ")[1])


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """One sample of the server's /metrics, by its name with labels as the exposition writes them."""
    for line in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def rss_grown(pid: int, before: int, seconds: float = 10.0) -> int:
    """Bytes the process's RSS holds over `before` once it is back within 50 MiB of it (the server hands memory
    back after a burst), or after `seconds` if it is not."""
    deadline = time.monotonic() + seconds
    while (grown := rss_bytes(pid) - before) >= 50 * 2**20 and time.monotonic() < deadline:
        time.sleep(0.2)
    return grown


@contextlib.contextmanager
def busy_worker(url: str, inputs: list[str], headers: dict):
    """While the worker embeds `inputs` (one request): whatever is sent meanwhile queues up and is then
    taken as one batch, where the server runs `inputs` as one pack (the worker lets requests in between packs)."""
    taken = metric(url, "embedding_queue_wait_seconds_count", headers)
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(
            response=httpx.post(f"{url}/v1/embeddings", json={"input": inputs}, headers=headers, timeout=300)
        )
    )
    thread.start()
    deadline = time.time() + 60
    while metric(url, "embedding_queue_wait_seconds_count", headers) == taken and time.time() < deadline:
        time.sleep(0.02)
    yield
    thread.join(300)
    assert result["response"].status_code == 200, result["response"].text[:300]


def probed(send: Callable[[], httpx.Response], probe: Callable[[], httpx.Response], probes: int = 6):
    """(the response to send(), its seconds, a probe's seconds alone, its seconds while send() is answered): `probes`
    probes alone, one after another, then from 0.3 s after send() until it is answered (one at least, `probes` at
    most). In one run, so that the two are compared on the machine as it is."""
    alone = [_timed(probe) for _ in range(probes)]
    with ThreadPoolExecutor(1) as pool:
        start = time.perf_counter()
        sent = pool.submit(lambda: (send(), time.perf_counter() - start))
        time.sleep(0.3)
        during = [_timed(probe)]
        while len(during) < probes and not sent.done():
            during.append(_timed(probe))
        response, seconds = sent.result()
    return response, seconds, alone, during


def assert_fair(alone: list[float], during: list[float]) -> None:
    """The probe while a hostile request runs: its median within 1 s of its median alone, its maximum within 2 s."""
    waited = statistics.median(during) - statistics.median(alone), max(during) - statistics.median(alone)
    assert waited[0] < 1.0 and waited[1] < 2.0, f"probe alone {alone}, during {during}"


def _timed(send: Callable[[], httpx.Response]) -> float:
    start = time.perf_counter()
    response = send()
    assert response.status_code == 200, response.text
    return time.perf_counter() - start
