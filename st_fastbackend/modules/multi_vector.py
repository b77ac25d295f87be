"""Late interaction (ColBERT) on the packed engine: the backbone with its per-task lengths and query expansion,
and the scoring mask on packed tokens. The token-level Dense and Normalize of a MultiVectorEncoder work on packed
tokens [T, dim] as they are.

PackedMultiVectorTransformer stands in for sentence-transformers' Transformer with `query_length`,
`document_length` and `query_expansion`: a query is cut at its length; with expansion, a query shorter than
the expansion length gets expansion tokens (the tokenizer's mask token, else its EOS) up to it. With
`attend=True` every token attends to them; with classic ColBERT's `attend=False` they attend to the query's own
tokens but nothing attends to them (PackedBatch.attended: engine/attention.py keeps them out of the keys), on
the encoders (a decoder's causal attention is refused with it).
"""

from __future__ import annotations

from typing import Any

import torch
from sentence_transformers.base.modules import Transformer
from sentence_transformers.base.modules.transformer import _normalize_query_expansion
from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

from st_fastbackend.engine.batch import Tokens
from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.modules.options import module_config
from st_fastbackend.modules.transformer import PackedTransformer

TASK_KEYS = ("query_length", "document_length", "query_expansion")


class PackedMultiVectorTransformer(PackedTransformer):
    def __init__(
        self, model_name_or_path: str, *, query_length: int | None = None, document_length: int | None = None,
        query_expansion: dict | None = None, **kwargs,
    ) -> None:  # fmt: skip
        super().__init__(model_name_or_path, **kwargs)
        self.query_length, self.document_length = query_length, document_length
        self._check_lengths()
        self.query_expansion = _normalize_query_expansion(query_expansion)
        unattended = self.query_expansion is not None and not self.query_expansion["attend"]
        if unattended and self.family.causal:
            raise UnsupportedModelError(f"query_expansion with attend=False on a {self.config.model_type} (a decoder)")
        if self.query_expansion is not None:  # sentence-transformers' own check of the token (it reads .tokenizer)
            Transformer._validate_query_expansion_token(self, self.query_expansion)
        self.expansion_id = self._expansion_id()

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs) -> PackedMultiVectorTransformer:
        init_kwargs = Transformer._load_init_kwargs(model_name_or_path, subfolder=subfolder, **kwargs)
        tasks = {key: init_kwargs.pop(key, None) for key in TASK_KEYS}
        return cls(model_name_or_path, **tasks, **module_config(init_kwargs))

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), **{key: getattr(self, key) for key in TASK_KEYS}}

    def _expansion_id(self) -> int | None:
        """As sentence-transformers picks it: the configured token, else the mask token, else EOS."""
        if self.query_expansion is None:
            return None
        if (token := self.query_expansion.get("token")) is not None:
            return self.tokenizer.convert_tokens_to_ids(token)
        mask = self.tokenizer.mask_token_id
        return mask if mask is not None else self.tokenizer.eos_token_id

    def encode_task(self, texts: list[str], prompt: str | None, task: str | None, first_index: int) -> list[Tokens]:
        """Token ids as sentence-transformers' preprocess makes them for `task`: the task's length, and a query's
        expansion tokens up to the expansion length."""
        self._check_lengths()  # attributes a caller may have set since
        expansion = self.query_expansion if task == "query" else None
        length = {"query": self.query_length, "document": self.document_length}.get(task)
        if expansion is not None:
            floor = expansion["length"]
            length = floor if expansion["strategy"] == "fixed" else max(length or self.max_seq_length, floor)
        sequences = self.texts.encode(texts, prompt, length, first_index)
        if expansion is None or self.expansion_id is None:
            return [Tokens(ids) for ids in sequences]
        return [expanded(ids, self.expansion_id, expansion) for ids in sequences]

    def _check_lengths(self) -> None:
        """A negative length reaches the Rust tokenizer as an OverflowError naming nothing (plain's too)."""
        for name in ("query_length", "document_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive number of tokens or None, got {value!r}.")


def expanded(ids: list[int], expansion_id: int, expansion: dict) -> Tokens:
    """A query's token ids and its expansion tokens up to the expansion length; with attend=False, only its own
    tokens are attended to (the expansion tokens attend, unattended)."""
    attended = None if expansion["attend"] else len(ids)
    return Tokens(ids + [expansion_id] * (expansion["length"] - len(ids)), attended=attended)


class PackedMultiVectorMask(MultiVectorMask):
    """MultiVectorMask (same config and files) on packed tokens: features["scoring_mask"] [T] bool. Every packed
    token is real or an expansion token (both scored for a query); the skiplist and the allowlist apply as the
    parent applies them."""

    _on_device: tuple | None = None  # ((device, allowlist), skiplist ids, allowlist ids) there, as the last pack's

    def forward(self, features: dict[str, Any], task: str | None = None) -> dict[str, Any]:
        input_ids = features["packed"].input_ids
        mask = torch.ones_like(input_ids, dtype=torch.bool)
        skip, keep = self._ids_on(input_ids.device)
        if (task or "document") in self.skiplist_tasks and skip is not None and len(skip):
            mask &= ~torch.isin(input_ids, skip)
        if task != "query" and keep is not None:
            mask &= torch.isin(input_ids, keep)
        features["scoring_mask"] = mask
        return features

    def resolve_with_tokenizer(self, tokenizer) -> None:
        super().resolve_with_tokenizer(tokenizer)
        self._on_device = None  # a new skiplist

    def _ids_on(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The skiplist and allowlist ids on the device, copied there once, not at every pack: a copy from pageable
        host memory makes the host wait until the GPU's queue reaches it."""
        key = (device, tuple(self.keep_only_token_ids or ()))
        if self._on_device is None or self._on_device[0] != key:
            keep = torch.tensor(key[1], dtype=torch.long) if key[1] else None
            self._on_device = (key, *(None if t is None else t.to(device) for t in (self._skiplist_ids, keep)))
        return self._on_device[1], self._on_device[2]

    def __getstate__(self) -> dict:
        """Pickled (multi-process pools) without the device copies: a worker may not have that device."""
        return {k: v for k, v in self.__dict__.items() if k != "_on_device"}


def scored_rows(out: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
    """A pack's outputs -> the token vectors the scoring mask keeps, every text's one after the other [K, dim] on
    the device, and how many are each text's. The counts are the pack's one transfer to the host (which waits there
    for the pack); with their total the rows are gathered without another (a boolean index waits for its count)."""
    packed, mask = out["packed"], out["scoring_mask"]
    counts = torch.zeros(packed.num_sequences, dtype=torch.long, device=mask.device)
    counts = counts.index_add_(0, packed.sequence_ids(), mask.long()).tolist()  # [B]
    kept = torch.nonzero_static(mask, size=sum(counts)).squeeze(1)  # [K]
    return out["token_embeddings"][kept], counts
