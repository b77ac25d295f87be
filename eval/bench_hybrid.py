"""BGE-M3's three outputs (dense, lexical weights, ColBERT vectors) from one pass of the fast backend, against
FlagEmbedding's BGEM3FlagModel.encode(return_dense, return_sparse, return_colbert_vecs) and against three separate
passes (one output each), on a random-weight bge-m3-shaped folder (harness.models.bge_m3_shaped) over SciFact
documents (title + " " + text, cut at 512 tokens as FlagEmbedding's passage_max_length does).

    python eval/bench_hybrid.py --flag-python /work/venv-flag/bin/python            # 6 of bge-m3's 24 layers
    python eval/bench_hybrid.py --flag-python /work/venv-flag/bin/python --layers 24 --max-texts 32 --rounds 2

FlagEmbedding runs in its own environment (it does not import under transformers 5; docs/hybrid.md says how that
venv is made) through eval/peer.py, once before the fast backend's rounds and once after, its rounds pooled. Its
encode() runs its first (longest) batch twice (once to find a batch size that fits): "less its probe" subtracts that
forward's time, as if encode() were called once on a whole corpus. Both sides use the same folder, texts and
batch_size, both FlagEmbedding's API (`st_fastbackend.flag`), both fp32 (FlagEmbedding casts to fp32 on a CPU
whatever use_fp16 says). Fewer layers than 24 keep every layer's work, so the ratio, the real model's (embeddings
and heads are a small share). Memory, each system in its own process: the peak resident memory an untimed call adds
above the warm process (PeakMemory), the warm process's (after a first call on one batch) and the process's peak
(VmHWM, at the end). Fidelity: the fast outputs against FlagEmbedding's (max |diff|; each text's lexical ids and
number of ColBERT vectors the same).
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from harness import data, measure, models, options, report

from st_fastbackend.flag import BGEM3FlagModel

MAX_LENGTH = 512
OUTPUTS = ("return_dense", "return_sparse", "return_colbert_vecs")


def arguments():
    parser = options.parser(__doc__, "data_dir", "batch_size", "rounds", "output_dir")
    parser.add_argument("--flag-python", required=True, help="the Python of an environment with flagembedding 1.4.2")
    parser.add_argument("--layers", type=int, default=6, help="of bge-m3's 24")
    parser.add_argument("--max-texts", type=int, default=128, help="the first N SciFact documents")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/st_fastbackend_peers"))
    return parser.parse_args()


def flag_embedding(python: str, folder: str, texts: list[str], args) -> dict:
    """eval/peer.py --system flagembedding-m3 in FlagEmbedding's environment: its outputs, seconds and memory."""
    with tempfile.TemporaryDirectory() as work:
        texts_file, out = Path(work) / "texts.json", Path(work) / "out.npz"
        texts_file.write_text(json.dumps(texts))
        command = [python, str(options.REPO / "eval" / "peer.py"), "--system", "flagembedding-m3", "--model", folder,
                   "--texts", str(texts_file), "--batch-size", str(args.batch_size), "--rounds", str(args.rounds),
                   "--out", str(out), "--work-dir", str(args.work_dir), "--max-length", str(MAX_LENGTH)]  # fmt: skip
        subprocess.run(command, check=True)
        with np.load(out) as result:
            return {name: result[name] for name in result.files}


def split(values: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    return np.split(values, np.cumsum(counts)[:-1])


def fidelity(fast: dict, flag: dict) -> dict:
    """The fast outputs against FlagEmbedding's: max |diff| of each, and the texts whose lexical ids or number of
    ColBERT vectors differ."""
    ids, values = split(flag["sparse_ids"], flag["sparse_counts"]), split(flag["sparse_values"], flag["sparse_counts"])
    lexical = [dict(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, values, strict=True)]
    colbert = split(flag["colbert"], flag["colbert_counts"])
    mine = [{int(k): float(v) for k, v in row.items()} for row in fast["lexical_weights"]]
    same_shape = [a.shape == b.shape for a, b in zip(fast["colbert_vecs"], colbert, strict=True)]
    return {
        "dense_max_abs_diff": float(np.abs(fast["dense_vecs"] - flag["embeddings"]).max()),
        # an id one side keeps and the other does not (a weight at the edge of relu's zero) counts its weight
        "lexical_max_abs_diff": max(
            [abs(a.get(k, 0.0) - b.get(k, 0.0)) for a, b in zip(mine, lexical, strict=True) for k in a | b],
            default=0.0,  # no text with an id on either side: a deep random stack can zero every weight
        ),
        "texts_lexical_ids_differ": sum(a.keys() != b.keys() for a, b in zip(mine, lexical, strict=True)),
        "colbert_max_abs_diff": max(
            float(np.abs(a - b).max()) for a, b, s in zip(fast["colbert_vecs"], colbert, same_shape, strict=True) if s
        ),
        "texts_colbert_count_differs": same_shape.count(False),
    }


def main() -> None:
    args = arguments()
    documents = [data.document(row) for row in data.scifact_corpus(args.data_dir)]
    folder = models.CACHE / f"bge-m3-{args.layers}l"
    if not (folder / "modules.json").is_file():  # built in a process of its own: this one's memory is measured
        shape = {**models.XLM_ROBERTA_LARGE_SHAPED, "num_hidden_layers": args.layers}
        builder = multiprocessing.get_context("spawn").Process(
            target=models.bge_m3_shaped, args=(folder, shape, documents)
        )
        builder.start()
        builder.join()
    folder = str(folder)
    texts = documents[: args.max_texts]
    print(f"bge-m3 shape, {args.layers} of 24 layers; {len(texts)} SciFact documents; batch_size {args.batch_size}")

    runs = [flag_embedding(args.flag_python, folder, texts, args)]  # before the fast rounds; again after
    fast = BGEM3FlagModel(folder, passage_max_length=MAX_LENGTH)
    tokens = sum(len(ids) for ids in fast.model.tokenizer(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"])
    all_three = dict.fromkeys(OUTPUTS, True)

    def one_pass():
        return fast.encode(texts, batch_size=args.batch_size, **all_three)

    def three_passes():
        return [fast.encode(texts, batch_size=args.batch_size, **{k: k == o for k in OUTPUTS}) for o in OUTPUTS]

    fast.encode(texts[: args.batch_size], **all_three)  # warm-up
    loaded = measure.rss_bytes()
    with measure.PeakMemory("cpu") as memory:
        outputs = one_pass()
    seconds = measure.alternate({"one pass": one_pass, "three passes": three_passes}, args.rounds).seconds
    runs.append(flag_embedding(args.flag_python, folder, texts, args))

    flag_seconds = [s for run in runs for s in run["seconds"].tolist()]
    unprobed = [s - p for run in runs for s, p in zip(run["seconds"], run["probe_seconds"], strict=True)]
    flag_peak = max(int(r["peak_extra_bytes"]) for r in runs)
    flag_rss = [int(runs[0]["loaded_bytes"]), max(int(r["peak_rss_bytes"]) for r in runs)]
    fast_rss = [loaded, measure.peak_rss_bytes()]
    systems = {
        "FlagEmbedding BGEM3FlagModel": (flag_seconds, flag_peak, flag_rss),
        "FlagEmbedding, less its probe": (unprobed, None, flag_rss),
        "fast, one pass": (seconds["one pass"], memory.extra, fast_rss),
        "fast, three passes": (seconds["three passes"], None, fast_rss),
    }
    base = statistics.median(flag_seconds)
    rows = {}
    for name, (times, extra, (resident, peak)) in systems.items():
        median = statistics.median(times)
        rows[name] = {"seconds": [float(s) for s in times], "tokens_per_s": tokens / median,
                      "x_flagembedding": base / median, "loaded_mib": resident / 2**20, "peak_rss_mib": peak / 2**20,
                      "peak_extra_mib": None if extra is None else extra / 2**20}  # fmt: skip
        mib = "" if extra is None else f", a call's peak extra {extra / 2**20:,.0f} MiB"
        process = f"process: warm {resident / 2**20:,.0f} MiB, peak {peak / 2**20:,.0f} MiB"
        print(f"{name:30s} {rows[name]['tokens_per_s']:8,.0f} tokens/s  {rows[name]['x_flagembedding']:.2f}x "
              f"FlagEmbedding{mib}; {process}")  # fmt: skip
    compared = fidelity(outputs, runs[0])
    memory_ratio = memory.extra / flag_peak
    peak_ratio = fast_rss[1] / flag_rss[1]
    print(
        f"a call's peak extra memory, fast / FlagEmbedding: {memory_ratio:.2f}; the process's peak: {peak_ratio:.2f}"
    )
    print(f"fidelity to FlagEmbedding: {compared}")

    machine = report.machine("cpu")
    payload = {"date": report.stamp(), "machine": machine, "layers": args.layers, "texts": len(texts),
               "tokens": tokens, "batch_size": args.batch_size, "rows": rows, "memory_ratio": memory_ratio,
               "peak_rss_ratio": peak_ratio, "fidelity": compared}  # fmt: skip
    out = report.results_file(args.output_dir, "bench_hybrid", payload)
    print(f"machine: {machine}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
