"""sentence-transformers modules that run the packed engine."""

from st_fastbackend.modules.inputs import check_texts
from st_fastbackend.modules.pooling import PackedPooling
from st_fastbackend.modules.transformer import PackedTransformer

__all__ = ["PackedPooling", "PackedTransformer", "check_texts"]
