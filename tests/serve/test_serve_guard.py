"""What a request may cost and who may send one: body size under every framing, bodies that stall,
characters per request, strict request types, the API key on every path. A real server on loopback."""

import signal
import time

import httpx
import pytest
from serving import HEADERS, KEY, metric, open_socket, read_status, request_head, rss_bytes, start_server

LIMIT = 2**20  # --max-body-bytes
JSON = {**HEADERS, "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def served(served_folder):
    process, url = start_server(served_folder, "--api-key", KEY, "--max-body-bytes", str(LIMIT),
                                "--max-request-chars", "300000")  # fmt: skip
    yield process, url
    process.terminate()
    process.wait(30)


@pytest.mark.slow
def test_chunked_body_gets_413_as_soon_as_it_passes_the_limit(served):
    _, url = served
    chunk = b"x" * 65536
    with open_socket(url) as sock:
        sock.sendall(request_head("/v1/embeddings", {**JSON, "Transfer-Encoding": "chunked"}))
        for _ in range(LIMIT // len(chunk) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert read_status(sock) == 413  # the body has not ended: no last chunk was sent


def test_bodies_over_the_limit_leave_memory_flat(served):
    process, url = served

    def chunks():
        for _ in range(20):
            yield b"[" * 2**20  # 20 MiB, chunked

    before = rss_bytes(process.pid)
    for _ in range(5):
        assert httpx.post(f"{url}/v1/embeddings", content=chunks(), headers=JSON, timeout=120).status_code == 413
        big = httpx.post(f"{url}/v1/embeddings", content=b"[" * (3 * LIMIT), headers=JSON, timeout=120)
        assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    assert rss_bytes(process.pid) - before < 64 * 2**20


def test_characters_per_request_are_limited(served):
    _, url = served
    response = httpx.post(f"{url}/v1/embeddings", json={"input": ["a " * 100_000, "b " * 60_000]}, headers=HEADERS)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "body",
    [
        {"input": [True, False]},
        {"input": "hi", "dimensions": "8"},
        {"input": "hi", "truncate": "yes"},
        {"input": [1.0, 2.0]},
        {"input": "hi", "dimensions": 8.0},
    ],  # fmt: skip
    ids=str,
)
def test_request_types_are_strict(served, body):
    _, url = served
    response = httpx.post(f"{url}/v1/embeddings", json=body, headers=HEADERS)
    assert response.status_code == 400 and "Invalid request" in response.json()["error"]["message"]


def test_every_path_but_health_needs_the_key(served):
    _, url = served
    for path in ("/docs", "/redoc", "/openapi.json", "/metrics", "/v1/models"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers=HEADERS).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    lower = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, headers={"Authorization": f"bearer {KEY}"})
    assert lower.status_code == 200
    assert metric(url, 'embedding_errors_total{type="invalid_api_key"}', HEADERS) >= 5


@pytest.mark.slow
def test_stalled_body_gets_408_and_does_not_hold_up_sigterm(served_folder):
    process, url = start_server(served_folder, "--api-key", KEY, "--public-metrics", "--body-timeout", "1")
    try:
        assert httpx.get(f"{url}/metrics").status_code == 200  # --public-metrics
        assert httpx.get(f"{url}/docs").status_code == 401
        stall = request_head("/v1/embeddings", {**JSON, "Content-Length": "100"}) + b'{"input": '
        with open_socket(url) as sock:
            sock.sendall(stall)
            start = time.time()
            assert read_status(sock) == 408 and time.time() - start < 10
        stalled = open_socket(url)
        stalled.sendall(stall)
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        stalled.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
