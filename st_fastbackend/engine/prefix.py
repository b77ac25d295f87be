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
from dataclasses import dataclass

import torch
from torch import Tensor

from st_fastbackend.engine.attention import kernel_takes, sdpa_attention, varlen_attention, window_cuts
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.runtime import Runtime


@dataclass
class LayerKV:
    """One layer's keys and values of the prefix, [P, Hkv, D]: filled by the prefix pass (Decoder.prefix_pass, which
    creates it), read-only afterwards."""

    keys: Tensor | None = None
    values: Tensor | None = None


@dataclass(frozen=True)
class Prefix:
    """The tokens a schedule's texts share at their start, and once computed (Decoder.prefix_pass returns a new
    Prefix, before any pack runs) what the packs after it read: never changed by a forward pass."""

    ids: tuple[int, ...]  # the tokens computed once: the prompt's, without its last one (see follows)
    prompt_length: int  # the prompt's tokens as sentence-transformers counts them (pooling may exclude them)
    layers: tuple[LayerKV, ...] = ()  # each layer's keys and values, once computed
    states: Tensor | None = None  # [P, hidden]: the prefix's final hidden states, for pooling that includes them

    @property
    def computed(self) -> bool:
        return self.states is not None

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
    q: [T, Hq, D], k and v: [T, Hkv, D] (the texts' own tokens) -> [T, Hq, D]. Through the varlen kernels
    with each text's keys [prefix ; its own] packed (query and key boundaries differ), where the runtime
    has one that takes them (the window where it cuts, keys longer than the queries); else through SDPA under an
    explicit mask."""
    cuts = window_cuts(window, batch.max_seqlen + len(kv.keys))
    if not kernel_takes(q, runtime, cuts, longer_keys=True):
        prefix = (kv.keys, kv.values)
        return sdpa_attention(q, k, v, batch, causal=True, window=window, runtime=runtime, scale=scale, prefix=prefix)
    cu_k, rows = _key_layout(batch, len(kv.keys))
    keys, values = _joined(kv.keys, k, rows), _joined(kv.values, v, rows)
    bounds = (cu_k, batch.max_seqlen + len(kv.keys))
    return varlen_attention(
        q, keys, values, batch, causal=True, window=window, runtime=runtime, scale=scale, keys=bounds
    )


def _key_layout(batch: PackedBatch, length: int) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Each text's keys packed as [`length` prefix keys ; its own]: their cu_seqlens, and the rows the
    prefix's keys and the texts' own keys go to (index arithmetic only: no copy back to the host)."""
    steps = torch.arange(batch.num_sequences + 1, device=batch.cu_seqlens.device, dtype=batch.cu_seqlens.dtype)
    cu_k = batch.cu_seqlens + length * steps
    prefix_rows = (cu_k[:-1, None] + torch.arange(length, device=cu_k.device)).flatten()  # [B * P]
    own_rows = torch.arange(batch.num_tokens, device=cu_k.device) + length * (batch.sequence_ids() + 1)  # [T]
    return cu_k, (prefix_rows, own_rows)


def _joined(prefix: Tensor, own: Tensor, rows: tuple[Tensor, Tensor]) -> Tensor:
    """[P, H, D] and the texts' own [T, H, D] -> [B * P + T, H, D]: each text's [prefix ; own], packed."""
    prefix_rows, own_rows = rows
    out = own.new_empty((len(prefix_rows) + own.shape[0], *own.shape[1:]))
    out[prefix_rows] = prefix.to(own.dtype).repeat(len(prefix_rows) // prefix.shape[0], 1, 1)
    out[own_rows] = own
    return out
