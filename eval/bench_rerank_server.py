"""The server goal of issue 29: `st-fastbackend serve` on a reranker folder, 16 concurrent clients each posting
one `/v1/rerank` request of 1 SciFact claim x 100 SciFact documents (all at once: a burst of 16 requests, 1,600
pairs), against plain sentence_transformers.CrossEncoder.predict on the same 100 pairs per call in this process.
Rounds alternate (plain, server, plain, server ...) while the server stays up; pairs/s are medians of rounds,
and the server's scores are checked against plain's (the model's activation, sigmoid: max |diff|).

    python eval/bench_rerank_server.py                                  # ms-marco-MiniLM-L6 shape, 2 rounds
    python eval/bench_rerank_server.py --shapes bge-reranker-base --rounds 1
"""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import numpy as np
import torch
from harness import models, options, report, rerank
from harness.serve import start_server
from sentence_transformers import CrossEncoder


def burst(url: str, requests: list[dict], clients: int) -> tuple[float, list[list[float]]]:
    """`requests` split over `clients` concurrent clients, each posting its share one after another: the seconds
    until the last answer, and each request's scores in document order."""
    return asyncio.run(_burst(url, requests, clients))


async def _burst(url: str, requests: list[dict], clients: int) -> tuple[float, list[list[float]]]:
    scores: list[list[float]] = [[] for _ in requests]

    async def client(http: aiohttp.ClientSession, first: int) -> None:
        for i in range(first, len(requests), clients):
            async with http.post(f"{url}/v1/rerank", json=requests[i]) as response:
                response.raise_for_status()
                results = (await response.json())["results"]
            scores[i] = [r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])]

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1800)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http, k) for k in range(clients)))
        return time.perf_counter() - start, scores


def pairs_of(request: dict) -> list[tuple[str, str]]:
    return [(request["query"], document) for document in request["documents"]]


def main() -> None:
    parser = options.parser(__doc__, "data_dir", "batch_size", "rounds", "output_dir", rounds=2)
    parser.add_argument("--shapes", nargs="+", default=["ms-marco-MiniLM-L6"], choices=list(rerank.SHAPES))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--documents", type=int, default=100, help="documents per request")
    parser.add_argument("--plain-requests", type=int, default=4, help="requests plain predict() scores a round")
    args = parser.parse_args()
    claims = rerank.pairs(args.data_dir, args.clients, per_query=args.documents)
    requests = [{"query": claims[i][0], "documents": [d for _, d in claims[i : i + args.documents]]}
                for i in range(0, len(claims), args.documents)]  # fmt: skip
    print(f"{report.machine()}; {len(requests)} requests of 1 claim x {args.documents} documents, {args.clients} "
          f"clients; plain: predict(batch_size={args.batch_size}) on {args.plain_requests} of them")  # fmt: skip
    rows = []
    for shape in args.shapes:
        folder = str(rerank.build(models.CACHE / f"rerank-{shape}", rerank.SHAPES[shape]))
        plain = CrossEncoder(folder, device="cpu")
        # --documents pairs of up to 512 tokens: over the default bound on a CPU (32 full-length pairs)
        bound = str(args.documents * 512)
        process, url = start_server(folder, "--task", "rerank", "--no-access-log", "--max-request-tokens", bound)
        try:
            burst(url, requests[:2], 2)  # warm-up
            plain.predict(pairs_of(requests[0]), batch_size=args.batch_size)
            plain_seconds, server_seconds, diff = [], [], 0.0
            for _ in range(args.rounds):
                start = time.perf_counter()
                expected = [
                    plain.predict(pairs_of(r), batch_size=args.batch_size) for r in requests[: args.plain_requests]
                ]
                plain_seconds.append(time.perf_counter() - start)
                seconds, scores = burst(url, requests, args.clients)
                server_seconds.append(seconds)
                got = np.array(scores[: args.plain_requests], dtype=np.float32)
                diff = max(diff, float(np.abs(got - np.stack(expected)).max()))
        finally:
            process.terminate()
            process.wait(60)
        plain_rate = args.plain_requests * args.documents / statistics.median(plain_seconds)
        server_rate = len(requests) * args.documents / statistics.median(server_seconds)
        row = {"shape": shape, "plain_pairs_per_s": plain_rate, "server_pairs_per_s": server_rate,
               "ratio": server_rate / plain_rate, "plain_seconds": plain_seconds, "server_seconds": server_seconds,
               "max_abs_diff_vs_plain": diff}  # fmt: skip
        rows.append(row)
        print(f"{shape}: plain predict {plain_rate:.1f} pairs/s, server /v1/rerank ({args.clients} clients) "
              f"{server_rate:.1f} pairs/s, {row['ratio']:.2f}x; max|score diff| {diff:.1e}", flush=True)  # fmt: skip
    stamp = report.stamp()
    payload = {"date": stamp, "machine": report.machine(), "torch": torch.__version__, "rows": rows}
    print(f"written to {report.results_file(args.output_dir, 'bench-rerank-server', payload, stamp)}")


if __name__ == "__main__":
    main()
