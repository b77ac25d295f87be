"""The model classes, one thin subclass per sentence-transformers class on the shared fast path (fast.py)."""

from st_fastbackend.models.sentence_transformer import SentenceTransformer

__all__ = ["SentenceTransformer"]
