"""Closed-loop load on `st-fastbackend serve`: N concurrent clients each send one-sentence requests
back to back on loopback. Throughput and p50/p99 latency with dynamic batching and without it (one
request per forward pass), same model, same sentences.

    python eval/bench_server.py                      # bundled all-MiniLM-L6-v2, 1 / 8 / 64 clients
    python eval/bench_server.py --clients 1 --server-args="--no-access-log"   # the server without its line per request
"""

from __future__ import annotations

import asyncio
import shlex
import statistics
import time

import aiohttp
from harness import data, options, report
from harness.serve import start_server


def load(url: str, texts: list[str], clients: int, seconds: float) -> dict:
    """`clients` concurrent closed-loop clients as tasks on one asyncio loop (aiohttp): a light load
    generator, since on a small machine it shares the cores with the server it measures."""
    return asyncio.run(_load(url, texts, clients, seconds))


async def _load(url: str, texts: list[str], clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def client(http: aiohttp.ClientSession, offset: int) -> None:
        i = offset
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            async with http.post(f"{url}/v1/embeddings", json={"input": texts[i % len(texts)]}) as response:
                response.raise_for_status()
                await response.read()
            latencies.append(time.perf_counter() - start)
            i += clients

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        begin = time.perf_counter()
        await asyncio.gather(*(client(http, k) for k in range(clients)))
        elapsed = time.perf_counter() - begin
    latencies.sort()
    return {
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "requests": len(latencies),
    }


def main() -> None:
    parser = options.parser(__doc__, "model", "data_dir", "output_dir")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--server-args", default="", help="more `st-fastbackend serve` arguments, for every server")
    args = parser.parse_args()
    texts = data.sts_sentences(args.data_dir, columns=("sentence1",))
    rows = []
    for dynamic in (True, False):
        process, url = start_server(args.model, *shlex.split(args.server_args),
                                   *([] if dynamic else ["--no-dynamic-batching"]))  # fmt: skip
        try:
            load(url, texts, 4, 2.0)  # warm-up
            for clients in args.clients:
                row = {"dynamic_batching": dynamic, "clients": clients, **load(url, texts, clients, args.seconds)}
                rows.append(row)
                print(f"{'dynamic' if dynamic else 'one per forward':<16} {clients:>3} clients  "
                      f"{row['requests_per_s']:8.1f} req/s  p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms",
                      flush=True)  # fmt: skip
        finally:
            process.terminate()
            process.wait(60)
    for clients in args.clients:
        on, off = (
            next(r for r in rows if r["clients"] == clients and r["dynamic_batching"] is d) for d in (True, False)
        )
        ratio = on["requests_per_s"] / off["requests_per_s"]
        p99 = f"p99 {on['p99_ms']:.0f} vs {off['p99_ms']:.0f} ms"
        print(f"{clients:>3} clients: dynamic batching {ratio:.2f}x throughput, {p99}")
    stamp = report.stamp()
    payload = {"date": stamp, "machine": report.machine(), "model": args.model, "server_args": args.server_args,
               "rows": rows}  # fmt: skip
    out = report.results_file(args.output_dir, "bench-server", payload, stamp)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
