"""st_fastbackend: a drop-in, packed (padding-free) inference backend for sentence-transformers.

from st_fastbackend import SentenceTransformer
model = SentenceTransformer("intfloat/e5-mistral-7b-instruct", backend="fast")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from st_fastbackend.engine.spec import UnsupportedModelError
    from st_fastbackend.models import SentenceTransformer
    from st_fastbackend.models.chunking import Chunking
    from st_fastbackend.models.cross_encoder import CrossEncoder

__all__ = ["Chunking", "CrossEncoder", "SentenceTransformer", "UnsupportedModelError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: torch, transformers and sentence-transformers take seconds to import, and
    # `st-fastbackend --help` or `--version` need none of them.
    if name == "SentenceTransformer":
        from st_fastbackend.models import SentenceTransformer

        return SentenceTransformer
    if name == "CrossEncoder":
        from st_fastbackend.models.cross_encoder import CrossEncoder

        return CrossEncoder
    if name == "Chunking":
        from st_fastbackend.models.chunking import Chunking

        return Chunking
    if name == "UnsupportedModelError":
        from st_fastbackend.engine.spec import UnsupportedModelError

        return UnsupportedModelError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
