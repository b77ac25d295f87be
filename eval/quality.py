"""Embedding quality on real data, plain sentence-transformers and the fast backend side by side.

STS-B (test, dev) and SICK-R: Spearman correlation of cosine similarity with the gold scores, as MTEB
computes it. SciFact (BEIR layout): nDCG@10 over the full corpus with pytrec_eval, documents encoded
as title + " " + text, as MTEB does. Published MTEB figures come from reference_scores.tsv.

    python eval/quality.py                        # bundled all-MiniLM-L6-v2, both backends, all tasks
    python eval/quality.py --backend fast --tasks stsb-test sickr
    python eval/quality.py --data-dir /data    # holds stsb/, sick/, scifact/ (and reference_scores/)
    python eval/quality.py --quantize int8 --peers onnx-int8=/tmp/stpeer/bin/python openvino-int8=/tmp/...

--quantize adds the fast backend with model_kwargs={"quantize": ...}; --peers adds systems run in their own
environment through eval/peer.py (sentence-transformers' int8 exports; MiniLM has no prompts, so a peer's
encode() stands for encode_query and encode_document). STS tasks also report 1 - cosine to plain fp32 per text
(worst and median over both columns).

Each run writes a new eval/results/quality-<model>-<date>-<time>.json.
"""

from __future__ import annotations

import datetime
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, also where a test loads this file
from harness import data, models, options, report  # noqa: E402

MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass(frozen=True)
class StsTask:
    file: str  # under the data dir, tab separated, read with csv.QUOTE_NONE
    columns: tuple[str, str, str]  # sentence 1, sentence 2, gold score
    reference: tuple[str, str]  # (MTEB task, split) in reference_scores.tsv


@dataclass(frozen=True)
class RetrievalTask:
    folder: str  # BEIR layout: corpus.jsonl, queries.jsonl, qrels/<split>.tsv
    split: str
    reference: tuple[str, str]


TASKS = {
    "stsb-test": StsTask("stsb/stsb-test.tsv", ("sentence1", "sentence2", "score"), ("STSBenchmark", "test")),
    "stsb-dev": StsTask("stsb/stsb-dev.tsv", ("sentence1", "sentence2", "score"), ("STSBenchmark", "validation")),
    # MTEB's SICK-R "test" split is all 9,927 pairs (sick/SOURCE.md); this reproduces its figure.
    "sickr": StsTask("sick/sick-full.tsv", ("sentence_A", "sentence_B", "relatedness_score"), ("SICK-R", "test")),
    "scifact": RetrievalTask("scifact", "test", ("SciFact", "test")),
}


def sts_spearman(model, task: StsTask, data_dir: Path, batch_size: int = 32) -> float:
    return sts_scored(model, task, data_dir, batch_size)[0]


def sts_scored(model, task: StsTask, data_dir: Path, batch_size: int = 32) -> tuple[float, np.ndarray]:
    """Spearman of the pairs' cosines with the gold scores, and the embeddings [2 x pairs, dim]."""
    from scipy.stats import spearmanr

    rows = data.read_tsv(data_dir / task.file)
    first, second, gold = task.columns
    a = model.encode([r[first] for r in rows], batch_size=batch_size, normalize_embeddings=True)
    b = model.encode([r[second] for r in rows], batch_size=batch_size, normalize_embeddings=True)
    cosine = (a * b).sum(axis=1)
    return float(spearmanr([float(r[gold]) for r in rows], cosine).statistic), np.concatenate([a, b])


class Peer:
    """A system in its own environment (eval/peer.py) with the encode() this script calls."""

    def __init__(self, system: str, python: str, model: str, data_dir: Path) -> None:
        self.system, self.python, self.model, self.data_dir = system, python, model, data_dir

    def encode(self, texts: list[str], batch_size: int = 32, normalize_embeddings: bool = True) -> np.ndarray:
        out = models.run_peer(self.system, self.python, self.model, "fp32", texts, batch_size, 0, self.data_dir)
        embeddings = out["embeddings"]
        return embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)

    encode_query = encode_document = encode


def retrieval_ndcg10(model, task: RetrievalTask, data_dir: Path, batch_size: int = 32) -> float:
    qrels, queries, corpus = data.beir(data_dir / task.folder, task.split)
    docs = [data.document(d) for d in corpus]
    q = model.encode_query([x["text"] for x in queries], batch_size=batch_size, normalize_embeddings=True)
    d = model.encode_document(docs, batch_size=batch_size, normalize_embeddings=True)
    return ndcg10(qrels, queries, corpus, torch.from_numpy(q) @ torch.from_numpy(d).T)  # cosine: unit-norm sides


def ndcg10(qrels, queries, corpus, scores: torch.Tensor) -> float:
    """scores [queries, documents]; BEIR's evaluation (MTEB's) drops a document whose id equals the query id."""
    import pytrec_eval

    top = scores.topk(min(1000, scores.shape[1]), dim=1)
    run = {}
    for query, values, indices in zip(queries, top.values.tolist(), top.indices.tolist(), strict=True):
        run[query["_id"]] = {
            corpus[i]["_id"]: v for v, i in zip(values, indices, strict=True) if corpus[i]["_id"] != query["_id"]
        }
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
    return float(np.mean([m["ndcg_cut_10"] for m in per_query.values()]))


def published(data_dir: Path, model_name: str, reference: tuple[str, str]) -> float | None:
    """The most precise published figure for (model, task, split)."""
    path = data_dir / "reference_scores" / "reference_scores.tsv"
    if not path.is_file():
        return None
    rows = [r for r in data.read_tsv(path) if (r["model"], r["task"], r["split"]) == (model_name, *reference)]
    return float(max(rows, key=lambda r: len(r["value"]))["value"]) if rows else None


def evaluate(model, task, data_dir: Path, batch_size: int) -> tuple[float, float, np.ndarray | None]:
    """(score, seconds, the STS embeddings or None)."""
    start = time.perf_counter()
    embeddings = None
    if isinstance(task, StsTask):
        score, embeddings = sts_scored(model, task, data_dir, batch_size)
    else:
        score = retrieval_ndcg10(model, task, data_dir, batch_size)
    return score, time.perf_counter() - start, embeddings


def main() -> None:
    from st_fastbackend import SentenceTransformer

    parser = options.parser(__doc__, "data_dir", "model", "batch_size", "output_dir", "peers")
    parser.add_argument("--reference-name", default=None, help="model name in reference_scores.tsv")
    parser.add_argument("--backend", choices=["fast", "torch", "both"], default="both")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=["stsb-test", "sickr", "scifact"])
    parser.add_argument(
        "--quantize", choices=["int8", "int8-static"], default=None, help="also the fast backend, quantized"
    )
    args = parser.parse_args()
    if not args.data_dir.is_dir():
        raise SystemExit(f"No evaluation data at {args.data_dir}; pass --data-dir or set ST_FASTBACKEND_DATA_DIR.")
    reference_name = args.reference_name or (MINILM_NAME if args.model == options.minilm_path() else args.model)
    backends = ["torch", "fast"] if args.backend == "both" else [args.backend]
    device = "cpu" if not torch.cuda.is_available() or args.quantize else None
    models = {b: SentenceTransformer(args.model, backend=b, device=device) for b in backends}
    if args.quantize:
        backends.append(f"fast-{args.quantize}")
        models[backends[-1]] = SentenceTransformer(
            args.model, backend="fast", device="cpu", model_kwargs={"quantize": args.quantize}
        )
    for peer, python in options.peers(args.peers).items():
        backends.append(peer)
        models[peer] = Peer(peer, python, args.model, args.data_dir)

    results = []
    for name in args.tasks:
        task = TASKS[name]
        row = {"task": name, "published": published(args.data_dir, reference_name, task.reference)}
        embeddings = {}
        for backend, model in models.items():
            row[backend], row[f"{backend}_seconds"], embeddings[backend] = evaluate(
                model, task, args.data_dir, args.batch_size
            )
        if "torch" in embeddings and embeddings["torch"] is not None:  # per text, against plain fp32
            for backend, e in embeddings.items():
                distance = 1 - (e * embeddings["torch"]).sum(axis=1)
                row[f"{backend}_1_minus_cos"] = {"max": float(distance.max()), "median": float(np.median(distance))}
        results.append(row)
        print(_format_row(row, backends), flush=True)

    date, machine = datetime.date.today().isoformat(), report.machine(device or "cuda")
    payload = {"model": reference_name, "date": date, "machine": machine, "results": results}
    out = report.results_file(args.output_dir, f"quality-{Path(reference_name).name}", payload, report.stamp(True))
    print(f"written to {out}")


def _format_row(row: dict, backends: list[str]) -> str:
    def fmt(value):
        return "-" if value is None else f"{value:.4f}"

    parts = [f"{row['task']:<10}", f"published {fmt(row['published'])}"]
    for backend in backends:
        label = "plain" if backend == "torch" else backend
        distance = row.get(f"{backend}_1_minus_cos")
        cos = f", 1-cos max {distance['max']:.1e} median {distance['median']:.1e}" if distance else ""
        parts.append(f"{label} {fmt(row[backend])} ({row[f'{backend}_seconds']:.1f}s{cos})")
    if "fast" in row and "torch" in row:
        parts.append(f"|fast-plain| {abs(row['fast'] - row['torch']):.1e}")
    return "  ".join(parts)


if __name__ == "__main__":
    main()
