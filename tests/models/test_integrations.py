"""LangChain and LlamaIndex adapters give their own classes' vectors, with the fast backend inside."""

import subprocess
import sys

import numpy as np
import pytest
from helpers import TOLERANCE, minilm_path

from st_fastbackend.modules import PackedTransformer

DOCUMENTS = ["The cat sits on the mat.", "Stock markets fell sharply today.", "A recipe for bread.\nBake it."]
QUERY = "Where is the cat?"


def test_importing_the_package_imports_neither_library():
    code = "import st_fastbackend, sys; assert not {'langchain_huggingface', 'llama_index'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.real_model
def test_langchain_adapter():
    pytest.importorskip("langchain_huggingface")
    from langchain_huggingface import HuggingFaceEmbeddings

    from st_fastbackend.integrations.langchain import FastBackendEmbeddings

    options = dict(
        model_name=minilm_path(),
        model_kwargs={"device": "cpu", "prompts": {"q": "query: "}},
        encode_kwargs={"normalize_embeddings": True, "batch_size": 2},
        query_encode_kwargs={"prompt_name": "q"},
    )
    ours, theirs = FastBackendEmbeddings(**options), HuggingFaceEmbeddings(**options)
    assert isinstance(ours._client[0], PackedTransformer) and ours._client.get_backend() == "fast"
    assert np.abs(np.array(ours.embed_documents(DOCUMENTS)) - theirs.embed_documents(DOCUMENTS)).max() <= TOLERANCE
    assert np.abs(np.array(ours.embed_query(QUERY)) - theirs.embed_query(QUERY)).max() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.real_model
def test_llama_index_adapter():
    pytest.importorskip("llama_index.embeddings.huggingface")
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from st_fastbackend.integrations.llama_index import FastBackendEmbedding

    options = dict(model_name=minilm_path(), device="cpu", query_instruction="query: ", embed_batch_size=2)
    ours, theirs = FastBackendEmbedding(**options), HuggingFaceEmbedding(**options)
    assert isinstance(ours._model[0], PackedTransformer)
    assert ours._model.prompts["text"] == theirs._model.prompts["text"]
    a, b = ours.get_text_embedding_batch(DOCUMENTS), theirs.get_text_embedding_batch(DOCUMENTS)
    assert np.abs(np.array(a) - b).max() <= TOLERANCE
    assert np.abs(np.array(ours.get_query_embedding(QUERY)) - theirs.get_query_embedding(QUERY)).max() <= TOLERANCE


def test_langchain_adapter_takes_a_path(st_model):
    """Issue 47: a pathlib.Path for model_name was refused (its field is a str); a local folder is a folder."""
    pytest.importorskip("langchain_huggingface")
    from pathlib import Path

    from st_fastbackend.integrations.langchain import FastBackendEmbeddings

    embeddings = FastBackendEmbeddings(model_name=Path(st_model("bert", pooling_mode="mean")))
    assert len(embeddings.embed_query(QUERY)) == 64
