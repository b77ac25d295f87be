"""A prompt shared by the texts of a call, computed once on a causal decoder.

In a causal decoder the prompt's hidden states, keys and values do not depend on the text after it.
The prefix pass runs the prompt's tokens alone and keeps each layer's keys and values (after q/k norm
and rotation) and the final hidden states; the texts then run without their prompt tokens, at positions
offset by the prompt's length, each token attending to [prompt keys ; its own text's keys so far].
A text whose tokens do not begin with exactly the prefix's tokens (a tokenizer may merge the prompt's
last characters with the text's first) runs the ordinary way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from st_fastbackend.engine.attention import _equal_length_runs, _repeat_kv
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.runtime import Runtime


@dataclass
class LayerKV:
    """One layer's keys and values of the prefix, [P, Hkv, D]; None until the prefix pass fills them."""

    keys: Tensor | None = None
    values: Tensor | None = None


@dataclass
class Prefix:
    ids: tuple[int, ...]  # the tokens computed once: the prompt's, without its last one (see follows)
    prompt_length: int  # the prompt's tokens as sentence-transformers counts them (pooling may exclude them)
    layers: list[LayerKV] = field(default_factory=list)
    states: Tensor | None = None  # [P, hidden]: the prefix's final hidden states, for pooling that includes them

    @property
    def length(self) -> int:
        return len(self.ids)

    def follows(self, sequence: Sequence[int]) -> bool:
        """Whether `sequence` begins with the prefix's tokens and has tokens of its own after the prompt.
        The prompt's last token is not part of the prefix: a tokenizer may merge the prompt's end with the
        text's start ("Query: " ends in a space token that "Query: text" does not have)."""
        return len(sequence) > self.prompt_length and tuple(sequence[: self.length]) == self.ids


def prefixed_attention(
    q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, kv: LayerKV, *, window: int | None, runtime: Runtime,
    scale: float | None = None,
) -> Tensor:  # fmt: skip
    """Causal attention of packed texts that all follow the same prefix: token i of a text, at position
    P + i, sees the prefix's keys and its own keys up to i, those within `window` positions of it.
    q: [T, Hq, D], k and v: [T, Hkv, D] (the texts' own tokens) -> [T, Hq, D].

    One SDPA call per run of equal-length texts, on every device: the prefix's keys are joined to each
    text's in that call (a copy of P keys per text), with an explicit [L, P + L] mask."""
    dtype, products = q.dtype, runtime.product_dtype or q.dtype  # attention's products as the layers' (onednn.py)
    q, k, v = q.to(products), k.to(products), v.to(products)
    prefix_k, prefix_v = kv.keys.to(products), kv.values.to(products)
    if not runtime.grouped_heads:
        k, v = _repeat_kv(k, v, q.shape[1])
        prefix_k, prefix_v = _repeat_kv(prefix_k, prefix_v, q.shape[1])
    prefix_k, prefix_v = prefix_k.transpose(0, 1), prefix_v.transpose(0, 1)  # [P, H, D] -> [H, P, D]
    out = torch.empty_like(q)
    start = 0
    for length, count in _equal_length_runs(batch.lengths):
        end = start + length * count
        # [n*L, H, D] -> [n, L, H, D] -> [n, H, L, D]
        qi, ki, vi = (t[start:end].view(count, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        ki = torch.cat((prefix_k.expand(count, -1, -1, -1), ki), dim=2)  # [n, H, P + L, D]
        vi = torch.cat((prefix_v.expand(count, -1, -1, -1), vi), dim=2)
        mask = _prefixed_mask(prefix_k.shape[1], length, window, q.device)
        oi = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, enable_gqa=qi.shape[1] != ki.shape[1], scale=scale
        )
        out[start:end].view(count, length, q.shape[1], q.shape[2]).copy_(oi.transpose(1, 2))  # -> [n, L, H, D]
        start = end
    return out.to(dtype)


def _prefixed_mask(prefix: int, length: int, window: int | None, device: torch.device) -> Tensor:
    """[L, P + L] bool, True where a query may attend: keys at or before it, within the window."""
    q_pos = torch.arange(prefix, prefix + length, device=device)[:, None]
    kv_pos = torch.arange(prefix + length, device=device)[None, :]
    allowed = kv_pos <= q_pos
    return allowed & (q_pos - kv_pos < window) if window is not None else allowed
