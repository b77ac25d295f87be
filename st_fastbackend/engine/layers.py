"""Norms and rotary position embeddings, numerically as Hugging Face computes them (fp32 inside)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # As transformers' LlamaRMSNorm: statistics in fp32, cast back before the weight multiply.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for the positions of a batch. `inv_freq` stays fp32 whatever the model dtype."""

    def __init__(self, inv_freq: Tensor, attention_scaling: float) -> None:
        super().__init__()
        assert inv_freq.dtype == torch.float32 and inv_freq.device.type == "cpu"
        self.inv_freq = inv_freq  # a plain attribute, so model.to(dtype) cannot round it
        self.attention_scaling = attention_scaling

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D], the rotate_half layout
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos, sin: [T, D]. Hugging Face's rotate_half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
