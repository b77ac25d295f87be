"""Random-weight sparse and multi-vector models saved by plain sentence-transformers: SPLADE on a masked-LM
checkpoint, inference-free SPLADE (a Router with a SparseStaticEmbedding query side), CSR, and ColBERT."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from builders import build_hf_model
from sentence_transformers import MultiVectorEncoder as PlainMultiVectorEncoder
from sentence_transformers import SparseEncoder as PlainSparseEncoder
from sentence_transformers.base.modules import Dense, Normalize, Router, Transformer
from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.sparse_encoder.modules import SparseAutoEncoder, SparseStaticEmbedding, SpladePooling


def build_splade(
    folder: Path, family: str, pooling_strategy: str = "max", activation_function: str = "relu",
    router: bool = False, prompts: dict | None = None, **overrides,
) -> Path:  # fmt: skip
    """A SPLADE folder: a *ForMaskedLM checkpoint as a fill-mask Transformer, then SpladePooling; with `router`,
    inference-free SPLADE: queries through a SparseStaticEmbedding of random weights, documents through SPLADE."""
    hf = build_hf_model(folder / "hf", family, masked_lm=True, **overrides)
    transformer = Transformer(str(hf), transformer_task="fill-mask", max_seq_length=128)
    pooling = SpladePooling(pooling_strategy=pooling_strategy, activation_function=activation_function)
    modules = [transformer, pooling]
    if router:
        torch.manual_seed(1)
        weight = torch.rand(transformer.tokenizer.vocab_size)
        static = SparseStaticEmbedding(tokenizer=transformer.tokenizer, weight=weight, frozen=True)
        modules = [Router.for_query_document(query_modules=[static], document_modules=modules)]
    PlainSparseEncoder(modules=modules, prompts=prompts, device="cpu").save(str(folder / "st"))
    shutil.rmtree(hf)
    return folder / "st"


def build_csr(folder: Path, family: str = "bert") -> Path:
    """CSR: Transformer, mean Pooling, then a SparseAutoEncoder (k=16) of random weights."""
    hf = build_hf_model(folder / "hf", family)
    transformer = Transformer(str(hf), max_seq_length=128)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    torch.manual_seed(2)
    sae = SparseAutoEncoder(input_dim=pooling.get_embedding_dimension(), hidden_dim=256, k=16, k_aux=32)
    with torch.no_grad():
        for param in sae.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    PlainSparseEncoder(modules=[transformer, pooling, sae], device="cpu").save(str(folder / "st"))
    shutil.rmtree(hf)
    return folder / "st"


def build_colbert(
    folder: Path, family: str = "bert", query_expansion: dict | None = None, query_length: int | None = None,
    document_length: int | None = None, skiplist_words: list[str] | None = None, prompts: dict | None = None,
    **overrides,
) -> Path:  # fmt: skip
    """A ColBERT-shaped folder: Transformer, a token-level Dense to 32 dimensions, MultiVectorMask, Normalize."""
    hf = build_hf_model(folder / "hf", family, **overrides)
    transformer = Transformer(str(hf), max_seq_length=128, query_length=query_length, document_length=document_length,
                              query_expansion=query_expansion)  # fmt: skip
    torch.manual_seed(3)
    dense = Dense(transformer.get_embedding_dimension(), 32, bias=False, activation_function=torch.nn.Identity(),
                  module_input_name="token_embeddings")  # fmt: skip
    modules = [transformer, dense, MultiVectorMask(skiplist_words=skiplist_words),
               Normalize(module_input_name="token_embeddings")]  # fmt: skip
    PlainMultiVectorEncoder(modules=modules, prompts=prompts, device="cpu").save(str(folder / "st"))
    shutil.rmtree(hf)
    return folder / "st"
