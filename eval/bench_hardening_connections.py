"""bench_hardening.py part 6 (issue 37): what a client may hold without a request. Each attack runs against a
real server on loopback while a one-word probe (a new connection each time) is timed, and the server's RSS is
read before, every 10 ms during (peak) and after:

- header flood: 4 connections each sending 64 MiB of one header that never ends;
- slowloris: 1,000 connections sending a header line every second, 15 s; how many are still open;
- idle: 3,000 connections that send nothing, 12 s; how many are still open;
- open files: a server started under an open-file limit of 1,024 (soft and hard), 1,100 idle connections;
- prompts: 300 requests, each with a prompt of its own of 18,000 characters (the bound);
- bodies json cannot read: gzip (declared and not), invalid UTF-8, 100,000-deep JSON: status and message.
"""

from __future__ import annotations

import contextlib
import gzip
import resource
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from harness.measure import rss_mib
from harness.serve import probe, start_server


class Watch:
    """The server's RSS peak while it runs, and probes' worst time."""

    def __init__(self, pid: int, url: str) -> None:
        self.pid, self.url, self.before, self.peak, self.probes = pid, url, rss_mib(pid), 0.0, []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, rss_mib(self.pid))

    def probe(self) -> None:
        self.probes.append(probe(self.url))

    def row(self, **extra) -> dict:
        self._done.set()
        self._thread.join()
        return {**extra, "probe_max_s": round(max(self.probes), 3), "probes": len(self.probes),
                "rss_before_mib": round(self.before), "rss_peak_mib": round(max(self.peak, self.before)),
                "rss_after_mib": round(rss_mib(self.pid))}  # fmt: skip


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def still_open(sockets: list[socket.socket]) -> int:
    """Connections the server has not closed: a read would block rather than see EOF or an answer."""
    count = 0
    for sock in sockets:
        try:
            sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)  # returns: an answer, or EOF
        except BlockingIOError:
            count += 1
        except OSError:
            pass
    return count


def header_flood(url: str, pid: int, connections: int = 4, mib: int = 64) -> dict:
    def flood() -> tuple[int, bytes]:
        sent = 0
        with connect(url) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Flood: ")
            try:
                for _ in range(mib * 4):
                    sock.sendall(b"a" * 2**18)
                    sent += 2**18
            except OSError:
                pass
            try:
                return sent, sock.recv(4096)[:12]
            except OSError:
                return sent, b"(reset)"

    watch = Watch(pid, url)
    with ThreadPoolExecutor(connections) as pool:
        floods = [pool.submit(flood) for _ in range(connections)]
        watch.probe()
        results = [f.result() for f in floods]
    watch.probe()
    return watch.row(attack=f"{connections} x {mib} MiB of one header",
                     sent_before_closed_kib=[s // 1024 for s, _ in results],
                     answers=sorted({a.decode() for _, a in results}))  # fmt: skip


def hold(url: str, pid: int, name: str, count: int, seconds: float, trickle: bool) -> dict:
    """`count` connections opened and held `seconds` (sending a header line every second where `trickle`)."""
    watch = Watch(pid, url)
    sockets = []
    for _ in range(count):
        sockets.append(connect(url))
        if trickle:
            sockets[-1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    opened = time.perf_counter()
    watch.probe()
    while (elapsed := time.perf_counter() - opened) < seconds:
        if trickle:
            for sock in sockets:
                with contextlib.suppress(OSError):  # closed by the server
                    sock.send(b"X-Slow: 1\r\n", socket.MSG_DONTWAIT)
        if int(elapsed) % 3 == 0:
            watch.probe()
        time.sleep(1.0)
    left = still_open(sockets)
    for sock in sockets:
        sock.close()
    return watch.row(attack=name, held_s=seconds, still_open=left)


def under_file_limit(model: str, limit: int = 1024, idle: int = 1100) -> dict:
    """A server of its own, started under `ulimit -n limit`; `idle` connections; then a probe."""
    nofile = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))  # noqa: E731
    process, url = start_server(model, preexec_fn=nofile, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True).start()
    try:
        sockets = [connect(url) for _ in range(idle)]
        seconds = probe(url)
        for sock in sockets:
            sock.close()
        said = next((line.strip() for line in lines if "open-file limit" in line), None)
        return {"attack": f"{idle} idle connections under an open-file limit of {limit}", "probe_s": round(seconds, 3),
                "start_line": said}  # fmt: skip
    finally:
        process.terminate()
        process.wait(60)


def prompts(url: str, pid: int, texts: list[str], count: int = 300) -> dict:
    words = " ".join(texts)
    watch = Watch(pid, url)
    for i in range(count):
        prompt = f"{i}: " + (words * 2)[i * 37 : i * 37 + 18_000 - 8]
        response = httpx.post(f"{url}/v1/embeddings", json={"input": "x", "prompt": prompt}, timeout=60)
        assert response.status_code == 200, response.text
        if i % 100 == 0:
            watch.probe()
    return watch.row(attack=f"{count} requests, each a prompt of its own of ~18,000 characters")


def unreadable_bodies(url: str) -> list[dict]:
    bodies = {
        "gzip, Content-Encoding: gzip": (gzip.compress(b'{"input": "hi"}'), {"Content-Encoding": "gzip"}),
        "gzip, undeclared": (gzip.compress(b'{"input": "hi"}'), {}),
        "Latin-1 (invalid UTF-8)": (b'{"input": "caf\xe9"}', {}),
        "100,000-deep JSON": (b"[" * 100_000 + b"]" * 100_000, {}),
    }
    rows = []
    for name, (body, headers) in bodies.items():
        headers = {"Content-Type": "application/json", **headers}
        response = httpx.post(f"{url}/v1/embeddings", content=body, headers=headers, timeout=60)
        rows.append({"body": name, "status": response.status_code, "message": response.json()["error"]["message"]})
    return rows


def run(url: str, pid: int, model: str, texts: list[str]) -> dict:
    return {
        "attacks": [
            header_flood(url, pid),
            hold(url, pid, "1,000 slowloris connections", 1000, 15, trickle=True),
            hold(url, pid, "3,000 idle connections", 3000, 12, trickle=False),
            prompts(url, pid, texts),
        ],
        "open_files": under_file_limit(model),
        "bodies": unreadable_bodies(url),
    }
