"""The rerank workload (issue 29): SciFact claims as queries, each with 50 SciFact documents, scored by plain
sentence_transformers.CrossEncoder.predict and the fast backend's side by side, on random weights in published
reranker shapes with all-MiniLM-L6-v2's tokenizer (realistic English token counts). eval/bench.py (CPU) and
eval/gpu_bench.py (GPU) run it; eval/bench_rerank_server.py serves the same folders."""

from __future__ import annotations

import json
import random
from pathlib import Path

from harness import data, measure, models, options

# Published widths: ms-marco-MiniLM-L6 (BERT), bge-reranker-base (XLM-R, 4 of its 12 layers) and
# Qwen3-Reranker-0.6B (a causal LM read with LogitScore, 4 of its 28 layers).
SHAPES = {
    "ms-marco-MiniLM-L6": dict(model_type="bert", hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                               intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2),
    "bge-reranker-base": dict(model_type="xlm-roberta", hidden_size=768, num_hidden_layers=4, num_attention_heads=12,
                              intermediate_size=3072, max_position_embeddings=514, type_vocab_size=1),
    "Qwen3-Reranker-0.6B": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                max_position_embeddings=40960, tie_word_embeddings=True),
}  # fmt: skip


def pairs(data_dir: Path, queries: int, per_query: int = 50) -> list[tuple[str, str]]:
    """(claim, document) for the first `queries` test claims: its judged documents, then others drawn with a
    seed per claim (title + abstract)."""
    qrels, claims, corpus = data.beir(data_dir / "scifact")
    claims = {claim["_id"]: claim["text"] for claim in claims}
    documents = {row["_id"]: data.document(row) for row in corpus}
    out = []
    for query in list(qrels)[:queries]:
        drawn = list(qrels[query]) + random.Random(query).sample(list(documents), per_query)
        out += [(claims[query], documents[d]) for d in dict.fromkeys(drawn)][:per_query]
    return out


def build(folder: Path, shape: dict, tokenizer_path: str | Path | None = None) -> Path:
    """Random weights in `shape` with the tokenizer at `tokenizer_path` (default: MiniLM's WordPiece; pairs as
    [CLS] q [SEP] d [SEP]), one label. Built once."""
    import transformers

    if (folder / "config.json").is_file():
        return folder
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path or options.minilm_path())
    if shape["model_type"] != "bert":  # neither XLM-R nor Qwen3 take token types
        tokenizer.model_input_names = ["input_ids", "attention_mask"]
    auto = "AutoModelForCausalLM" if shape["model_type"] == "qwen3" else "AutoModelForSequenceClassification"
    models.random_weights(folder, shape, auto, tokenizer, num_labels=1)
    tokenizer_config = folder / "tokenizer_config.json"  # model_input_names as set above, read back on load
    saved = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**saved, "model_input_names": tokenizer.model_input_names}))
    return folder


def pair_tokens(model, work: list[tuple[str, str]]) -> int:
    """The tokens of `work` as CrossEncoder.predict tokenizes the pairs (longest_first at max_length)."""
    first, second = zip(*work, strict=True)
    encoded = model.tokenizer(list(first), list(second), truncation="longest_first", max_length=model.max_length)
    return sum(map(len, encoded["input_ids"]))


def compare(folder: str, work: list[tuple[str, str]], dtype, device: str, batch_size: int, rounds: int) -> dict:
    """Plain and fast predict() on `work` in alternating rounds (after an untimed call on one batch): pairs/s and
    tokens/s (median of rounds), fast over plain, and max |diff| of the logits (no activation)."""
    import numpy as np
    import torch

    systems = models.plain_and_fast(folder, "CrossEncoder", dtype, device=device)
    predict = dict(batch_size=batch_size, activation_fn=torch.nn.Identity())  # logits: the numbers compared
    calls = {name: (lambda m=model: m.predict(work, **predict)) for name, model in systems.items()}
    for model in systems.values():
        model.predict(work[:batch_size], **predict)
    result = measure.alternate(calls, rounds, device)
    tokens = pair_tokens(systems["plain"], work)
    out = {"pairs": len(work), "tokens": tokens, "speedup": result.ratio("fast"),
           "max_abs_diff_vs_plain": float(np.abs(result.last["plain"] - result.last["fast"]).max())}  # fmt: skip
    for name in systems:
        seconds = result.median(name)
        out[name] = {"pairs_per_s": len(work) / seconds, "tokens_per_s": tokens / seconds,
                     "seconds": result.seconds[name], "ratio_vs_plain": result.ratio(name)}  # fmt: skip
    return out


def line(shape: str, dtype_name: str, row: dict) -> str:
    plain, fast = row["plain"], row["fast"]
    return (f"{shape:20s} {dtype_name:5s} rerank {row['pairs']} pairs {row['tokens']} tok  plain "
            f"{plain['pairs_per_s']:7.1f} pairs/s  fast {fast['pairs_per_s']:7.1f} pairs/s  {row['speedup']:.2f}x  "
            f"max|diff| {row['max_abs_diff_vs_plain']:.1e}")  # fmt: skip
