"""The server under hostile traffic, on loopback, against a real `st-fastbackend serve` process.

1. Mixed load: N concurrent closed-loop clients send one STS-B sentence per request; a fraction of the
   requests are bad (a lone surrogate in the input or in the prompt, booleans as token ids). Every good
   answer is checked against `model.encode` in this process. Reports good requests answered (200, right
   vector), bad ones refused with 400, anything else, and the server's RSS before and after.
2. Oversized bodies: 20 MB and 200 MB bodies sent with Content-Length and chunked; the status, the time
   to the answer, and the server's RSS before and after each size.
3. A long text: a one-word request's latency while requests of 2 million characters are in flight.
4. One request against everyone (issue 34): while each of these is processed, a one-word probe's latency,
   and the server's RSS before, at its peak and after: 1.95 million '!' in one input (no whitespace); a
   1.5-million-character prompt with 16 short inputs; 16 inputs of 256 tokens (a control: a forward of the
   same size); a prompt of 18,000 '!' (within the bound, more tokens than the limit) with 16 short inputs;
   and, for scale, 256 inputs of 256 tokens each.
5. A stalled body: the time to its 408, and the time SIGTERM takes with a stalled client connected.
6. What a client may hold without a request (issue 37; bench_hardening_connections.py): a header flood,
   slowloris, idle connections, a server under an open-file limit of 1,024, a prompt per request, bodies
   json cannot read. Then the server's RSS at start and idle after the whole trial (10 s after the last part).
7. What one request may cost on every route (issue 44; bench_hardening_requests.py): "chunking", one 2M-character
   text with "chunking": {"tokens": 128}; "rerank", on a reranker server of its own, a 1.99M-character query
   without whitespace with one document, and 256 documents of 7,500 characters with return_documents. Each with
   its status and seconds, a probe's median and maximum alone and during, and the server's RSS before and after.

    python eval/bench_hardening.py                   # bundled all-MiniLM-L6-v2, 64 and 200 clients, 5% bad
    python eval/bench_hardening.py --parts attacks   # part 4 only
    python eval/bench_hardening.py --parts chunking rerank --attack-scale 0.01   # part 7, a dry run in small
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import bench_hardening_connections
import bench_hardening_requests
import httpx
import numpy as np
from harness import data, options, report
from harness.measure import rss_mib
from harness.serve import probe, start_server

JSON_HEADER = {"Content-Type": "application/json"}
PARTS = ("mixed", "oversized", "long_text", "attacks", "connections", "stalled", "chunking", "rerank")
BAD = ('{"input": "caf\\ud800 au lait"}', '{"input": "fine", "prompt": "query\\udfff: "}', '{"input": [true, false]}')


async def mixed_load(url: str, texts: list[str], expected: np.ndarray, clients: int, seconds: float, bad: float):
    counts = {
        "good_sent": 0,
        "good_ok": 0,
        "good_wrong": 0,
        "good_failed": 0,
        "bad_sent": 0,
        "bad_400": 0,
        "bad_other": 0,
    }
    stop_at = time.perf_counter() + seconds

    async def client(http: aiohttp.ClientSession, seed: int) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < stop_at:
            if rng.random() < bad:
                counts["bad_sent"] += 1
                async with http.post(f"{url}/v1/embeddings", data=rng.choice(BAD), headers=JSON_HEADER) as response:
                    await response.read()
                    counts["bad_400" if response.status == 400 else "bad_other"] += 1
                continue
            i = rng.randrange(len(texts))
            counts["good_sent"] += 1
            async with http.post(f"{url}/v1/embeddings", json={"input": texts[i]}) as response:
                body = await response.read()
            if response.status != 200:
                counts["good_failed"] += 1
                continue
            vector = np.array(json.loads(body)["data"][0]["embedding"])
            counts["good_ok" if np.abs(vector - expected[i]).max() <= 1e-5 else "good_wrong"] += 1

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        begin = time.perf_counter()
        await asyncio.gather(*(client(http, k) for k in range(clients)))
        counts["requests_per_s"] = (counts["good_sent"] + counts["bad_sent"]) / (time.perf_counter() - begin)
    return counts


def oversized(url: str, pid: int, sizes_mb: tuple[int, ...]) -> list[dict]:
    rows = []
    for size in sizes_mb:
        for framing in ("content-length", "chunked"):
            megabyte = b"[" * 2**20
            content = megabyte * size if framing == "content-length" else (megabyte for _ in range(size))
            before, start = rss_mib(pid), time.perf_counter()
            response = httpx.post(f"{url}/v1/embeddings", content=content, headers=JSON_HEADER, timeout=600)
            seconds = time.perf_counter() - start
            rows.append({"size_mb": size, "framing": framing, "status": response.status_code, "seconds": seconds,
                         "rss_before_mib": before, "rss_after_mib": rss_mib(pid)})  # fmt: skip
            del content
    return rows


def long_text_latency(url: str, texts: list[str], chars: int, parallel: int) -> dict:
    rng = random.Random(0)
    words = " ".join(texts).split()
    long = " ".join(rng.choices(words, k=chars // 4))[:chars]
    with httpx.Client(timeout=600) as http:
        alone = _timed(lambda: http.post(f"{url}/v1/embeddings", json={"input": "one word"}))
    with ThreadPoolExecutor(parallel) as pool:
        futures = [
            pool.submit(httpx.post, f"{url}/v1/embeddings", json={"input": long}, timeout=600) for _ in range(parallel)
        ]
        time.sleep(0.2)
        during = probe(url, timeout=600)
        long_seconds = [f.result().elapsed.total_seconds() for f in futures]
    return {"chars": len(long), "parallel": parallel, "one_word_alone_s": alone, "one_word_during_s": during,
            "long_request_s": max(long_seconds)}  # fmt: skip


def attacks(url: str, pid: int, texts: list[str]) -> list[dict]:
    words = " ".join(texts)
    prompt = (words * (1_500_000 // len(words) + 1))[:1_500_000]
    bodies = {
        "1.95M '!' in one input": {"input": "!" * 1_950_000},
        "1.5M-char prompt, 16 inputs": {"input": texts[:16], "prompt": prompt},
        "16 inputs of 256 tokens (control)": {"input": [" ".join(["word"] * 300) + f" {i}" for i in range(16)]},
        "18,000 '!' prompt, 16 inputs": {"input": texts[:16], "prompt": "!" * 18_000},
        "256 inputs of 256 tokens": {"input": [" ".join(["word"] * 300) + f" {i}" for i in range(256)]},
    }
    return [{"attack": name, **with_probe(url, pid, body)} for name, body in bodies.items()]


def with_probe(url: str, pid: int, body: dict) -> dict:
    """The request's status and seconds, a one-word probe's seconds sent 0.2 s after it, and the server's RSS."""
    before, peak, done = rss_mib(pid), [0.0], threading.Event()

    def watch() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], rss_mib(pid))

    with ThreadPoolExecutor(2) as pool:
        pool.submit(watch)
        start = time.perf_counter()
        attack = pool.submit(httpx.post, f"{url}/v1/embeddings", json=body, timeout=600)
        time.sleep(0.2)
        probe_s = probe(url, timeout=600)
        response = attack.result()
        attack_s = time.perf_counter() - start
        done.set()
    row = {"status": response.status_code, "request_s": round(attack_s, 3), "probe_s": round(probe_s, 3),
           "rss_before_mib": round(before), "rss_peak_mib": round(max(peak[0], before)),
           "rss_after_mib": round(rss_mib(pid))}  # fmt: skip
    if response.status_code != 200:
        row["message"] = response.json()["error"]["message"]
    return row


def _timed(call) -> float:
    start = time.perf_counter()
    assert call().status_code == 200
    return time.perf_counter() - start


def stalled(model: str) -> dict:
    process, url = start_server(model, "--body-timeout", "5")
    host, port = url.removeprefix("http://").split(":")
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head)
        begin = time.perf_counter()
        status = sock.recv(64).split(b" ")[1].decode()
        answer_s = time.perf_counter() - begin
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(head)
    time.sleep(0.5)
    start = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    code = process.wait(120)
    sock.close()
    return {
        "body_timeout_s": 5,
        "status": status,
        "answer_s": answer_s,
        "sigterm_exit_s": time.perf_counter() - start,
        "exit_code": code,
    }


def main() -> None:
    from st_fastbackend import SentenceTransformer

    parser = options.parser(__doc__, "model", "data_dir", "output_dir")
    parser.add_argument("--clients", type=int, nargs="+", default=[64, 200])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--bad-fraction", type=float, default=0.05)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[20, 200])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    parser.add_argument("--attack-scale", type=float, default=1.0, help="sizes of part 7's requests times this")
    args = parser.parse_args()
    texts = data.sts_sentences(args.data_dir, columns=("sentence1",))
    expected = SentenceTransformer(args.model, backend="fast", device="cpu").encode(texts)
    result = {"date": report.stamp(), "cores": os.cpu_count(), "model": args.model, "mixed": []}
    process, url = start_server(args.model)
    result["rss_at_start_mib"] = round(rss_mib(process.pid))
    try:
        for clients in args.clients if "mixed" in args.parts else ():
            before = rss_mib(process.pid)
            row = asyncio.run(mixed_load(url, texts, expected, clients, args.seconds, args.bad_fraction))
            row.update(clients=clients, rss_before_mib=before, rss_after_mib=rss_mib(process.pid))
            result["mixed"].append(row)
            print(json.dumps(row), flush=True)
        if "oversized" in args.parts:
            result["oversized"] = oversized(url, process.pid, tuple(args.sizes_mb))
            print(json.dumps(result["oversized"], indent=1), flush=True)
        if "long_text" in args.parts:
            result["long_text"] = long_text_latency(url, texts, 2_000_000, 4)
            print(json.dumps(result["long_text"]), flush=True)
        if "attacks" in args.parts:
            result["attacks"] = attacks(url, process.pid, texts)
            print("\n".join(map(json.dumps, result["attacks"])), flush=True)
        if "chunking" in args.parts:
            row = bench_hardening_requests.chunking_attack(url, process.pid, texts, args.attack_scale)
            result["chunking"] = row
            print(json.dumps(row), flush=True)
        if "connections" in args.parts:
            result["connections"] = bench_hardening_connections.run(url, process.pid, args.model, texts)
            print(json.dumps(result["connections"], indent=1), flush=True)
        time.sleep(10)
        result["rss_idle_at_end_mib"] = round(rss_mib(process.pid))
        print(f"server RSS at start {result['rss_at_start_mib']} MiB, idle at the end {result['rss_idle_at_end_mib']}")
    finally:
        process.terminate()
        process.wait(60)
    if "rerank" in args.parts:
        result["rerank"] = bench_hardening_requests.rerank_attacks(texts, args.attack_scale)
        print("\n".join(map(json.dumps, result["rerank"])), flush=True)
    if "stalled" in args.parts:
        result["stalled"] = stalled(args.model)
        print(json.dumps(result["stalled"]), flush=True)
    out = report.results_file(args.output_dir, "bench-hardening", result, result["date"])
    print(f"written to {out}")


if __name__ == "__main__":
    main()
