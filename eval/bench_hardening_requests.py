"""What one request may cost on every route (issue 44), for eval/bench_hardening.py's parts "rerank" and "chunking":
the trial's hostile requests, each with a small probe of the same server taken alone and then while it runs.

- rerank (a reranker of ms-marco-MiniLM-L6's shape, random weights, MiniLM's WordPiece; eval/harness/rerank.py):
  a 1,990,000-character query without whitespace with one document; 256 documents of 7,500 characters with
  return_documents. The probe: one short pair.
- chunking (the embedding server): one 2,000,000-character text with "chunking": {"tokens": 128}. The probe: one word.

Each row: the hostile request's status and seconds, the probe's median and maximum alone and during, and the
server's RSS before and 1 s after. `scale` shrinks every size (a dry run: --attack-scale 0.01).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from harness import models, rerank
from harness.measure import rss_mib
from harness.serve import start_server

PROBES = 8  # probes alone; during, as many as fit until the hostile request is answered (one at least)


def rerank_attacks(texts: list[str], scale: float) -> list[dict]:
    """The two rerank attacks on a reranker server of their own."""
    folder = rerank.build(models.CACHE / "rerank-ms-marco-MiniLM-L6", rerank.SHAPES["ms-marco-MiniLM-L6"])
    process, url = start_server(str(folder), "--task", "rerank", "--no-access-log")
    words = " ".join(texts).split()
    rng = random.Random(0)
    documents = [" ".join(rng.choices(words, k=2_000))[: int(7_500 * scale) or 1] for _ in range(256)]
    bodies = {
        "1.99M-char query without whitespace, 1 document": {
            "query": "!" * int(1_990_000 * scale),
            "documents": [texts[0]],
        },
        "256 documents of 7,500 chars, return_documents": {
            "query": texts[1],
            "documents": documents,
            "return_documents": True,
        },
    }
    one_pair = {"query": "a short query", "documents": ["one short document"]}
    post = lambda body: httpx.post(f"{url}/v1/rerank", json=body, timeout=600)  # noqa: E731
    try:
        return [{"attack": name, **probed(process.pid, lambda: post(body), lambda: post(one_pair))}  # noqa: B023
                for name, body in bodies.items()]  # fmt: skip
    finally:
        process.terminate()
        process.wait(60)


def chunking_attack(url: str, pid: int, texts: list[str], scale: float) -> dict:
    words = " ".join(texts)
    chars = int(2_000_000 * scale)
    body = {"input": [(words * (chars // len(words) + 1))[:chars]], "chunking": {"tokens": 128}}
    post = lambda body: httpx.post(f"{url}/v1/embeddings", json=body, timeout=600)  # noqa: E731
    row = probed(pid, lambda: post(body), lambda: post({"input": "one word"}))
    return {"attack": f"{chars:,}-char text, chunking tokens 128", **row}


def probed(pid: int, send: Callable[[], httpx.Response], probe: Callable[[], httpx.Response]) -> dict:
    """send()'s status and seconds, PROBES probes alone then probes from 0.3 s after send() until it is answered,
    and the server's RSS before, 1 s after, and after one more probe (the server hands freed memory back when the
    burst its work belonged to ends: serve/batcher.py)."""
    alone = [_timed(probe) for _ in range(PROBES)]
    before = rss_mib(pid)
    with ThreadPoolExecutor(1) as pool:
        start = time.perf_counter()
        sent = pool.submit(lambda: (send(), time.perf_counter() - start))
        time.sleep(0.3)
        during = [_timed(probe)]
        while not sent.done():
            during.append(_timed(probe))
        response, seconds = sent.result()
    time.sleep(1.0)
    row = {"status": response.status_code, "request_s": round(seconds, 3), "probes_during": len(during)}
    for name, seconds in (("alone", alone), ("during", during)):
        row[f"probe_{name}_median_s"] = round(statistics.median(seconds), 3)
        row[f"probe_{name}_max_s"] = round(max(seconds), 3)
    row.update(rss_before_mib=round(before), rss_after_mib=round(rss_mib(pid)))
    _timed(probe)
    row["rss_after_probe_mib"] = round(rss_mib(pid))
    if response.status_code != 200:
        row["message"] = response.text[:300]
    return row


def _timed(call: Callable[[], httpx.Response]) -> float:
    start = time.perf_counter()
    response = call()
    assert response.status_code == 200, response.text
    return time.perf_counter() - start
