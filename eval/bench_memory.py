"""Resident memory over many small encode() calls, plain sentence-transformers and the fast backend side
by side.

Each backend runs in a fresh process: it loads the model, makes one warm-up call, reads its resident set
size (RSS), then makes --calls encode() calls of 1 to --max-texts STS-B test sentences each and reads its
RSS again (and after each quarter of the calls). Both backends get the same seeded sequence of calls, so
almost every call has a different token count, as a server's batches do. Prints RSS before, after and
the growth per backend, the fast backend's growth over plain's, and the seconds the calls took.

    .venv/bin/python eval/bench_memory.py                           # all-MiniLM-L6-v2, 1,200 calls
    .venv/bin/python eval/bench_memory.py --models minilm mistral --calls 300

"mistral" is bench.py's small random Mistral (hidden 512, 4 layers) with MiniLM's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

from harness import data, measure, models, options, report

BACKENDS = {"torch": "plain", "fast": "fast"}


def calls(texts: list[str], count: int, max_texts: int, seed: int = 0) -> list[list[str]]:
    """`count` runs of 1 to `max_texts` consecutive sentences from seeded random places."""
    rng = random.Random(seed)
    runs = []
    for _ in range(count):
        n = rng.randint(1, max_texts)
        start = rng.randrange(len(texts) - n)
        runs.append(texts[start : start + n])
    return runs


def child(backend: str, folder: str, args: argparse.Namespace) -> None:
    """Load, warm up, run the calls in this process; prints a JSON line."""
    from st_fastbackend import SentenceTransformer

    runs = calls(data.sts_sentences(args.data_dir), args.calls, args.max_texts)
    model = SentenceTransformer(folder, backend=backend, device="cpu")
    model.encode(runs[0], batch_size=args.batch_size)
    before, checkpoints = measure.rss_mib(), []
    start = time.perf_counter()
    for i, texts in enumerate(runs, 1):
        model.encode(texts, batch_size=args.batch_size)
        if i % max(1, len(runs) // 4) == 0:
            checkpoints.append(round(measure.rss_mib(), 1))
    seconds = time.perf_counter() - start
    print(json.dumps({"before": before, "after": measure.rss_mib(), "checkpoints": checkpoints, "seconds": seconds}))


def main() -> None:
    parser = options.parser(__doc__, "batch_size", "data_dir")
    parser.add_argument("--models", nargs="+", default=["minilm"], choices=["minilm", "mistral"])
    parser.add_argument("--calls", type=int, default=1200)
    parser.add_argument("--max-texts", type=int, default=32, help="sentences per call: 1 to this many")
    parser.add_argument("--out", default=None, help="JSON file (default eval/results/memory-<time>.json)")
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args)
    results = {}
    out_path = args.out or options.RESULTS_DIR / f"memory-{report.stamp()}.json"
    print(f"{args.calls} encode() calls of 1-{args.max_texts} STS-B sentences, each backend in a fresh process")
    print("| model | backend | RSS before, MiB | RSS after, MiB | growth, MiB | RSS after each quarter | calls, s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        folder = models.model_path(name)
        for backend, label in BACKENDS.items():
            command = [sys.executable, __file__, *sys.argv[1:], "--child", backend, folder]
            env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            r = results[f"{name}/{backend}"] = json.loads(out.splitlines()[-1])
            quarters = " / ".join(f"{x:,.0f}" for x in r["checkpoints"])
            print(f"| {name} | {label} | {r['before']:,.0f} | {r['after']:,.0f} | {r['after'] - r['before']:,.0f} "
                  f"| {quarters} | {r['seconds']:,.0f} |", flush=True)  # fmt: skip
        plain, fast = (results[f"{name}/{b}"]["after"] - results[f"{name}/{b}"]["before"] for b in BACKENDS)
        ratio = f"{fast / plain:.2f}x" if plain > 0 else "–"
        print(f"| {name} | growth fast / plain | | | {ratio} | | |", flush=True)
        report.write_json(out_path, {"args": vars(args), "results": results})  # after each model
    print(f"written {out_path}")


if __name__ == "__main__":
    main()
