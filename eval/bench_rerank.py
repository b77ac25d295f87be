"""The rerank workload: plain sentence_transformers.CrossEncoder.predict and the fast backend's side by side.

SciFact claims as queries, each with 50 SciFact documents (title + abstract; the query's judged documents
first, then others drawn with a seed per query): 100 x 50 = 5,000 pairs by default. Three random-weight
shapes with all-MiniLM-L6-v2's tokenizer (realistic English token counts): ms-marco-MiniLM-L6 (BERT),
bge-reranker-base (XLM-R, 4 of its 12 layers) and Qwen3-Reranker-0.6B (a causal LM read with LogitScore, 4 of its
28 layers). Alternating rounds in one process; prints pairs/s (median of rounds), the ratio and max |diff|.

    python eval/bench_rerank.py --queries 100 --rounds 3 --dtypes fp32 bf16
"""

from __future__ import annotations

import json
import random

import numpy as np
import torch
from harness import data, measure, models, options

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


def pairs(data_dir, queries: int, per_query: int = 50) -> list[tuple[str, str]]:
    """(claim, document) for the first `queries` test claims: its judged documents, then others drawn at random."""
    qrels, claims, corpus = data.beir(data_dir / "scifact")
    claims = {claim["_id"]: claim["text"] for claim in claims}
    documents = {row["_id"]: data.document(row) for row in corpus}
    out = []
    for query in list(qrels)[:queries]:
        drawn = list(qrels[query]) + random.Random(query).sample(list(documents), per_query)
        out += [(claims[query], documents[d]) for d in dict.fromkeys(drawn)][:per_query]
    return out


def build(folder, shape: dict):
    """Random weights in the shape, MiniLM's WordPiece tokenizer (pairs as [CLS] q [SEP] d [SEP])."""
    import transformers

    if (folder / "config.json").is_file():
        return folder
    tokenizer = transformers.AutoTokenizer.from_pretrained(options.minilm_path())
    if shape["model_type"] != "bert":  # neither XLM-R nor Qwen3 take token types
        tokenizer.model_input_names = ["input_ids", "attention_mask"]
    auto = "AutoModelForCausalLM" if shape["model_type"] == "qwen3" else "AutoModelForSequenceClassification"
    models.random_weights(folder, shape, auto, tokenizer, num_labels=1)
    tokenizer_config = folder / "tokenizer_config.json"  # model_input_names as set above, read back on load
    saved = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**saved, "model_input_names": tokenizer.model_input_names}))
    return folder


def main() -> None:
    parser = options.parser(__doc__, "data_dir", "batch_size", "rounds", "device")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    args = parser.parse_args()
    work = pairs(args.data_dir, args.queries)
    print(f"{len(work)} pairs ({args.queries} SciFact claims x 50 documents), batch_size {args.batch_size}, "
          f"{args.device}, {torch.get_num_threads()} threads")  # fmt: skip
    predict = dict(batch_size=args.batch_size, activation_fn=torch.nn.Identity())  # logits: the numbers compared
    for shape in args.shapes:
        folder = str(build(models.CACHE / f"rerank-{shape}", SHAPES[shape]))
        for dtype_name in args.dtypes:
            systems = models.plain_and_fast(folder, "CrossEncoder", DTYPES[dtype_name], device=args.device)
            calls = {name: lambda m=model: m.predict(work, **predict) for name, model in systems.items()}
            rounds = measure.alternate(calls, args.rounds, args.device)
            plain, fast = (len(work) / rounds.median(name) for name in ("plain", "fast"))
            diff = float(np.abs(rounds.last["plain"] - rounds.last["fast"]).max())
            print(f"{shape:22s} {dtype_name}: plain {plain:7.1f} pairs/s, fast {fast:7.1f} pairs/s, "
                  f"{rounds.ratio('fast'):.2f}x, max|diff| {diff:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
