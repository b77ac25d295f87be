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

from torch import Tensor

from st_fastbackend.engine.attention import sdpa_attention
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
    q: [T, Hq, D], k and v: [T, Hkv, D] (the texts' own tokens) -> [T, Hq, D]. Through SDPA on every
    device, the prefix's keys joined to each text's (a copy of P keys per text) under an explicit mask."""
    prefix = (kv.keys, kv.values)
    return sdpa_attention(q, k, v, batch, causal=True, window=window, runtime=runtime, scale=scale, prefix=prefix)
