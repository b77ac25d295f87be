"""sentence-transformers modules that run the packed engine."""

from st_fastbackend.modules.pooling import PackedPooling
from st_fastbackend.modules.transformer import PackedTransformer, check_texts

__all__ = ["PackedPooling", "PackedTransformer", "check_texts"]
