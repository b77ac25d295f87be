"""The command line (cli/main.py); `st-fastbackend` and `python -m st_fastbackend.cli` run main()."""

from st_fastbackend.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
