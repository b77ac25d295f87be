"""LangChain: `HuggingFaceEmbeddings` with the fast backend as its client (extra `langchain`).

from st_fastbackend.integrations.langchain import FastBackendEmbeddings
embeddings = FastBackendEmbeddings(model_name="intfloat/e5-mistral-7b-instruct")
"""

from __future__ import annotations

import os
from typing import Any

from langchain_huggingface import HuggingFaceEmbeddings
from pydantic import BaseModel

from st_fastbackend.models import SentenceTransformer


class FastBackendEmbeddings(HuggingFaceEmbeddings):
    """The same fields as HuggingFaceEmbeddings (model_name, model_kwargs, encode_kwargs,
    query_encode_kwargs, multi_process, show_progress); the client is SentenceTransformer(backend="fast")."""

    def __init__(self, **kwargs: Any) -> None:
        if isinstance(kwargs.get("model_name"), os.PathLike):  # a local folder as a Path: its field is a str
            kwargs["model_name"] = os.fspath(kwargs["model_name"])
        # HuggingFaceEmbeddings.__init__ would load a plain model first: validate the fields only.
        BaseModel.__init__(self, **kwargs)
        model_kwargs = {"backend": "fast", **self.model_kwargs}
        self._client = SentenceTransformer(self.model_name, cache_folder=self.cache_folder, **model_kwargs)
