"""Pooling over packed tokens: every sentence-transformers mode, reductions in fp32.

Sequence boundaries come from the PackedBatch (CLS = starts, last token = ends - 1), so nothing is
padded back. Each mode equals sentence-transformers' Pooling on the same texts with right padding.
"""

from __future__ import annotations

from typing import Any

import torch
from sentence_transformers.sentence_transformer.modules import Pooling
from torch import Tensor

from st_fastbackend.engine.batch import PackedBatch


class PackedPooling(Pooling):
    """sentence-transformers' Pooling (same config, same save format) with a packed forward."""

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        batch: PackedBatch = features["packed"]
        tokens: Tensor = features["token_embeddings"]  # [T, H]
        prompt_length = 0 if self.include_prompt else int(features.get("prompt_length") or 0)
        modes = (self.pooling_mode,) if isinstance(self.pooling_mode, str) else self.pooling_mode
        segments = _Segments(batch, prompt_length)
        vectors = [segments.pool(mode, tokens).to(tokens.dtype) for mode in modes]
        features["sentence_embedding"] = torch.cat(vectors, dim=-1)  # [B, modes * H]
        return features


class _Segments:
    """Which tokens each sequence pools: all of them, or those after the prompt."""

    def __init__(self, batch: PackedBatch, prompt_length: int) -> None:
        self.starts = batch.cu_seqlens[:-1].long()  # [B]
        self.ends = batch.cu_seqlens[1:].long()  # [B]
        self.num_sequences = batch.num_sequences
        self.prompt_length = prompt_length
        sequence_ids = batch.sequence_ids()  # [T]
        offsets = torch.arange(batch.num_tokens, device=sequence_ids.device) - self.starts[sequence_ids]  # [T]
        keep = offsets >= prompt_length
        self.token_index = keep.nonzero().squeeze(1) if prompt_length else None  # [T'] pooled tokens
        self.sequence_ids = sequence_ids[keep] if prompt_length else sequence_ids
        self.positions = (offsets[keep] if prompt_length else offsets) + 1  # 1-based, as weightedmean weighs
        self.has_tokens = (self.ends - self.starts) > prompt_length  # [B]

    def pool(self, mode: str, tokens: Tensor) -> Tensor:
        if mode == "cls":  # the first pooled token, or the first token when the prompt is all there is
            return tokens[self.starts + self.prompt_length * self.has_tokens]
        if mode == "lasttoken":  # padded sentence-transformers gathers a zero vector when nothing is pooled
            return tokens[self.ends - 1] * self.has_tokens[:, None]
        kept = tokens if self.token_index is None else tokens[self.token_index]  # [T', H]
        if mode == "max":
            out = kept.new_full((self.num_sequences, kept.shape[1]), float("-inf"))
            index = self.sequence_ids[:, None].expand_as(kept)
            return out.scatter_reduce(0, index, kept, reduce="amax")
        counts = self._sum(torch.ones_like(self.positions, dtype=torch.float32)[:, None])  # [B, 1]
        if mode == "mean":
            return self._sum(kept.float()) / counts.clamp(min=1e-9)
        if mode == "mean_sqrt_len_tokens":
            return self._sum(kept.float()) / counts.clamp(min=1e-9).sqrt()
        if mode == "weightedmean":
            weights = self.positions.float()[:, None]  # [T', 1]
            return self._sum(kept.float() * weights) / self._sum(weights).clamp(min=1e-9)
        raise ValueError(f"Unknown pooling mode {mode!r}")

    def _sum(self, values: Tensor) -> Tensor:
        """[T', C] -> [B, C]: per-sequence sums in fp32."""
        out = values.new_zeros((self.num_sequences, values.shape[1]), dtype=torch.float32)
        return out.index_add(0, self.sequence_ids, values.float())
