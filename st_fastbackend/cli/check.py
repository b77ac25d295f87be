"""`st-fastbackend check`: the model with the fast backend against plain sentence-transformers, on probe texts
or the user's (models/check.py); the verdict first, then case by case. Exit status 1 where a case fails."""

from __future__ import annotations

import argparse
import sys

from st_fastbackend.cli.files import CliError, read_texts
from st_fastbackend.cli.options import EMBEDDING_KINDS, first_line, load_model
from st_fastbackend.cli.rerank import load_cross_encoder, serves_rerank


def add_check(check: argparse.ArgumentParser) -> None:
    check.add_argument("--texts", default=None,
                       help="UTF-8 file, one text a line (a cross-encoder: query<TAB>document), instead of the "
                            "probes: short, long past the window, the model's prompts, non-Latin scripts, emoji, "
                            "special characters, whitespace")  # fmt: skip
    check.add_argument("--task", default="auto", choices=["auto", "embed", "rerank"],
                       help="rerank: a cross-encoder (predict() scores compared); auto: as sentence-transformers "
                            "tells a cross-encoder folder")  # fmt: skip


def check(args: argparse.Namespace) -> None:
    texts = None
    if args.texts is not None:
        texts = [text for text in read_texts(args.texts) if text]
        if not texts:
            raise CliError(f"--texts {args.texts} has no texts")
    model = load_cross_encoder(args) if serves_rerank(args) else load_model(args, kinds=EMBEDDING_KINDS)
    try:
        report = model.check(texts)
    except Exception as error:  # a line without a tab for a cross-encoder, plain failing to load: one line
        raise CliError(f"cannot check {args.model}: {first_line(error)}") from error
    print(report)
    if not report.passed:
        print(f"check failed: {', '.join(report.failed)}", file=sys.stderr)
        sys.exit(1)
