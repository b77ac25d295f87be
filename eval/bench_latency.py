"""Latency of one encode() call on a short input: plain sentence-transformers and the fast backend (eager and
compiled layer seams) on the same texts, calls alternating, median and 90th percentile in milliseconds.

    python eval/bench_latency.py                       # MiniLM and the small Mistral, 1 and 32 STS-B sentences
    python eval/bench_latency.py --models minilm --calls 500
    python eval/bench_latency.py --models minilm --block 20   # warm: 20 calls of a system in a row

Calls alternating one by one, each finds the caches holding the other systems' weights (a MiniLM call reads 42 MB
of fp32 layer weights): the latency of a process that serves several models. --block N: each
system's calls in turns of N in a row (after an untimed one), the latency of a server of one model.

One short text is what a search box sends: the fast backend must not be slower there than plain (where the
seams are compiled, they run so only for packs of at least engine/fused.py's MIN_TOKENS tokens).
--int8 adds the fast backend with quantize="int8"; --one-thread adds the fast backend run with one intra-op
thread for the call (torch.set_num_threads(1), put back after): what the thread pool's hand-offs cost a short call.
"""

from __future__ import annotations

import contextlib
import statistics

import numpy as np
import torch
from harness import data, measure, models, options


@contextlib.contextmanager
def one_thread():
    """One intra-op thread for the call."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = options.parser(__doc__, "data_dir")
    parser.add_argument("--models", nargs="+", default=["minilm", "mistral"], choices=["minilm", "mistral"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 32], help="texts per call")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--block", type=int, default=1, help="calls of a system in a row (1: alternating each call)")
    parser.add_argument("--int8", action="store_true", help="also the fast backend with quantize='int8'")
    parser.add_argument("--one-thread", action="store_true", help="also plain and fast with one thread per call")
    args = parser.parse_args()
    if not 1 <= args.block <= args.calls:
        parser.error(f"--block {args.block}: between 1 and --calls ({args.calls})")
    sentences = data.sts_sentences(args.data_dir)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; STS-B test sentences")
    for name in args.models:
        systems = models.seam_systems(name)
        if args.int8:
            systems["fast, int8"] = models.int8_systems(systems["fast"][0].folder.as_posix(), "cpu")["fast_int8"]
        if args.one_thread:
            systems.update({f"{s}, 1 thread": models.Around(systems[s], one_thread) for s in ("plain", "fast")})
        for size in args.sizes:
            texts = sentences[:size]
            tokens = sum(map(len, systems["fast"][0].texts.encode(texts)))
            rounds = args.calls // args.block  # timed calls per system: rounds x block (args.calls rounded down)
            results = measure.encode_rounds(systems, texts, len(texts), rounds, "cpu", block=args.block)
            times = {system: [seconds * 1e3 for seconds in result["times"]] for system, result in results.items()}
            plain = statistics.median(times["plain"])
            cells = [f"{system} {statistics.median(ms):.2f} ms (p90 {np.percentile(ms, 90):.2f}, "
                     f"{plain / statistics.median(ms):.2f}x plain)" for system, ms in times.items()]  # fmt: skip
            order = "alternating" if args.block == 1 else f"in turns of {args.block}"
            head = f"{name}, {size} texts ({tokens} tokens), {rounds * args.block} calls {order}: "
            print(head + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
