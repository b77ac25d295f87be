"""The GPU benchmark: e5-mistral-7b's architecture with random bf16 weights, plain
sentence-transformers and the fast backend side by side on the same texts, in one process.

1. the bf16 matrix-product ceiling (one large GEMM, median of timed runs);
2. correctness: on a 4-layer copy, fast and plain at fp32 (max |diff|) and both in bf16 against the fp32
   reference, with the rule "our bf16 error <= 3x plain's own bf16 error";
3. the model built on the GPU and saved once as a sentence-transformers folder (lasttoken, Normalize); fast vs
   plain on 64 paragraphs (both bf16);
4. tokens/s for plain (sdpa, padded, its best batch_size of 8/16/32) and fast on fixed lengths (128 ... 32,768
   tokens per input: e5-mistral's window is 32k), on real Wikipedia paragraphs and on 1,000 SciFact claims after
   an e5-style instruction, with the ratio, MFU (achieved FLOP/s over the measured ceiling; 2 x non-embedding
   parameters per token plus attention) and each system's peak GPU memory above its weights; the fast backend
   also with its layer seams eager, and on the instructed claims with the instruction run for every claim;
5. latency: one encode() call of 32 short queries, ms (median);
6. --hybrid: SPLADE and ColBERT (issue 30), bert-base widths, random weights, bf16, encode_document on SciFact
   documents;
7. --rerank: ms-marco-MiniLM-L6, bge-reranker-base and Qwen3-Reranker-0.6B shapes at their full depth, random
   weights, bf16, CrossEncoder.predict on SciFact claims x 50 documents each;
8. the table, written to --out as JSON and Markdown after every row (a run cut short still reports), printed last.

--check is the short form eval/gpu_check.sh runs inside its budget: plain at batch_size 16 only, fast at 512
only, no switches, lengths first. Run through eval/gpu_check.sh (`gpu_check.sh bench`: the full form), which
installs what the device machine lacks. `--dry-run` runs every step on a CPU with a 2-layer, narrow model and a
few texts.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from bench import PROMPTS
from harness import data, measure, models, options, rerank
from sentence_transformers import SentenceTransformer as PlainSentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling
from transformers import AutoTokenizer, MistralConfig, MistralModel

from st_fastbackend import SentenceTransformer

# intfloat/e5-mistral-7b-instruct's config.json
E5_MISTRAL_7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096, rope_theta=10000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
DRY_RUN = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2
)  # fmt: skip
MODULES = [
    ("", "sentence_transformers.base.modules.transformer.Transformer"),
    ("1_Pooling", "sentence_transformers.sentence_transformer.modules.pooling.Pooling"),
    ("2_Normalize", "sentence_transformers.base.modules.normalize.Normalize"),
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def build_folder(folder: Path, tokenizer_dir: Path, device: str, **overrides) -> Path:
    """Random weights created on `device` in bf16, saved with a tokenizer and sentence-transformers' files."""
    config = MistralConfig(**{**E5_MISTRAL_7B, **overrides})
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = MistralModel(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    del model
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    for (path, _), module in zip(MODULES[1:], (Pooling(config.hidden_size, "lasttoken"), Normalize()), strict=True):
        (folder / path).mkdir()
        module.save(str(folder / path))
    modules = [{"idx": i, "name": str(i), "path": path, "type": kind} for i, (path, kind) in enumerate(MODULES)]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    return folder


def load(folder: Path, backend: str, device: str, dtype: torch.dtype):
    kwargs = {"dtype": dtype} if backend == "fast" else {"dtype": dtype, "attn_implementation": "sdpa"}
    cls = SentenceTransformer if backend == "fast" else PlainSentenceTransformer
    return cls(str(folder), backend=backend, device=device, model_kwargs=kwargs)


def encode(model, texts: list[str], batch_size: int, prompt: str | None = None) -> np.ndarray:
    return model.encode(texts, batch_size=batch_size, prompt=prompt, convert_to_numpy=True).astype(np.float32)


def one_minus_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return 1 - (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def check_small_copy(work: Path, tokenizer_dir: Path, texts: list[str], device: str, overrides: dict) -> dict:
    """4 layers of the same architecture: fp32 plain is the reference for both bf16 runs."""
    folder = build_folder(work / "small", tokenizer_dir, device, **{**overrides, "num_hidden_layers": 4})
    reference = encode(load(folder, "torch", device, torch.float32), texts, 16)
    fast32 = encode(load(folder, "fast", device, torch.float32), texts, 16)
    plain16 = encode(load(folder, "torch", device, torch.bfloat16), texts, 16)
    fast16 = encode(load(folder, "fast", device, torch.bfloat16), texts, 16)
    ours, theirs = one_minus_cosine(fast16, reference), one_minus_cosine(plain16, reference)
    shutil.rmtree(folder)
    gc.collect()
    return {
        "fp32_max_abs_diff": float(np.abs(fast32 - reference).max()),
        "bf16_error_fast_max": float(ours.max()),
        "bf16_error_plain_max": float(theirs.max()),
        "bf16_error_fast_mean": float(ours.mean()),
        "bf16_error_plain_mean": float(theirs.mean()),
        "passed": bool(ours.max() <= 3 * theirs.max() and ours.mean() <= 3 * theirs.mean()),
    }


def seconds_per_call(model, texts: list[str], batch_size: int, device: str, rounds: int, prompt=None) -> float:
    return timed(model, texts, batch_size, device, rounds, prompt)[0]


def timed(model, texts: list[str], batch_size: int, device: str, rounds: int, prompt=None):
    """(median seconds per encode() call, peak memory above the model's during the timed calls in GiB, the last
    call's embeddings), after a warm-up call on two batches (kernels, allocator)."""
    model.encode(texts[: batch_size * 2], batch_size=batch_size, prompt=prompt)
    call = {"encode": lambda: model.encode(texts, batch_size=batch_size, prompt=prompt, convert_to_numpy=True)}
    with measure.PeakMemory(device) as peak:
        rounds = measure.alternate(call, rounds, device)
    return rounds.median("encode"), peak.extra / 2**30, rounds.last["encode"].astype(np.float32)


def fixed_length_texts(articles: list[str], length: int, count: int) -> list[str]:
    """`count` different texts of at least 2 x `length` words (truncated to `length` tokens by max_seq_length)."""
    words = " ".join(articles).split()
    doubled = words + words  # a span may wrap around the end
    starts = [(i * 7919) % len(words) for i in range(count)]
    return [" ".join(doubled[start : start + 2 * length]) for start in starts]


def compare(plain, fast, texts: list[str], args, ceiling: float, prompt: str | None = None) -> dict:
    """Both systems on the same texts; plain at its best batch_size, fast at its own, and (but with --check)
    fast at that batch_size without each of its switches; each system's peak memory above its weights and the
    two systems' embeddings compared, all from the timed calls."""
    ids = fast[0].texts.encode(texts, prompt)
    tokens = sum(len(seq) for seq in ids)
    runs = {
        name: {bs: timed(model, texts, bs, args.device, args.rounds, prompt) for bs in sizes}
        for name, model, sizes in (("plain", plain, args.plain_batch_sizes), ("fast", fast, args.fast_batch_sizes))
    }
    best = {name: min(by_size, key=lambda bs: by_size[bs][0]) for name, by_size in runs.items()}
    rate = {name: tokens / runs[name][best[name]][0] for name in runs}
    switches = [] if args.check else ["compiled_seams"] + (["prompt_reuse"] if prompt else [])
    without = {
        switch: tokens / seconds_per_call(models.switched(fast, switch), texts, best["fast"], args.device,
                                          args.rounds, prompt)
        for switch in switches
    }  # fmt: skip
    cosine = 1 - one_minus_cosine(runs["fast"][best["fast"]][2], runs["plain"][best["plain"]][2])
    work = measure.flops(fast, ids)
    return {
        "min_cosine_fast_vs_plain": float(cosine.min()),
        "texts": len(texts),
        "tokens": tokens,
        "plain_tokens_per_s": rate["plain"],
        "plain_batch_size": best["plain"],
        "fast_tokens_per_s": rate["fast"],
        "fast_batch_size": best["fast"],
        "ratio": rate["fast"] / rate["plain"],
        "fast_without": {name: {"tokens_per_s": r, "fast_over_it": rate["fast"] / r} for name, r in without.items()},
        "fast_mfu": work / tokens * rate["fast"] / (ceiling * 1e9),
        "plain_mfu": work / tokens * rate["plain"] / (ceiling * 1e9),
        "plain_peak_gib": runs["plain"][best["plain"]][1],
        "fast_peak_gib": runs["fast"][best["fast"]][1],
        "all_runs": {name: {bs: tokens / run[0] for bs, run in by_size.items()} for name, by_size in runs.items()},
    }


def hybrid(args, tokenizer_dir: Path, documents: list[str]) -> dict:
    """SPLADE and ColBERT on bert-base widths (12 layers; --dry-run: 2), random weights with the carried
    tokenizer, bf16: plain and fast encode_document() on SciFact documents, tokens/s (median of alternating
    rounds) and fidelity to plain (SPLADE: max |diff| over the largest value, per row; ColBERT: per token)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = {**models.BERT_BASE_SHAPED, "num_hidden_layers": 2 if args.dry_run else 12}
    folders = {
        "SparseEncoder": models.splade_shaped(args.work / "splade", shape, tokenizer=tokenizer),
        "MultiVectorEncoder": models.colbert_shaped(args.work / "colbert", shape, tokenizer=tokenizer),
    }
    out = {}
    for kind, folder in folders.items():
        systems = models.plain_and_fast(str(folder), kind, torch.bfloat16, device=args.device)
        tokens = sum(map(len, systems["fast"].packed_input.texts.encode(documents)))
        calls = {name: lambda m=m: m.encode_document(documents, batch_size=32) for name, m in systems.items()}
        rounds = measure.alternate(calls, max(args.rounds, 3), args.device)
        plain, fast = rounds.last["plain"], rounds.last["fast"]
        if kind == "SparseEncoder":
            plain, fast = plain.to_dense().float(), fast.to_dense().float()
            error = ((plain - fast).abs().amax(1) / plain.abs().amax(1).clamp_min(1)).max().item()
        else:
            error = max((p.float() - f.float()).abs().max().item() for p, f in zip(plain, fast, strict=True))
        out[kind] = {"texts": len(documents), "tokens": tokens, "ratio": rounds.ratio("fast"), "max_error": error,
                     **{f"{n}_tokens_per_s": tokens / rounds.median(n) for n in ("plain", "fast")}}  # fmt: skip
        log(f"{kind}: {json.dumps(out[kind])}")
        del systems
        gc.collect()
    return out


# The published depth of each reranker shape (harness/rerank.py holds a few layers for the CPU).
RERANK_LAYERS = {"ms-marco-MiniLM-L6": 6, "bge-reranker-base": 12, "Qwen3-Reranker-0.6B": 28}


def rerank_workload(args, tokenizer_dir: Path) -> dict:
    """The three reranker shapes at their published depth (--dry-run: 2 layers), random weights with the carried
    tokenizer, bf16: plain and fast predict() on --rerank-queries SciFact claims x 50 documents (batch_size 32),
    pairs/s (median of alternating rounds), the ratio, max |diff| of the logits to plain's."""
    work, out = rerank.pairs(args.carry / "data", args.rerank_queries), {}
    for shape, layers in RERANK_LAYERS.items():
        config = {**rerank.SHAPES[shape], "num_hidden_layers": 2 if args.dry_run else layers}
        folder = rerank.build(args.work / f"rerank-{shape}", config, tokenizer_dir)
        row = rerank.compare(str(folder), work, torch.bfloat16, args.device, 32, max(args.rounds, 3))
        out[shape] = {key: value for key, value in row.items() if key not in ("plain", "fast")}
        out[shape].update({f"{name}_pairs_per_s": row[name]["pairs_per_s"] for name in ("plain", "fast")})
        log(rerank.line(shape, "bf16", row))
        gc.collect()
    return out


def table(results: dict) -> str:
    lines = [
        f"bf16 GEMM ceiling: {results['ceiling_gflops'] / 1000:,.1f} TFLOP/s; kernel: {results.get('kernel')}; "
        f"device: {results['device_name']}",
        "",
        "| workload | tokens | plain tok/s (bs) | fast tok/s (bs) | ratio | fast MFU | plain MFU | peak GiB plain / "
        "fast | min cos | fast over: eager seams / prompt every time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.get("workloads", {}).items():
        over = " / ".join(f"{w['fast_over_it']:.2f}x" for w in r["fast_without"].values()) or "-"
        lines.append(
            f"| {name} | {r['tokens']} | {r['plain_tokens_per_s']:,.0f} ({r['plain_batch_size']}) | "
            f"{r['fast_tokens_per_s']:,.0f} ({r['fast_batch_size']}) | {r['ratio']:.2f}x | "
            f"{r['fast_mfu']:.0%} | {r['plain_mfu']:.0%} | {r['plain_peak_gib']:.1f} / {r['fast_peak_gib']:.1f} | "
            f"{r['min_cosine_fast_vs_plain']:.5f} | {over} |"
        )
    if "latency" in results:
        latency = results["latency"]
        lines += ["", f"32 short queries, one encode() call: plain {latency['plain_ms']:.1f} ms, fast "
                  f"{latency['fast_ms']:.1f} ms ({latency['plain_ms'] / latency['fast_ms']:.2f}x)"]  # fmt: skip
    correctness = results.get("correctness", {})
    if "min_cosine_7b" in correctness:
        lines += ["", f"7B fast vs plain (bf16, 64 paragraphs): min cosine {correctness['min_cosine_7b']:.5f}"]
    if "small_copy" in correctness:
        small = correctness["small_copy"]
        lines.append(
            f"4-layer copy: fp32 max|diff| {small['fp32_max_abs_diff']:.1e}; bf16 1-cos vs fp32, max fast "
            f"{small['bf16_error_fast_max']:.1e} / plain {small['bf16_error_plain_max']:.1e}, mean fast "
            f"{small['bf16_error_fast_mean']:.1e} / plain {small['bf16_error_plain_mean']:.1e} -> "
            f"{'PASS' if small['passed'] else 'FAIL'} (rule: fast <= 3x plain)"
        )
    for kind, r in results.get("hybrid", {}).items():  # SPLADE and ColBERT, bf16 (hybrid())
        lines.append(f"{kind} encode_document, {r['texts']} SciFact documents ({r['tokens']} tokens): plain "
                     f"{r['plain_tokens_per_s']:,.0f} tok/s, fast {r['fast_tokens_per_s']:,.0f} tok/s, "
                     f"{r['ratio']:.2f}x; max error vs plain {r['max_error']:.1e}")  # fmt: skip
    for shape, r in results.get("rerank", {}).items():  # CrossEncoder.predict, bf16 (rerank_workload())
        lines.append(f"rerank {shape}, {r['pairs']} pairs ({r['tokens']} tokens): plain {r['plain_pairs_per_s']:,.0f} "
                     f"pairs/s, fast {r['fast_pairs_per_s']:,.0f} pairs/s, {r['speedup']:.2f}x; max|logit diff| vs "
                     f"plain {r['max_abs_diff_vs_plain']:.1e}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = options.parser(__doc__, "rounds", rounds=1)
    parser.add_argument("--carry", type=Path, required=True, help="data/ and tokenizer/ (gpu_check.sh --prepare)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_bench"), help="where the model folders go")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8192, 16384, 32768])
    parser.add_argument("--tokens-per-length", type=int, default=65536, help="--check: 32768")
    parser.add_argument("--paragraphs", type=int, default=1024)
    parser.add_argument("--claims", type=int, default=1000)
    parser.add_argument("--check", action="store_true", help="the short form (gpu_check.sh): one batch size each")
    parser.add_argument("--hybrid", action="store_true", help="also SPLADE and ColBERT (step 6)")
    parser.add_argument("--documents", type=int, default=1024, help="SciFact documents for SPLADE and ColBERT")
    parser.add_argument("--rerank", action="store_true", help="also the three reranker shapes (step 7)")
    parser.add_argument("--rerank-queries", type=int, default=100, help="SciFact claims, 50 documents each")
    parser.add_argument("--dry-run", action="store_true", help="CPU, 2 narrow layers, a few texts")
    args = parser.parse_args()
    overrides = DRY_RUN if args.dry_run else {}
    if args.dry_run:
        args.device, args.lengths, args.tokens_per_length, args.paragraphs = "cpu", [128, 8192], 8192, 96
        args.claims, args.documents, args.rerank_queries = 64, 16, 2
    else:
        args.device = "cuda"
    args.plain_batch_sizes, args.fast_batch_sizes = ((16,), (512,)) if args.check else ((8, 16, 32), (32, 512))
    if args.check and not args.dry_run:
        args.tokens_per_length = min(args.tokens_per_length, 32768)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    tokenizer_dir = args.carry / "tokenizer"
    carried = args.carry / "data"  # gpu_check.sh --prepare's copies of ../shared/data's files
    paragraphs = data.texts(carried / "wikitext2_test_paragraphs.jsonl")[: args.paragraphs]
    articles = data.texts(carried / "wikitext2_test_articles.jsonl")
    claims = data.texts(carried / "scifact_queries.jsonl")[: args.claims]

    results: dict = {"device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"}

    def save() -> None:  # after every row: a run cut short by its budget still reports what it measured
        (args.out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
        (args.out / "gpu_bench.md").write_text(table(results) + "\n")

    n = 8192 if args.device == "cuda" else 1024
    results["ceiling_gflops"] = measure.gemm_ceiling(torch.bfloat16, args.device, n=n, repeats=10)
    log(f"bf16 GEMM ceiling {results['ceiling_gflops']:.0f} GFLOP/s")
    save()

    log("correctness on a 4-layer copy (fp32 reference)")
    small = check_small_copy(args.work, tokenizer_dir, paragraphs[:64], args.device, overrides)
    results["correctness"] = {"small_copy": small}
    log(json.dumps(small))
    save()

    log("building the model")
    folder = build_folder(args.work / "model", tokenizer_dir, args.device, **overrides)
    log("loading plain and fast")
    plain = load(folder, "torch", args.device, torch.bfloat16)
    fast = load(folder, "fast", args.device, torch.bfloat16)
    results["kernel"] = fast[0].attention_kernel
    cosine = 1 - one_minus_cosine(encode(fast, paragraphs[:64], 32), encode(plain, paragraphs[:64], 32))
    results["correctness"]["min_cosine_7b"] = float(cosine.min())
    log(f"kernel {results['kernel']}; fast vs plain min cosine {cosine.min():.5f}")
    save()

    results["workloads"] = {}
    workloads = [
        (f"{n} tokens", n, fixed_length_texts(articles, n, max(1, args.tokens_per_length // n)), None)
        for n in args.lengths
    ]  # the headline first: throughput from short inputs to e5-mistral's whole window
    workloads += [("wikipedia paragraphs", None, paragraphs, None), ("instructed claims", None, claims, "instructed")]
    for name, length, texts, prompt in workloads:
        plain.max_seq_length = fast.max_seq_length = length or 512
        log(f"{name} ({len(texts)} texts)")
        results["workloads"][name] = compare(plain, fast, texts, args, results["ceiling_gflops"], PROMPTS.get(prompt))
        save()
    queries = claims[:32]
    results["latency"] = {
        f"{name}_ms": 1000 * seconds_per_call(model, queries, 32, args.device, max(args.rounds, 20))
        for name, model in (("plain", plain), ("fast", fast))
    }
    log(json.dumps(results["latency"]))
    save()
    del plain, fast
    gc.collect()
    if args.hybrid:
        log("hybrid search: SPLADE and ColBERT, bert-base widths")
        documents = [data.document(row) for row in data.jsonl(carried / "scifact_corpus.jsonl")][: args.documents]
        results["hybrid"] = hybrid(args, tokenizer_dir, documents)
        save()
    if args.rerank:
        log("rerank: three reranker shapes, CrossEncoder.predict")
        results["rerank"] = rerank_workload(args, tokenizer_dir)
        save()
    print(table(results), flush=True)


if __name__ == "__main__":
    main()
