"""LlamaIndex: `HuggingFaceEmbedding` with the fast backend as its model (extra `llamaindex`).

from st_fastbackend.integrations.llama_index import FastBackendEmbedding
embed_model = FastBackendEmbedding(model_name="BAAI/bge-small-en-v1.5")
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.embeddings.base import DEFAULT_EMBED_BATCH_SIZE
from llama_index.core.callbacks import CallbackManager
from llama_index.core.embeddings.multi_modal_base import MultiModalEmbedding
from llama_index.core.utils import get_cache_dir, infer_torch_device
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.embeddings.huggingface.utils import (
    DEFAULT_HUGGINGFACE_EMBEDDING_MODEL,
    get_query_instruct_for_model_name,
    get_text_instruct_for_model_name,
)

from st_fastbackend.models import SentenceTransformer


class FastBackendEmbedding(HuggingFaceEmbedding):
    """HuggingFaceEmbedding's constructor, building SentenceTransformer(backend="fast") instead of
    loading a plain model. LlamaIndex encodes queries with prompt_name="query" and documents with
    prompt_name="text"; both prompts are set here, as LlamaIndex sets them."""

    def __init__(
        self,
        model_name: str = DEFAULT_HUGGINGFACE_EMBEDDING_MODEL,
        max_length: int | None = None,
        query_instruction: str | None = None,
        text_instruction: str | None = None,
        normalize: bool = True,
        embed_batch_size: int = DEFAULT_EMBED_BATCH_SIZE,
        cache_folder: str | None = None,
        trust_remote_code: bool = False,
        device: str | None = None,
        callback_manager: CallbackManager | None = None,
        parallel_process: bool = False,
        target_devices: list[str] | None = None,
        show_progress_bar: bool = False,
        **model_kwargs: Any,
    ) -> None:
        device = device or infer_torch_device()
        model = SentenceTransformer(
            model_name,
            device=device,
            cache_folder=cache_folder or get_cache_dir(),
            trust_remote_code=trust_remote_code,
            prompts={
                "query": query_instruction or get_query_instruct_for_model_name(model_name),
                "text": text_instruction or get_text_instruct_for_model_name(model_name),
            },
            **{"backend": "fast", **model_kwargs},
        )
        if max_length:
            model.max_seq_length = max_length
        MultiModalEmbedding.__init__(  # HuggingFaceEmbedding.__init__ would load a plain model first
            self,
            embed_batch_size=embed_batch_size,
            callback_manager=callback_manager,
            model_name=model_name,
            max_length=model.max_seq_length,
            normalize=normalize,
            query_instruction=query_instruction,
            text_instruction=text_instruction,
            show_progress_bar=show_progress_bar,
        )
        self._device = device
        self._model = model
        self._parallel_process = parallel_process
        self._target_devices = target_devices
