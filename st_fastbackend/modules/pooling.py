"""Pooling over packed tokens: every sentence-transformers mode, reductions in fp32.

Sequence boundaries come from the PackedBatch (CLS = starts, last token = ends - 1), so nothing is
padded back. Each mode equals sentence-transformers' Pooling on the same texts with right padding,
also where the prompt was computed once (engine/prefix.py) and only its final states are given.
"""

from __future__ import annotations

from typing import Any

import torch
from sentence_transformers.sentence_transformer.modules import Pooling
from torch import Tensor

from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.prefix import Prefix


class PackedPooling(Pooling):
    """sentence-transformers' Pooling (same config, same save format) with a packed forward."""

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        batch: PackedBatch = features["packed"]
        tokens: Tensor = features["token_embeddings"]  # [T, H]
        prefix: Prefix | None = features.get("prefix")  # computed once; the pack holds what follows it
        prompt_length = int(features.get("prompt_length") or 0)
        if prefix is None:
            segments = _Segments(batch, 0 if self.include_prompt else prompt_length, before=0, prompt=None)
        elif self.include_prompt:
            segments = _Segments(batch, 0, before=prefix.length, prompt=prefix.states)
        else:  # the prompt's tokens that are not in the prefix are in the pack
            segments = _Segments(batch, prompt_length - prefix.length, before=prefix.length, prompt=None)
        modes = (self.pooling_mode,) if isinstance(self.pooling_mode, str) else self.pooling_mode
        vectors = [segments.pool(mode, tokens).to(tokens.dtype) for mode in modes]
        features["sentence_embedding"] = torch.cat(vectors, dim=-1)  # [B, modes * H]
        return features


class _Segments:
    """Which tokens each sequence pools: all of them, or those after `skip` prompt tokens. With a prefix
    computed once, the pack holds what follows its `before` tokens, and `prompt` is the prefix's final
    hidden states [P, H] where pooling includes them (None where it excludes the prompt)."""

    def __init__(self, batch: PackedBatch, skip: int, before: int, prompt: Tensor | None) -> None:
        self.starts = batch.cu_seqlens[:-1].long()  # [B]
        self.ends = batch.cu_seqlens[1:].long()  # [B]
        self.num_sequences = batch.num_sequences
        self.skip, self.prompt = skip, prompt
        sequence_ids = batch.sequence_ids()  # [T]
        offsets = torch.arange(batch.num_tokens, device=sequence_ids.device) - self.starts[sequence_ids]  # [T]
        keep = offsets >= skip
        self.token_index = keep.nonzero().squeeze(1) if skip else None  # [T'] pooled tokens
        self.sequence_ids = sequence_ids[keep] if skip else sequence_ids
        self.positions = before + (offsets[keep] if skip else offsets) + 1  # 1-based, as weightedmean weighs
        self.has_tokens = (self.ends - self.starts) > skip  # [B]

    def pool(self, mode: str, tokens: Tensor) -> Tensor:
        prompt = self.prompt
        if mode == "cls":  # the first pooled token, or the first token when the prompt is all there is
            if prompt is not None:
                return prompt[0].expand(self.num_sequences, -1)
            return tokens[self.starts + self.skip * self.has_tokens]
        if mode == "lasttoken":  # padded sentence-transformers gathers a zero vector when nothing is pooled
            return tokens[self.ends - 1] * self.has_tokens[:, None]
        kept = tokens if self.token_index is None else tokens[self.token_index]  # [T', H]
        if mode == "max":
            out = kept.new_full((self.num_sequences, kept.shape[1]), float("-inf"))
            out = out.scatter_reduce(0, self.sequence_ids[:, None].expand_as(kept), kept, reduce="amax")
            return out if prompt is None else torch.maximum(out, prompt.amax(0))
        ones = torch.ones_like(self.positions, dtype=torch.float32)[:, None]  # [T', 1]
        count = self._sum(ones, None if prompt is None else torch.ones_like(prompt[:, :1], dtype=torch.float32))
        if mode == "mean":
            return self._sum(kept, prompt) / count.clamp(min=1e-9)
        if mode == "mean_sqrt_len_tokens":
            return self._sum(kept, prompt) / count.clamp(min=1e-9).sqrt()
        if mode == "weightedmean":
            weights = self.positions.float()[:, None]  # [T', 1]
            if prompt is None:
                return self._sum(kept.float() * weights) / self._sum(weights).clamp(min=1e-9)
            prompt_weights = torch.arange(1, len(prompt) + 1, device=prompt.device, dtype=torch.float32)[:, None]
            total = self._sum(weights, prompt_weights)
            return self._sum(kept.float() * weights, prompt.float() * prompt_weights) / total.clamp(min=1e-9)
        raise ValueError(f"Unknown pooling mode {mode!r}")

    def _sum(self, values: Tensor, prompt_values: Tensor | None = None) -> Tensor:
        """[T', C] -> [B, C]: per-sequence sums in fp32, plus the sum over the prompt's [P, C] where given."""
        out = values.new_zeros((self.num_sequences, values.shape[1]), dtype=torch.float32)
        out = out.index_add(0, self.sequence_ids, values.float())
        return out if prompt_values is None else out + prompt_values.float().sum(0)
