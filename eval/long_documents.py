"""Long documents (issue 31): SciFact retrieval with the real all-MiniLM-L6-v2 when documents do not fit its window.

For max_seq_length 128 and 256: truncation (plain encode), chunk + mean (one vector per document, the chunks'
token-weighted mean), chunk + max-sim (a document scores its best chunk: one vector per chunk, the same chunks),
and late chunking (each document run in windows of 512 positions, each chunk pooled over its span). nDCG@10 over
the full corpus with pytrec_eval, documents as title + " " + text (as MTEB and eval/quality.py read them), with
the time and the tokens each mode runs (chunk + mean and chunk + max-sim share one encode_chunks run).

    python eval/long_documents.py                       # both lengths, every mode
    python eval/long_documents.py --sample 1000         # the judged documents + others, 1,000 in all

Writes eval/results/long_documents-<date>-<time>.json.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import torch
from harness import data, measure, options, report
from quality import ndcg10


def load_scifact(data_dir: Path, sample: int | None):
    """qrels, the test queries, and the corpus: whole, or (`sample`) every judged document and the others drawn
    at random (seed 0) up to `sample` documents, in corpus order."""
    qrels, queries, corpus = data.beir(data_dir / "scifact", "test")
    if sample is not None:
        judged = {doc for judgments in qrels.values() for doc in judgments}
        others = [i for i, d in enumerate(corpus) if d["_id"] not in judged]
        drawn = set(random.Random(0).sample(others, max(0, sample - len(judged))))
        corpus = [d for i, d in enumerate(corpus) if d["_id"] in judged or i in drawn]
    return qrels, queries, corpus


def run_modes(model, queries: np.ndarray, docs: list[str], window: int, batch_size: int):
    """(mode, scores [queries, documents], seconds, tokens run) for each mode at the model's max_seq_length."""
    from st_fastbackend import Chunking

    q = torch.from_numpy(queries)
    lengths = [len(ids) for ids in model.tokenizer(docs, add_special_tokens=False)["input_ids"]]
    limit = model.max_seq_length
    start = time.perf_counter()
    plain = torch.from_numpy(model.encode(docs, batch_size=batch_size))
    yield "truncation", q @ plain.T, time.perf_counter() - start, sum(min(n + 2, limit) for n in lengths)

    start = time.perf_counter()
    found = model.encode_chunks(docs, Chunking(aggregate=None), batch_size=batch_size)
    seconds = time.perf_counter() - start
    tokens = sum(e - s + 2 for chunks in found for s, e in chunks.token_spans)
    yield "chunk + mean", q @ token_weighted_means(found).T, seconds, tokens
    best = torch.stack([(q @ torch.from_numpy(chunks.embeddings).T).amax(1) for chunks in found], dim=1)
    yield "chunk + max-sim", best, seconds, tokens

    start = time.perf_counter()
    late = model.encode_chunks(docs, Chunking(aggregate=None, late=True, context=window), batch_size=batch_size)
    seconds = time.perf_counter() - start
    room = window - 2
    windows = sum(-(-n // room) if n else 1 for n in lengths)  # about: a window holds whole chunks
    yield "late + mean", q @ token_weighted_means(late).T, seconds, sum(lengths) + 2 * windows
    best = torch.stack([(q @ torch.from_numpy(chunks.embeddings).T).amax(1) for chunks in late], dim=1)
    yield "late + max-sim", best, seconds, sum(lengths) + 2 * windows


def token_weighted_means(found) -> torch.Tensor:
    """[documents, dim]: each document's chunks' mean weighted by their tokens, unit-norm (MiniLM normalises: so
    does the mean aggregate)."""
    means = []
    for chunks in found:
        weights = np.array([max(e - s, 1) for s, e in chunks.token_spans], dtype=np.float32)[:, None]
        mean = (chunks.embeddings * weights).sum(0) / weights.sum()
        means.append(mean / np.linalg.norm(mean))
    return torch.from_numpy(np.stack(means))


def speed(model, docs: list[str], rounds: int, batch_size: int, window: int) -> list[dict]:
    """What chunking costs beyond its tokens, alternating `rounds` times: encode_chunks against plain encode of
    the chunks' own texts (the same tokens, give or take a word cut at a chunk's edge), and late chunking against
    plain encode of the documents at max_seq_length = the window (about the same tokens, in the same lengths)."""
    from st_fastbackend import Chunking

    length = model.max_seq_length
    found = model.encode_chunks(docs, Chunking(aggregate=None), batch_size=batch_size)
    pieces = [doc[a:b] for doc, chunks in zip(docs, found, strict=True) for a, b in chunks.char_spans]
    ids = model.tokenizer(docs, add_special_tokens=False)["input_ids"]

    def at_window(call):
        model.max_seq_length = window
        try:
            return call()
        finally:
            model.max_seq_length = length

    late = Chunking(aggregate=None, late=True, context=window)
    runs = {"encode_chunks": lambda: model.encode_chunks(docs, Chunking(aggregate=None), batch_size=batch_size),
            "encode of the chunk texts": lambda: model.encode(pieces, batch_size=batch_size),
            "late encode_chunks": lambda: model.encode_chunks(docs, late, batch_size=batch_size),
            f"encode at {window} tokens": lambda: at_window(lambda: model.encode(docs, batch_size=batch_size)),
            }  # fmt: skip
    tokens = {"encode_chunks": sum(e - s + 2 for c in found for s, e in c.token_spans),
              "encode of the chunk texts": sum(len(t) for t in model.tokenizer(pieces)["input_ids"]),
              "late encode_chunks": sum(len(t) + 2 * -(-len(t) // (window - 2)) for t in ids),
              f"encode at {window} tokens": sum(min(len(t) + 2, window) for t in ids)}  # fmt: skip
    seconds = measure.alternate(runs, rounds).seconds
    rows = [{"max_seq_length": length, "mode": name, "tokens": tokens[name], "seconds": [round(t, 2) for t in times],
             "tokens_per_s": round(tokens[name] / min(times))} for name, times in seconds.items()]  # fmt: skip
    for row in rows:
        best = min(row["seconds"])
        print(f"{length:>4}  {row['mode']:<26} {row['tokens']:>9,} tokens  best {best:.1f} s"
              f"  {row['tokens_per_s']:>7,} tokens/s", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = options.parser(__doc__, "batch_size", "data_dir")
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 256], help="max_seq_length values")
    parser.add_argument("--window", type=int, default=512, help="late chunking's window (positions)")
    parser.add_argument("--sample", type=int, default=None,
                        help="the judged documents and others at random, N in all (a smaller benchmark)")  # fmt: skip
    parser.add_argument("--speed-docs", type=int, default=None,
                        help="only the speed check: encode_chunks on N documents, encode of their chunks")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the speed check")
    args = parser.parse_args()

    from st_fastbackend import SentenceTransformer

    model = SentenceTransformer(options.minilm_path(), backend="fast", device="cpu")
    qrels, queries, corpus = load_scifact(args.data_dir, args.sample)
    docs = list(map(data.document, corpus))
    rows = []
    if args.speed_docs:
        for length in args.lengths:
            model.max_seq_length = length
            rows += speed(model, docs[: args.speed_docs], args.rounds, args.batch_size, args.window)
    for length in args.lengths if not args.speed_docs else []:
        model.max_seq_length = length
        q = model.encode([x["text"] for x in queries], batch_size=args.batch_size)
        for mode, scores, seconds, tokens in run_modes(model, q, docs, args.window, args.batch_size):
            score = ndcg10(qrels, queries, corpus, scores)
            row = {"max_seq_length": length, "mode": mode, "ndcg@10": score, "seconds": round(seconds, 1),
                   "tokens": tokens, "tokens_per_s": round(tokens / seconds)}  # fmt: skip
            rows.append(row)
            print(f"{length:>4}  {mode:<16} nDCG@10 {row['ndcg@10']:.4f}  {seconds:7.1f} s  {tokens:>9,} tokens"
                  f"  {row['tokens_per_s']:>7,} tokens/s", flush=True)  # fmt: skip
    meta = {"machine": report.machine(), "threads": torch.get_num_threads(), "documents": len(docs),
            "sample": args.sample, "queries": len(queries), "window": args.window}  # fmt: skip
    name = "long_documents-speed" if args.speed_docs else "long_documents"
    print(f"wrote {report.results_file(options.RESULTS_DIR, name, {'meta': meta, 'rows': rows})}")


if __name__ == "__main__":
    main()
