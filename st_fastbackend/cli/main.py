"""`st-fastbackend` command line: `encode` texts (one per line) into .npy, .parquet or .jsonl, `serve` them
over HTTP, `embed-corpus` a whole corpus into parquet shards, `rerank` documents against a query with a
cross-encoder, or `check` a model against plain sentence-transformers. One module per subcommand
(cli/encode.py, cli/serve.py, cli/embed_corpus.py, cli/rerank.py, cli/check.py) and cli/options.py for what
they share.

torch, numpy and the model are imported inside the commands: `--help` and `--version` answer at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from st_fastbackend import __version__
from st_fastbackend.cli.check import add_check, check
from st_fastbackend.cli.embed_corpus import add_embed_corpus, embed_corpus
from st_fastbackend.cli.encode import add_encode, encode
from st_fastbackend.cli.files import CliError
from st_fastbackend.cli.options import (
    MATMUL_HELP,
    MATMUL_PRECISIONS,
    PROG,
    QUANTIZE_CHOICES,
    QUANTIZE_HELP,
    DefaultsHelp,
    dtype_name,
)
from st_fastbackend.cli.rerank import add_rerank, rerank
from st_fastbackend.cli.serve import add_serve, serve

DESCRIPTION = (
    "Embed texts into a file (encode), serve them over HTTP (serve), or embed a whole corpus into parquet "
    "shards (embed-corpus) with the fast backend."
)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        commands = {"encode": encode, "serve": serve, "embed-corpus": embed_corpus, "rerank": rerank, "check": check}
        commands[args.command](args)
    except CliError as error:
        if args.debug:
            raise
        print(f"{PROG}: error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{PROG}: {interrupted(args)}", file=sys.stderr)
        sys.exit(130)  # the shell's status for a process ended by SIGINT


def interrupted(args: argparse.Namespace) -> str:
    """What Ctrl-C left behind, in one line."""
    if args.command == "embed-corpus":  # complete shards are renamed into place; a resume skips their ids
        kept = len(list(Path(args.output_dir).glob("part-*.parquet")))
        return f"interrupted; {kept} complete shards kept in {args.output_dir}: run the same command to resume"
    output = getattr(args, "output", None)
    if output and output != "-":  # written once every text has run: complete only if the write ended
        return f"interrupted; {output} may be missing or incomplete: run the command again"
    return "interrupted"


def build_parser() -> argparse.ArgumentParser:
    defaults = DefaultsHelp
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=defaults)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", help="a sentence-transformers folder or Hub id")
    common.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1 (default: as sentence-transformers)")
    common.add_argument("--dtype", type=dtype_name, default=None, metavar="{float32,bfloat16,float16,auto}",
                        help="model dtype (also fp32, bf16, fp16, half); default: the model's own")  # fmt: skip
    common.add_argument("--matmul-precision", default=None, choices=MATMUL_PRECISIONS, help=MATMUL_HELP)
    common.add_argument("--quantize", default=None, choices=QUANTIZE_CHOICES, help=QUANTIZE_HELP)
    common.add_argument("--max-seq-length", type=int, default=None, help="truncate inputs to this many tokens")
    common.add_argument("--debug", action="store_true", help="show the traceback behind an error")
    commands = parser.add_subparsers(dest="command", required=True)
    add_encode(commands.add_parser("encode", parents=[common], formatter_class=defaults,
                                   help="embed texts, one per line, into a file"))  # fmt: skip
    add_serve(commands.add_parser("serve", parents=[common], formatter_class=defaults,
                                  help="serve the model over HTTP with dynamic batching: OpenAI, text-"
                                  "embeddings-inference and Cohere routes; rerank for a cross-encoder"))  # fmt: skip
    add_embed_corpus(commands, defaults)
    add_rerank(commands.add_parser("rerank", parents=[common], formatter_class=defaults,
                                   help="score documents, one per line, against a query (cross-encoder)"))  # fmt: skip
    add_check(commands.add_parser("check", parents=[common], formatter_class=defaults,
                                  help="compare the fast backend with plain sentence-transformers"))  # fmt: skip
    return parser


if __name__ == "__main__":
    main()
