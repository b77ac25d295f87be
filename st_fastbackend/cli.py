"""`st-fastbackend` command line: `encode` texts (one per line) into a .npy file."""

from __future__ import annotations

import argparse
import signal
import sys
import time

import numpy as np
import torch

from st_fastbackend.serve.limits import Limits

MATMUL_PRECISIONS = ("highest", "high", "medium")
MATMUL_HELP = "torch.set_float32_matmul_precision; 'medium' lets an fp32 model multiply in bf16 on a CPU"


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
    encode.add_argument("--matmul-precision", default=None, choices=MATMUL_PRECISIONS, help=MATMUL_HELP)
    encode.add_argument("--batch-size", type=int, default=32)
    encode.add_argument("--prompt-name", default=None)
    encode.add_argument("--normalize", action="store_true")
    serve = commands.add_parser("serve", help="OpenAI-compatible /v1/embeddings server with dynamic batching")
    serve.add_argument("model", help="a sentence-transformers folder or Hub id")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="default: the model argument")
    serve.add_argument("--device", default=None)
    serve.add_argument("--dtype", default=None, help="e.g. float32, bfloat16, float16, auto")
    serve.add_argument("--matmul-precision", default=None, choices=MATMUL_PRECISIONS, help=MATMUL_HELP)
    serve.add_argument(
        "--max-tokens-per-batch", "--max-batch-tokens", type=int, default=None, help="tokens per packed batch"
    )
    serve.add_argument("--max-batch-size", type=int, default=256, help="inputs per request and per batch")
    serve.add_argument("--max-input-tokens", type=int, default=None, help="default: the model's max_seq_length")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on all but /health")
    serve.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    serve.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes, help="413 past this")
    serve.add_argument("--max-request-chars", type=int, default=Limits.max_request_chars,
                       help="characters of all inputs of one request together; 413 past this")  # fmt: skip
    serve.add_argument("--body-timeout", type=float, default=Limits.body_timeout,
                       help="seconds for a request body to arrive; 408 past this")  # fmt: skip
    serve.add_argument("--no-dynamic-batching", action="store_true", help="one request per forward pass")
    args = parser.parse_args(argv)
    if args.matmul_precision:
        torch.set_float32_matmul_precision(args.matmul_precision)
    {"encode": _encode, "serve": _serve}[args.command](args)


def _encode(args: argparse.Namespace) -> None:
    from st_fastbackend import SentenceTransformer

    if args.input == "-":
        texts = sys.stdin.read().splitlines()
    else:
        with open(args.input, encoding="utf8") as source:
            texts = source.read().splitlines()
    model = SentenceTransformer(args.model, backend=args.backend, device=args.device, model_kwargs=_dtype(args))
    start = time.perf_counter()
    embeddings = model.encode(
        texts, batch_size=args.batch_size, prompt_name=args.prompt_name, normalize_embeddings=args.normalize
    )
    seconds = time.perf_counter() - start
    np.save(args.output, embeddings.astype(np.float32))
    print(f"{len(texts)} texts -> {args.output} {embeddings.shape} in {seconds:.2f}s", file=sys.stderr)


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from st_fastbackend import SentenceTransformer
    from st_fastbackend.serve.app import create_app

    model = SentenceTransformer(args.model, backend="fast", device=args.device, model_kwargs=_dtype(args))
    max_input_tokens = args.max_input_tokens or model.max_seq_length
    if max_input_tokens > model.max_seq_length:
        raise SystemExit(
            f"--max-input-tokens {max_input_tokens} exceeds the model's max_seq_length {model.max_seq_length}."
        )
    app = create_app(
        model,
        served_model_name=args.served_model_name or args.model,
        max_tokens_per_batch=args.max_tokens_per_batch or model.max_tokens_per_batch,
        max_batch_size=args.max_batch_size,
        max_input_tokens=max_input_tokens,
        api_key=args.api_key,
        dynamic_batching=not args.no_dynamic_batching,
        limits=Limits(args.max_body_bytes, args.max_request_chars, args.body_timeout),
        public_metrics=args.public_metrics,
    )
    # uvicorn handles SIGTERM: stop accepting, let in-flight requests finish, run the app's shutdown. Then it
    # re-raises the signal under the handler that was there before; a no-op one makes the exit status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


def _dtype(args: argparse.Namespace) -> dict:
    if not args.dtype:
        return {}
    return {"dtype": args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)}


if __name__ == "__main__":
    main()
