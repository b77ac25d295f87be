"""What a client may hold before it has sent a request: header bytes and fields, time to send the headers,
time between requests, connections open at once and the open-file limit; and the errors for bodies
json.loads cannot read. A real server on loopback, raw sockets where the client misbehaves."""

import gzip
import socket
import time

import httpx
import pytest
from serving import metric, open_socket, read_status, request_head, rss_bytes, start_server

CAP = 20
LIMITS = ("--max-connections", str(CAP), "--max-header-bytes", "4096", "--max-headers", "20",
          "--header-timeout", "1", "--keep-alive-timeout", "1")  # fmt: skip


@pytest.fixture(scope="module")
def served(served_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    with open(log, "w") as out:
        process, url = start_server(served_folder, *LIMITS, log=out)
    yield process, url, log
    process.terminate()
    process.wait(30)


def closed(url: str, reason: str) -> float:
    return metric(url, f'embedding_connections_closed_total{{reason="{reason}"}}')


def answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.slow
def test_headers_past_their_bytes_are_refused_without_being_buffered(served):
    process, url, _ = served
    before = rss_bytes(process.pid)
    for _ in range(5):
        with open_socket(url) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ")
            try:
                for _ in range(64):  # 16 MiB of one header that never ends
                    sock.sendall(b"a" * 2**18)
            except (BrokenPipeError, ConnectionResetError):
                pass
    assert rss_bytes(process.pid) - before < 16 * 2**20
    with open_socket(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 5000)
        reply = answer(sock)
    assert reply.startswith(b"HTTP/1.1 431 ") and b"over 4096 bytes" in reply
    assert closed(url, "header_too_large") >= 6


def test_too_many_header_fields(served):
    _, url, _ = served
    with open_socket(url) as sock:
        sock.sendall(request_head("/health", {f"X-{i}": "1" for i in range(25)}).replace(b"POST", b"GET"))
        reply = answer(sock)
    assert reply.startswith(b"HTTP/1.1 431 ") and b"26 header fields; the limit is 20" in reply  # Host too
    with open_socket(url) as sock:  # at the limit: answered
        sock.sendall(request_head("/health", {f"X-{i}": "1" for i in range(19)}).replace(b"POST", b"GET"))
        assert read_status(sock) == 200


@pytest.mark.slow
def test_headers_sent_slowly_get_408_however_often_a_byte_comes(served):
    _, url, _ = served
    with open_socket(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        start = time.perf_counter()
        try:
            for _ in range(20):
                sock.sendall(b"X")
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = answer(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in reply
    assert time.perf_counter() - start < 2.5


@pytest.mark.slow
@pytest.mark.parametrize("before", ["nothing", "crlf", "a response"])
def test_a_connection_waiting_for_its_request_is_closed_after_the_keep_alive_timeout(served, before):
    _, url, _ = served
    with open_socket(url) as sock:
        if before == "a response":
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_status(sock) == 200
        start = time.perf_counter()
        try:
            while before == "crlf" and time.perf_counter() - start < 3:  # uvicorn's own timer restarts on these
                sock.sendall(b"\r\n")
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass
        rest = answer(sock)
    assert b"HTTP/1.1 4" not in rest and time.perf_counter() - start < 2.5


def test_over_the_cap_the_connection_waiting_longest_makes_room(served):
    process, url, log = served
    evicted = closed(url, "evicted")
    idle = [open_socket(url) for _ in range(3 * CAP)]
    try:
        start = time.perf_counter()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert time.perf_counter() - start < 1.0
        assert metric(url, "embedding_open_connections") <= CAP
        assert closed(url, "evicted") >= evicted + 2 * CAP
        assert "Connections closed by the server's limits (20 connections" in log.read_text()
    finally:
        for sock in idle:
            sock.close()


def test_over_the_cap_with_every_connection_in_a_request_a_new_one_gets_503(served):
    _, url, log = served
    stalled = request_head("/v1/embeddings", {"Content-Type": "application/json", "Content-Length": "100"})
    busy = [open_socket(url) for _ in range(CAP)]
    try:
        for sock in busy:
            sock.sendall(stalled + b"{")  # in a request until --body-timeout
        time.sleep(0.5)
        with open_socket(url) as sock:
            reply = answer(sock)
        assert reply.startswith(b"HTTP/1.1 503 ") and b"every connection is in a request" in reply
    finally:
        for sock in busy:
            sock.close()
    time.sleep(0.2)
    assert closed(url, "refused") >= 1  # asked only now: the request for /metrics would have been refused too


# Runs `st-fastbackend serve` with the open-file limit set to SOFT, HARD first.
LIMITED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, HARD))
from st_fastbackend.cli import main
main(sys.argv[1:])
"""


def open_files_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as limits:
        return next(int(line.split()[3]) for line in limits if line.startswith("Max open files"))


@pytest.mark.slow
def test_the_cap_is_lowered_to_what_the_open_file_limit_allows(served_folder, tmp_path):
    """Under `ulimit -n 256`, with a cap of 1,000: 400 idle connections, and a normal request still answered."""
    launcher = ("-c", LIMITED.replace("SOFT", "256").replace("HARD", "256"))
    with open(tmp_path / "log", "w") as out:
        process, url = start_server(served_folder, "--max-connections", "1000", launcher=launcher, log=out)
    idle = []
    try:
        line = next(line for line in (tmp_path / "log").read_text().splitlines() if "open-file limit" in line)
        assert "--max-connections lowered from 1000 to " in line and "the open-file limit is 256 (hard), " in line
        idle = [open_socket(url) for _ in range(400)]
        response = httpx.post(f"{url}/v1/embeddings", json={"input": "still served"}, timeout=10)
        assert response.status_code == 200, (response.text, (tmp_path / "log").read_text()[-3000:])
    finally:
        for sock in idle:
            sock.close()
        process.terminate()
        process.wait(30)


@pytest.mark.slow
def test_the_soft_open_file_limit_is_raised_for_the_cap(served_folder, tmp_path):
    launcher = ("-c", LIMITED.replace("SOFT", "256").replace("HARD", "4096"))
    with open(tmp_path / "log", "w") as out:
        process, url = start_server(served_folder, "--max-connections", "500", launcher=launcher, log=out)
    try:
        assert "open-file limit raised from 256 to " in (tmp_path / "log").read_text()
        assert 500 < open_files_limit(process.pid) <= 4096
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        (
            gzip.compress(b'{"input": "hi"}'),
            {"Content-Encoding": "gzip"},
            415,
            "Content-Encoding 'gzip' is not supported; send the body uncompressed.",
        ),
        (gzip.compress(b'{"input": "hi"}'), {}, 400, "The request body is gzip-compressed"),
        (b'{"input": "caf\xe9"}', {}, 400, "The request body is not valid UTF-8: byte 0xe9 at position 14."),
        (b"[" * 100_000 + b"]" * 100_000, {}, 400, "nests JSON arrays or objects deeper than the parser goes"),
        (b'{"input": ' * 100_000, {}, 400, "nests JSON arrays or objects deeper than the parser goes"),
    ],
    ids=["gzip declared", "gzip bytes", "latin-1", "deep arrays", "deep objects"],
)
def test_bodies_json_cannot_read_get_errors_naming_why(served, body, headers, status, message):
    _, url, _ = served
    response = httpx.post(f"{url}/v1/embeddings", content=body, headers={"Content-Type": "application/json",
                                                                          **headers})  # fmt: skip
    assert response.status_code == status and message in response.json()["error"]["message"]
