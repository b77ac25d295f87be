"""CPU/GPU throughput and memory, plain sentence-transformers and the fast backend side by side.

One process, alternating rounds (plain, fast, plain, fast, ...) on the same model and texts; prints
tokens/s (median of rounds), the ratio, max |diff| (fp32) or worst 1 - cosine to the fp32 reference
(bf16, and bf16mm: an fp32 model whose matrix products run in bf16), achieved GFLOP/s against a GEMM
ceiling measured in the same run, and peak extra memory.

    python eval/bench.py                                  # every model, workload and dtype
    python eval/bench.py --models minilm --workloads sts --dtypes fp32 --rounds 3
    python eval/bench.py --peers vllm=/opt/vllm-cpu/bin/python openvino=/opt/ov/bin/python
    python eval/bench.py --models minilm --workloads paragraphs --dtypes fp32 --contention 2  # a busy host
    python eval/bench.py --dtypes fp32 --int8 --peers onnx-int8=/tmp/peer/bin/python openvino-int8=/tmp/peer/bin/python
    python eval/bench.py --models splade colbert --workloads scifact-docs --dtypes fp32 bf16 --batch-size 16
    python eval/bench.py --workloads rerank --dtypes fp32 bf16 --queries 100        # CrossEncoder (issue 29)

splade (a SparseEncoder) and colbert (a MultiVectorEncoder) are timed on encode_document(); their fidelity is on
the dense view [N, vocab] and whether each row's active dimensions are the reference's (splade), per token and
whether each text keeps the reference's number of vectors (colbert).

rerank: CrossEncoder.predict on SciFact claims x 50 SciFact documents each (--queries claims; harness/rerank.py),
on the reranker shapes of --rerank-shapes rather than --models; its fidelity is max |diff| of the logits, fp32 and
bf16 alike, against plain in the same dtype.

--peers runs other systems installed in their own environments through eval/peer.py on the same model
folders and texts (after plain and fast, not interleaved with them) and adds them to the table.
"""

from __future__ import annotations

import gc
import statistics

import numpy as np
import torch
from harness import data, measure, models, options, report, rerank
from sentence_transformers.base.modules import Dense

from st_fastbackend import MultiVectorEncoder, SentenceTransformer, SparseEncoder

# Precision levels: the model's dtype and the dtype its matrix products run in. "bf16mm" is an fp32
# model with PyTorch's torch.backends.mkldnn.matmul.fp32_precision = "bf16" (what
# torch.set_float32_matmul_precision("medium") sets), applied to plain and fast alike.
PRECISIONS = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16mm": (torch.float32, torch.bfloat16),
}
MODELS = ["mistral", "minilm", "embeddinggemma", "modernbert", "splade", "colbert"]
# Workloads whose texts all take a prompt: e5-style instructed queries (SciFact claims).
PROMPTS = {
    "instructed": "Instruct: Given a scientific claim, retrieve documents that support or refute the claim\nQuery: "
}
# "long" (past MiniLM's 256 tokens) and "instructed" (a decoder's) are the Mistral's.
NOT_FOR = {"minilm": ("long", "instructed"), "splade": ("instructed",), "colbert": ("instructed",)}


def workloads(data_dir) -> dict[str, list[str]]:
    return {
        "paragraphs": data.paragraphs(data_dir)[:512],
        "sts": data.sts_sentences(data_dir)[:1024],
        "long": data.articles(data_dir)[:32],
        "instructed": [query["text"] for query in data.scifact_queries(data_dir)][:1000],
        "scifact-docs": [data.document(row) for row in data.scifact_corpus(data_dir)[:128]],
    }


def arguments():
    parser = options.parser(__doc__, "data_dir", "batch_size", "rounds", "device", "output_dir", "peers")
    parser.add_argument("--models", nargs="+", default=["mistral", "minilm"], choices=MODELS)
    parser.add_argument("--workloads", nargs="+", default=["paragraphs", "sts", "long", "instructed"])
    parser.add_argument("--dtypes", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--rerank-shapes", nargs="+", default=list(rerank.SHAPES), choices=list(rerank.SHAPES))
    parser.add_argument("--queries", type=int, default=100, help="rerank: SciFact claims, 50 documents each")
    parser.add_argument("--max-texts", type=int, default=None, help="the first N texts of each workload")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--contention", type=int, default=0, metavar="N",
                        help="N processes spinning on the CPU beside every system's rounds, peers' too: the lead "
                        "on a busy host")  # fmt: skip
    parser.add_argument("--other-seams", action="store_true",
                        help="also the fast backend with its layer seams the other way: compiled where they are eager "
                        "by default (CPU), eager where compiled (CUDA)")  # fmt: skip
    parser.add_argument("--int8", action="store_true",
                        help="fp32 rows: also fast with bf16 products, quantize='int8' and 'int8-static'")  # fmt: skip
    return parser.parse_args()


def compared(systems: dict, path: str, dtype_name: str, prompt: str | None, args) -> dict:
    """Plain and fast, and the fast backend's variants that the options and the workload ask for (--int8: a
    SentenceTransformer's)."""
    out, fast = dict(systems), systems["fast"]
    if prompt:
        out["fast_prompt_every_time"] = models.switched(fast, "prompt_reuse")
    if args.other_seams:
        compiled = not fast[0].runtime.fused
        out[f"fast_{'compiled' if compiled else 'eager'}_seams"] = models.switched(fast, "compiled_seams", compiled)
    if args.int8 and dtype_name == "fp32" and isinstance(fast, SentenceTransformer):
        out.update(models.int8_systems(path, args.device))
    return out


def dense_fidelity(embeddings: np.ndarray, reference: np.ndarray) -> dict:
    """A SentenceTransformer's [N, dim] against the fp32 plain one."""
    cosine = (embeddings * reference).sum(1)  # both unit-norm
    return {"max_abs_diff_vs_fp32_plain": float(np.abs(embeddings - reference).max()),
            "max_1_minus_cos_vs_fp32_plain": float((1 - cosine).max())}  # fmt: skip


def sparse_fidelity(embeddings: np.ndarray, reference: np.ndarray) -> dict:
    """A SparseEncoder's dense view [N, vocab] against the fp32 plain one: max |diff|, worst 1 - cosine (rows are
    not unit-norm), the rows whose active dimensions are exactly the reference's and the dimensions that differ."""
    differ = (embeddings != 0) != (reference != 0)
    norms = np.linalg.norm(embeddings, axis=1) * np.linalg.norm(reference, axis=1)
    cosine = (embeddings * reference).sum(1) / np.maximum(norms, 1e-30)
    return {"max_abs_diff_vs_fp32_plain": float(np.abs(embeddings - reference).max()),
            "max_1_minus_cos_vs_fp32_plain": float((1 - cosine).max()),
            "rows_same_active_dims": int((~differ.any(1)).sum()), "active_dims_differing": int(differ.sum()),
            "active_dims_mean": float((reference != 0).sum(1).mean())}  # fmt: skip


def multivector_fidelity(embeddings: list[np.ndarray], reference: list[np.ndarray]) -> dict:
    """A MultiVectorEncoder's [len_i, dim] per text against the fp32 plain ones: the texts with the reference's
    shape, and over those, max |diff| and worst 1 - cosine per token (vectors unit-norm)."""
    same = [(e, r) for e, r in zip(embeddings, reference, strict=True) if e.shape == r.shape]
    return {"max_abs_diff_vs_fp32_plain": max(float(np.abs(e - r).max()) for e, r in same),
            "max_1_minus_cos_vs_fp32_plain": max(float((1 - (e * r).sum(1)).max()) for e, r in same),
            "texts_same_shape": len(same)}  # fmt: skip


def head_flops(model, tokens: int) -> float:
    """What each token meets after the body, 2 x its weights: SPLADE's masked-LM head (transform and vocabulary
    projection), ColBERT's token projection."""
    if isinstance(model, SparseEncoder):
        head = model.packed_input.head
        return 2.0 * tokens * (head.dense.weight.numel() + head.decoder.weight.numel())
    if isinstance(model, MultiVectorEncoder):
        return 2.0 * tokens * sum(m.linear.weight.numel() for m in model if isinstance(m, Dense))
    return 0.0


def row(case: dict, results: dict, ceiling: float, reference, fidelity=dense_fidelity) -> dict:
    """One (model, dtype, workload): each system's texts/s, tokens/s, FLOP/s, memory and fidelity; fast over plain."""
    out = dict(case)
    for name, result in results.items():
        seconds = statistics.median(result["times"])
        out[name] = {
            "texts_per_s": case["texts"] / seconds,
            "tokens_per_s": case["tokens"] / seconds,
            "gflop_per_s": case["gflop"] / seconds,
            "ceiling_fraction": case["gflop"] / seconds / ceiling,
            "peak_extra_mib": (result["peak_extra_bytes"] or 0) / 2**20,
            "seconds": result["times"],
            "ratio_vs_plain": statistics.median(results["plain"]["times"]) / seconds,
        }
        if reference is not None:
            out[name].update(fidelity(result["embeddings"], reference))
    out["speedup"] = out["fast"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    out["memory_ratio"] = out["fast"]["peak_extra_mib"] / max(out["plain"]["peak_extra_mib"], 1e-9)
    return out


FIDELITY = {"SparseEncoder": sparse_fidelity, "MultiVectorEncoder": multivector_fidelity}


def main() -> None:
    args = arguments()
    peers = options.peers(args.peers)
    if args.threads:
        torch.set_num_threads(args.threads)
    texts_by_workload = workloads(args.data_dir)
    ceilings = {name: measure.gemm_ceiling(PRECISIONS[name][1], args.device) for name in args.dtypes}
    print(f"GEMM ceiling on {args.device}: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in ceilings.items()))
    if args.contention:
        print(f"{args.contention} busy processes beside every system's rounds (--contention)")

    rows = []
    for model_name in args.models if set(args.workloads) - {"rerank"} else []:
        path = models.model_path(model_name)
        references: dict[str, np.ndarray] = {}
        for dtype_name in args.dtypes:
            dtype, product_dtype = PRECISIONS[dtype_name]
            bf16_products = dtype == torch.float32 and product_dtype == torch.bfloat16
            torch.backends.mkldnn.matmul.fp32_precision = "bf16" if bf16_products else "none"
            kind = models.KINDS.get(model_name, "SentenceTransformer")
            systems = models.plain_and_fast(path, kind, device=args.device, dtype=dtype)
            for workload in [w for w in args.workloads if w not in (*NOT_FOR.get(model_name, ()), "rerank")]:
                texts, prompt = texts_by_workload[workload][: args.max_texts], PROMPTS.get(workload)
                token_ids = systems["fast"][0].texts.encode(texts, prompt)
                systems_here = compared(systems, path, dtype_name, prompt, args)
                method = "encode" if kind == "SentenceTransformer" else "encode_document"
                with measure.contention(args.contention):
                    results = measure.encode_rounds(
                        systems_here, texts, args.batch_size, args.rounds, args.device, prompt, method
                    )
                    for peer, python in peers.items():
                        peer_dtype = "fp32" if dtype == torch.float32 else "bf16"  # peers pick their own products
                        results[peer] = models.run_peer(
                            peer, python, path, peer_dtype, texts, args.batch_size, args.rounds
                        )
                if dtype_name == "fp32":
                    references[workload] = results["plain"]["embeddings"]
                tokens = sum(map(len, token_ids))
                gflop = (measure.flops(systems["fast"], token_ids) + head_flops(systems["fast"], tokens)) / 1e9
                case = {"model": model_name, "dtype": dtype_name, "workload": workload, "texts": len(texts),
                        "tokens": tokens, "gflop": gflop}  # fmt: skip
                fidelity = FIDELITY.get(kind, dense_fidelity)
                rows.append(row(case, results, ceilings[dtype_name], references.get(workload), fidelity))
                print(_format(rows[-1]), flush=True)
            del systems
            gc.collect()
    if "rerank" in args.workloads:
        rows += rerank_rows(args)

    stamp, machine = report.stamp(), report.machine(args.device)
    payload = {
        "date": stamp,
        "machine": machine,
        "torch": torch.__version__,
        "contention": args.contention,
        "ceilings_gflops": ceilings,
        "rows": rows,
    }
    out = report.results_file(args.output_dir, "bench", payload, stamp)
    report.chart(rows, [f"{r['model']}\n{r['dtype']} {r['workload']}" for r in rows], out.with_suffix(".png"))
    print(f"machine: {machine}")  # its load: a busy machine's ratios are distorted
    print(f"written to {out} and {out.with_suffix('.png')}")


def rerank_rows(args) -> list[dict]:
    """The rerank workload on each shape and dtype (bf16mm is not among them): plain and fast predict()."""
    work, rows = rerank.pairs(args.data_dir, args.queries), []
    for shape in args.rerank_shapes:
        folder = str(rerank.build(models.CACHE / f"rerank-{shape}", rerank.SHAPES[shape]))
        for dtype_name in [name for name in args.dtypes if name != "bf16mm"]:
            dtype = PRECISIONS[dtype_name][0]
            torch.backends.mkldnn.matmul.fp32_precision = "none"
            row = rerank.compare(folder, work, dtype, args.device, args.batch_size, args.rounds)
            rows.append({"model": shape, "dtype": dtype_name, "workload": "rerank", **row})
            print(rerank.line(shape, dtype_name, row), flush=True)
            gc.collect()
    return rows


def _format(row: dict) -> str:
    plain, fast = row["plain"], row["fast"]
    if row["dtype"] == "fp32":
        fidelity = f"max|diff| {fast['max_abs_diff_vs_fp32_plain']:.1e}"
    elif "max_1_minus_cos_vs_fp32_plain" in fast:  # absent where --dtypes has no fp32 to compare with
        worst = "max_1_minus_cos_vs_fp32_plain"
        fidelity = f"1-cos fast {fast[worst]:.1e} plain {plain[worst]:.1e}"
    else:
        fidelity = "(no fp32 run to compare with)"
    if "rows_same_active_dims" in fast:
        fidelity += f"  same active dims {fast['rows_same_active_dims']}/{row['texts']} rows"
    if "texts_same_shape" in fast:
        fidelity += f"  same shape {fast['texts_same_shape']}/{row['texts']} texts"
    lines = [
        f"{row['model']:<8} {row['dtype']:<5} {row['workload']:<11} {row['tokens']:>7} tok  "
        f"plain {plain['tokens_per_s']:>7.0f} tok/s ({plain['ceiling_fraction']:.0%})  "
        f"fast {fast['tokens_per_s']:>7.0f} tok/s ({fast['ceiling_fraction']:.0%})  {row['speedup']:.2f}x  "
        f"{fidelity}  peak MiB plain {plain['peak_extra_mib']:.0f} fast {fast['peak_extra_mib']:.0f}"
    ]
    for other in [name for name in row if isinstance(row[name], dict) and name not in ("plain", "fast")]:
        fidelity = row[other].get("max_1_minus_cos_vs_fp32_plain", float("nan"))
        speed = f"{row[other]['tokens_per_s']:>7.0f} tok/s  {row[other]['ratio_vs_plain']:.2f}x plain"
        lines.append(f"    {other:<22} {speed}  max 1-cos vs fp32 plain {fidelity:.1e}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
