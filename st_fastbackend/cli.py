"""`st-fastbackend` command line: `encode` texts (one per line) into a .npy file."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="st-fastbackend", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    encode = commands.add_parser("encode", help="embed texts, one per line, into a .npy file")
    encode.add_argument("model", help="a sentence-transformers folder or Hub id")
    encode.add_argument("--input", default="-", help="text file, one text per line (default: stdin)")
    encode.add_argument("--output", required=True, help="where to write the [N, dim] float32 .npy array")
    encode.add_argument("--backend", default="fast", choices=["fast", "torch", "onnx", "openvino"])
    encode.add_argument("--device", default=None)
    encode.add_argument("--dtype", default=None, help="e.g. float32, bfloat16, float16, auto")
    encode.add_argument("--batch-size", type=int, default=32)
    encode.add_argument("--prompt-name", default=None)
    encode.add_argument("--normalize", action="store_true")
    args = parser.parse_args(argv)
    _encode(args)


def _encode(args: argparse.Namespace) -> None:
    from st_fastbackend import SentenceTransformer

    if args.input == "-":
        texts = sys.stdin.read().splitlines()
    else:
        with open(args.input, encoding="utf8") as source:
            texts = source.read().splitlines()
    model_kwargs = {"dtype": args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)} if args.dtype else {}
    model = SentenceTransformer(args.model, backend=args.backend, device=args.device, model_kwargs=model_kwargs)
    start = time.perf_counter()
    embeddings = model.encode(
        texts, batch_size=args.batch_size, prompt_name=args.prompt_name, normalize_embeddings=args.normalize
    )
    seconds = time.perf_counter() - start
    np.save(args.output, embeddings.astype(np.float32))
    print(f"{len(texts)} texts -> {args.output} {embeddings.shape} in {seconds:.2f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
