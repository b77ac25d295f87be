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
    from st_fastbackend.models.hybrid import HybridEncoder
    from st_fastbackend.models.multi_vector_encoder import MultiVectorEncoder
    from st_fastbackend.models.sparse_encoder import SparseEncoder

__all__ = [
    "Chunking",
    "CrossEncoder",
    "HybridEncoder",
    "MultiVectorEncoder",
    "SentenceTransformer",
    "SparseEncoder",
    "UnsupportedModelError",
]
__version__ = "0.1.0"


# Imported on first use: torch, transformers and sentence-transformers take seconds to import, and
# `st-fastbackend --help` or `--version` need none of them.
_HOMES = {
    "SentenceTransformer": "st_fastbackend.models.sentence_transformer",
    "CrossEncoder": "st_fastbackend.models.cross_encoder",
    "SparseEncoder": "st_fastbackend.models.sparse_encoder",
    "MultiVectorEncoder": "st_fastbackend.models.multi_vector_encoder",
    "HybridEncoder": "st_fastbackend.models.hybrid",
    "Chunking": "st_fastbackend.models.chunking",
    "UnsupportedModelError": "st_fastbackend.engine.spec",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
