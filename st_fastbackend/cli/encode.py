"""`st-fastbackend encode`: texts, one per line, into .npy, .parquet or .jsonl."""

from __future__ import annotations

import argparse
import sys
import time

from st_fastbackend.cli.files import OUTPUT_FORMATS, CliError, check_output, read_texts, write_embeddings
from st_fastbackend.cli.options import add_prompt_options, describe, first_line, load_model, positive

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def add_encode(encode: argparse.ArgumentParser) -> None:
    encode.add_argument("--input", default="-", help="UTF-8 text file, one text per line; - for stdin")
    encode.add_argument("--output", required=True, help=f"where to write [N, dim]: {', '.join(OUTPUT_FORMATS)}")
    encode.add_argument("--backend", default="fast", choices=["fast", "torch", "onnx", "openvino"],
                        help="fast: the packed backend; the others: plain sentence-transformers")  # fmt: skip
    add_prompt_options(encode, "query: ", "query")
    encode.add_argument(
        "--batch-size", type=int, default=32, help="texts per batch at most (a GPU; a CPU: the token budget)"
    )
    encode.add_argument("--max-tokens-per-batch", type=positive, default=None,
                        help="tokens per packed batch (--backend fast); default: the model's, by device")  # fmt: skip
    encode.add_argument("--truncate-dim", type=positive, default=None, help="keep the first N dimensions")
    encode.add_argument("--precision", default="float32", choices=PRECISIONS, help="quantize the embeddings")
    encode.add_argument("--normalize", action="store_true", help="unit-length embeddings")


def encode(args: argparse.Namespace) -> None:
    check_output(args.output)
    texts = read_texts(args.input)
    if args.max_tokens_per_batch and args.backend != "fast":
        raise CliError("--max-tokens-per-batch needs --backend fast")
    model = load_model(args, args.backend)
    options = dict(prompt=args.prompt, prompt_name=args.prompt_name, batch_size=args.batch_size,
                   normalize_embeddings=args.normalize, truncate_dim=args.truncate_dim,
                   precision=args.precision)  # fmt: skip
    if args.max_tokens_per_batch:
        options["max_tokens_per_batch"] = args.max_tokens_per_batch
    start = time.perf_counter()
    try:
        embeddings = model.encode(texts, show_progress_bar=sys.stderr.isatty(), **options) if texts else None
    except ValueError as error:  # a bad prompt name, an input without tokens, ...
        raise CliError(first_line(error)) from error
    seconds = time.perf_counter() - start
    embeddings = embeddings if texts else no_embeddings(model, args.truncate_dim, args.precision)
    write_embeddings(args.output, embeddings)
    prompt = args.prompt or model.prompts.get(args.prompt_name or model.default_prompt_name)
    tokens = count_tokens(model, texts, prompt)
    print(f"{len(texts)} texts, {tokens} tokens in {seconds:.2f}s ({tokens / max(seconds, 1e-9):.0f} tokens/s); "
          f"{describe(model)} -> {args.output} {embeddings.shape}", file=sys.stderr)  # fmt: skip


def no_embeddings(model, truncate_dim: int | None, precision: str):
    """[0, dim] in the dtype and width encode() gives for these options (binary packs 8 dimensions a byte)."""
    import numpy as np

    dim = min(truncate_dim or model.get_embedding_dimension(), model.get_embedding_dimension())
    dim = -(-dim // 8) if precision in ("binary", "ubinary") else dim
    dtype = {"float32": np.float32, "int8": np.int8, "binary": np.int8}.get(precision, np.uint8)
    return np.zeros((0, dim), dtype)


def count_tokens(model, texts: list[str], prompt: str | None, chunk: int = 1024) -> int:
    """Tokens the model saw, prompt included, after truncation: sentence-transformers' preprocess() a chunk
    at a time (one more tokenizer pass, no forward)."""
    total = 0
    for start in range(0, len(texts), chunk):
        features = model.preprocess(texts[start : start + chunk], prompt=prompt)
        total += len(features["packed"].input_ids) if "packed" in features else int(features["attention_mask"].sum())
    return total
