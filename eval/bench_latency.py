"""Latency of one encode() call on a short input: plain sentence-transformers and the fast backend (eager and
compiled layer seams) on the same texts, calls alternating, median and 90th percentile in milliseconds.

    python eval/bench_latency.py                       # MiniLM and the small Mistral, 1 and 32 STS-B sentences
    python eval/bench_latency.py --models minilm --calls 500

One short text is what a search box sends: the fast backend must not be slower there than plain (where the
seams are compiled, they run so only for packs of at least engine/fused.py's MIN_TOKENS tokens).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch
from bench import DEFAULT_DATA_DIR, run_case, seam_systems, workloads


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--models", nargs="+", default=["minilm", "mistral"], choices=["minilm", "mistral"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 32], help="texts per call")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    sentences = workloads(args.data_dir)["sts"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; STS-B test sentences")
    for name in args.models:
        systems = seam_systems(name)
        for size in args.sizes:
            texts = sentences[:size]
            tokens = sum(map(len, systems["fast"][0].texts.encode(texts)))
            results = run_case(systems, texts, len(texts), args.calls, "cpu")  # calls alternating, after warm-ups
            times = {system: [seconds * 1e3 for seconds in result["times"]] for system, result in results.items()}
            plain = statistics.median(times["plain"])
            cells = [f"{system} {statistics.median(ms):.2f} ms (p90 {np.percentile(ms, 90):.2f}, "
                     f"{plain / statistics.median(ms):.2f}x plain)" for system, ms in times.items()]  # fmt: skip
            print(f"{name}, {size} texts ({tokens} tokens), {args.calls} calls: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
