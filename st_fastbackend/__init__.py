"""st_fastbackend: a drop-in, packed (padding-free) inference backend for sentence-transformers.

from st_fastbackend import SentenceTransformer
model = SentenceTransformer("intfloat/e5-mistral-7b-instruct", backend="fast")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from st_fastbackend.engine.spec import UnsupportedModelError
    from st_fastbackend.models import SentenceTransformer

__all__ = ["SentenceTransformer", "UnsupportedModelError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: torch, transformers and sentence-transformers take seconds to import, and
    # `st-fastbackend --help` or `--version` need none of them.
    if name == "SentenceTransformer":
        from st_fastbackend.models import SentenceTransformer

        return SentenceTransformer
    if name == "UnsupportedModelError":
        from st_fastbackend.engine.spec import UnsupportedModelError

        return UnsupportedModelError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
