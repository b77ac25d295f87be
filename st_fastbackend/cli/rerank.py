"""`st-fastbackend rerank`: score documents (one per line) against a query with a cross-encoder, best first."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from st_fastbackend.cli.files import CliError, read_texts
from st_fastbackend.cli.options import add_prompt_options, check_model, describe, first_line, model_kwargs, positive


def add_rerank(rerank: argparse.ArgumentParser) -> None:
    rerank.add_argument("--query", required=True, help="the query every document is scored against")
    rerank.add_argument("--input", default="-", help="UTF-8 text file, one document per line; - for stdin")
    rerank.add_argument("--output", default=None,
                        help="a .jsonl file, {index, score, text} a line, best first; default: stdout")  # fmt: skip
    rerank.add_argument("--backend", default="fast", choices=["fast", "torch", "onnx", "openvino"],
                        help="fast: the packed backend; the others: plain sentence-transformers")  # fmt: skip
    rerank.add_argument("--top-k", type=positive, default=None, help="keep the best K documents")
    rerank.add_argument("--raw-scores", action="store_true", help="logits, without the model's activation")
    add_prompt_options(rerank, "Instruct: find the passage that answers the question. Query: ", "query")
    rerank.add_argument(
        "--batch-size", type=int, default=32, help="pairs per batch at most (a GPU; a CPU: the token budget)"
    )
    rerank.add_argument("--max-tokens-per-batch", type=positive, default=None,
                        help="tokens per packed batch (--backend fast); default: the model's, by device")  # fmt: skip


def rerank(args: argparse.Namespace) -> None:
    if args.output is not None and Path(args.output).suffix != ".jsonl":
        raise CliError(f"--output {args.output}: rerank writes .jsonl")
    if args.output is not None and not Path(args.output).parent.is_dir():
        raise CliError(f"--output {args.output}: directory {Path(args.output).parent} does not exist")
    if args.max_tokens_per_batch and args.backend != "fast":
        raise CliError("--max-tokens-per-batch needs --backend fast")
    documents = read_texts(args.input)
    model = load_cross_encoder(args)
    options = dict(
        batch_size=args.batch_size,
        prompt=args.prompt,
        prompt_name=args.prompt_name,
        top_k=args.top_k,
        return_documents=True,
    )
    if args.raw_scores:
        import torch

        options["activation_fn"] = torch.nn.Identity()
    if args.max_tokens_per_batch:  # rank() takes no more arguments than the parent's: the model's budget
        model.max_tokens_per_batch = args.max_tokens_per_batch
    start = time.perf_counter()
    try:
        progress = sys.stderr.isatty()
        ranked = model.rank(args.query, documents, show_progress_bar=progress, **options) if documents else []
    except ValueError as error:  # num_labels != 1, an input without tokens, ...
        raise CliError(first_line(error)) from error
    seconds = time.perf_counter() - start
    rows = [{"index": r["corpus_id"], "score": r["score"], "text": r["text"]} for r in ranked]
    if args.output is None:
        for row in rows:
            print(f"{row['score']:.6f}\t{row['index']}\t{row['text']}")
    else:
        with open(args.output, "w", encoding="utf8") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"{len(documents)} documents in {seconds:.2f}s; {describe(model)}", file=sys.stderr)


def load_cross_encoder(args: argparse.Namespace):
    """The cross-encoder, or a one-line CliError (as cli/options.py load_model for embedders)."""
    check_model(args.model)
    import torch

    from st_fastbackend import CrossEncoder

    if args.matmul_precision:
        torch.set_float32_matmul_precision(args.matmul_precision)
    try:
        backend = getattr(args, "backend", "fast")  # serve has no --backend
        return CrossEncoder(args.model, backend=backend, device=args.device, model_kwargs=model_kwargs(args),
                            max_length=args.max_seq_length)  # fmt: skip
    except Exception as error:  # whatever went wrong, one line; --debug shows where
        raise CliError(f"cannot load model {args.model}: {first_line(error)}") from error


def serves_rerank(args: argparse.Namespace) -> bool:
    """`serve --task rerank`, or with --task auto a cross-encoder folder: one whose
    config_sentence_transformers.json says CrossEncoder, as sentence-transformers tells its model types, or a
    bare Hugging Face checkpoint (no modules.json) of a *ForSequenceClassification architecture."""
    if args.task != "auto":
        return args.task == "rerank"
    folder = Path(args.model).expanduser()
    if (st_config := folder / "config_sentence_transformers.json").is_file():
        return _json_object(st_config).get("model_type") == "CrossEncoder"
    if (folder / "modules.json").is_file() or not (folder / "config.json").is_file():
        return False
    architectures = _json_object(folder / "config.json").get("architectures") or []
    return any(str(name).endswith("ForSequenceClassification") for name in architectures)


def _json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf8"))
    except (OSError, ValueError):
        return {}  # the model load names the file
    return value if isinstance(value, dict) else {}
