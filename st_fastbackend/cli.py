"""`st-fastbackend` command line: `encode` texts (one per line) into .npy, .parquet or .jsonl, or `serve` them
over HTTP.

torch, numpy and the model are imported inside the commands: `--help` and `--version` answer at once.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from st_fastbackend import __version__
from st_fastbackend.cli_io import OUTPUT_FORMATS, CliError, check_output, read_texts, write_embeddings
from st_fastbackend.serve.limits import Limits

PROG = "st-fastbackend"
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16", "auto": "auto"}  # fmt: skip
PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
DESCRIPTION = ("Embed texts into a file (encode), serve them over HTTP (serve), or embed a whole corpus into parquet "
               "shards (embed-corpus) with the fast backend.")
MATMUL_PRECISIONS = ("highest", "high", "medium")
MATMUL_HELP = "torch.set_float32_matmul_precision; 'medium' lets an fp32 model multiply in bf16 on a CPU"


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        {"encode": _encode, "serve": _serve, "embed-corpus": _embed_corpus}[args.command](args)
    except CliError as error:
        if args.debug:
            raise
        print(f"{PROG}: error: {error}", file=sys.stderr)
        sys.exit(2)


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, but not None or False (an option that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    defaults = DefaultsHelp
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=defaults)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", help="a sentence-transformers folder or Hub id")
    common.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1 (default: as sentence-transformers)")
    common.add_argument("--dtype", type=_dtype_name, default=None, metavar="{float32,bfloat16,float16,auto}",
                        help="model dtype (also fp32, bf16, fp16, half); default: the model's own")  # fmt: skip
    common.add_argument("--matmul-precision", default=None, choices=MATMUL_PRECISIONS, help=MATMUL_HELP)
    common.add_argument("--max-seq-length", type=int, default=None, help="truncate inputs to this many tokens")
    common.add_argument("--debug", action="store_true", help="show the traceback behind an error")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_encode(commands.add_parser("encode", parents=[common], formatter_class=defaults,
                                    help="embed texts, one per line, into a file"))  # fmt: skip
    _add_serve(commands.add_parser("serve", parents=[common], formatter_class=defaults,
                                   help="OpenAI-compatible /v1/embeddings server with dynamic batching"))  # fmt: skip
    from st_fastbackend.cli_corpus import add_embed_corpus  # here: cli_corpus imports this module's helpers

    add_embed_corpus(commands, defaults)
    return parser


def _add_encode(encode: argparse.ArgumentParser) -> None:
    encode.add_argument("--input", default="-", help="UTF-8 text file, one text per line; - for stdin")
    encode.add_argument("--output", required=True, help=f"where to write [N, dim]: {', '.join(OUTPUT_FORMATS)}")
    encode.add_argument("--backend", default="fast", choices=["fast", "torch", "onnx", "openvino"],
                        help="fast: the packed backend; the others: plain sentence-transformers")  # fmt: skip
    add_prompt_options(encode, "query: ", "query")
    encode.add_argument("--batch-size", type=int, default=32, help="texts per batch at most")
    encode.add_argument("--max-tokens-per-batch", type=_positive, default=None,
                        help="tokens per packed batch (--backend fast); default: the model's, by device")  # fmt: skip
    encode.add_argument("--truncate-dim", type=_positive, default=None, help="keep the first N dimensions")
    encode.add_argument("--precision", default="float32", choices=PRECISIONS, help="quantize the embeddings")
    encode.add_argument("--normalize", action="store_true", help="unit-length embeddings")


def _add_serve(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send; default: the model folder's name, or the Hub id")  # fmt: skip
    serve.add_argument("--max-tokens-per-batch", "--max-batch-tokens", type=_positive, default=None,
                       help="tokens per packed batch; default: the model's, by device")  # fmt: skip
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
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="for the server's and the library's log lines")  # fmt: skip
    serve.add_argument("--no-access-log", action="store_true", help="no line per request")


def add_prompt_options(command: argparse.ArgumentParser, prompt: str, name: str) -> None:
    """--prompt or --prompt-name (one at most), with an example of each in their help."""
    prompts = command.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default=None, help=f"text put before every input, e.g. '{prompt}'")
    prompts.add_argument("--prompt-name", default=None, help=f"a prompt from the model's config, e.g. {name}")


def _dtype_name(value: str) -> str:
    if value.lower() not in DTYPES:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[value.lower()]


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def load_model(args: argparse.Namespace, backend: str = "fast"):
    """The model, or a one-line CliError: missing folder, a folder that is not a model, any load failure."""
    check_model(args.model)
    import torch

    from st_fastbackend import SentenceTransformer

    if args.matmul_precision:
        torch.set_float32_matmul_precision(args.matmul_precision)
    model_kwargs = {"dtype": args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)} if args.dtype else {}
    try:
        model = SentenceTransformer(args.model, backend=backend, device=args.device, model_kwargs=model_kwargs)
    except Exception as error:  # whatever went wrong, one line; --debug shows where
        raise CliError(f"cannot load model {args.model}: {_first_line(error)}") from error
    if args.max_seq_length:
        model.max_seq_length = args.max_seq_length
    return model


def check_model(name: str) -> None:
    path = Path(name).expanduser()
    if path.is_dir():
        if not any((path / marker).is_file() for marker in ("modules.json", "config.json")):
            raise CliError(f"{name} is not a model folder: it has neither modules.json nor config.json")
    elif path.exists():
        raise CliError(f"{name} is a file, not a model folder")
    elif name.startswith((".", "/", "~")) or name.count("/") > 1:  # a Hub id is "name" or "org/name"
        raise CliError(f"model folder {name} does not exist")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def describe(model) -> str:
    """What actually runs: the weights' dtype and, on the fast backend, the attention kernel and product dtype."""
    weight = next(model.parameters(), None)  # ONNX and OpenVINO models have none
    weights = str(getattr(weight, "dtype", "?")).removeprefix("torch.")
    if getattr(model, "backend", None) != "fast":
        return f"weights {weights}, backend {getattr(model, 'backend', 'torch')}"
    products = str(model[0].product_dtype).removeprefix("torch.")
    return f"weights {weights}, products {products}, attention {model[0].attention_kernel}"


def _encode(args: argparse.Namespace) -> None:
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
        raise CliError(_first_line(error)) from error
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


def _embed_corpus(args: argparse.Namespace) -> None:
    from st_fastbackend.cli_corpus import embed_corpus

    embed_corpus(args)


def _serve(args: argparse.Namespace) -> None:
    from st_fastbackend.cli_serve import serve  # uvicorn and the app, for this command only

    serve(args)


if __name__ == "__main__":
    main()
