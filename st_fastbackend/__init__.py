"""st_fastbackend: a drop-in, packed (padding-free) inference backend for sentence-transformers.

from st_fastbackend import SentenceTransformer
model = SentenceTransformer("intfloat/e5-mistral-7b-instruct", backend="fast")
"""

from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.model import SentenceTransformer

__all__ = ["SentenceTransformer", "UnsupportedModelError"]
__version__ = "0.1.0"
