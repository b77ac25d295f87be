"""Where a SPLADE encode's time goes, plain sentence-transformers and the fast backend on the same documents:
seconds in each stage of one encode_document() (after a warm-up call), from forward hooks on the modules.

    python eval/profile_stages.py --texts 32 --batch-size 16 --dtype fp32

Stages: plain's body (BertModel), its masked-LM head (transform and vocabulary projection, on the padded batch)
and SpladePooling (mask, relu, log1p, max); the fast backend's PackedMaskedLM (body and the head's transform)
and PackedSpladePooling (the vocabulary projection a slice of tokens at a time, and the max); "other" is the
rest of the wall time (tokenizing, sorting, the sparse output).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from harness import data, models, options

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def stages(system: str, model) -> dict:
    if system == "plain":
        masked_lm = model[0].auto_model
        return {"body": masked_lm.bert, "MLM head": masked_lm.cls, "SpladePooling": model[1]}
    return {"body + head transform": model[0], "vocab projection + pooling": model[1]}


def timed(model, modules: dict, texts: list[str], batch_size: int) -> dict[str, float]:
    """Seconds per stage, and the wall time, of one encode_document() of `texts` (after an untimed one)."""
    spent, started = defaultdict(float), {}

    def hooks(label: str):
        def before(*_) -> None:
            started[label] = time.perf_counter()

        def after(*_) -> None:
            spent[label] += time.perf_counter() - started[label]

        return before, after

    for label, module in modules.items():
        before, after = hooks(label)
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
    model.encode_document(texts[:batch_size], batch_size=batch_size)
    spent.clear()
    start = time.perf_counter()
    model.encode_document(texts, batch_size=batch_size)
    wall = time.perf_counter() - start
    return {**spent, "other": wall - sum(spent.values()), "wall": wall}


def main() -> None:
    parser = options.parser(__doc__, "data_dir", "batch_size")
    parser.add_argument("--texts", type=int, default=32, help="the first N SciFact documents")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    args = parser.parse_args()
    texts = [data.document(row) for row in data.scifact_corpus(args.data_dir)[: args.texts]]
    systems = models.plain_and_fast(models.model_path("splade"), "SparseEncoder", device="cpu",
                                    dtype=DTYPES[args.dtype])  # fmt: skip
    for system, model in systems.items():
        seconds = timed(model, stages(system, model), texts, args.batch_size)
        print(f"{system:<5} " + "  ".join(f"{label} {value:.2f} s" for label, value in seconds.items()), flush=True)


if __name__ == "__main__":
    main()
