"""PackedBatch: a batch of token sequences concatenated without padding.

Between the schedule and the model the contract is typed, as text-embeddings-inference's `Batch` is: the schedule
hands over `Tokens` records (a sequence's ids and what a pack needs of it besides them), the model packs them into
one `PackedBatch`. `cu_seqlens` is the source of truth; positions and sequence indices are derived from it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class Tokens:
    """One sequence (a text, or a pair) as tokenized for the model."""

    ids: list[int]
    token_types: list[int] | None = None  # a pair's segment ids (the second text is segment 1 in BERT); None: 0s
    # How many of its first tokens the others attend to (ColBERT's query expansion with attend=False:
    # engine/attention.py); None: every token.
    attended: int | None = None

    @classmethod
    def of(cls, sequence: Tokens | Sequence[int]) -> Tokens:
        """A record for token ids (a record stays as it is)."""
        return sequence if isinstance(sequence, Tokens) else cls(list(sequence))

    def __len__(self) -> int:
        return len(self.ids)

    def after(self, count: int) -> Tokens:
        """The sequence without its first `count` tokens (those of a prefix computed once: engine/prefix.py)."""
        types = None if self.token_types is None else self.token_types[count:]
        attended = None if self.attended is None else self.attended - count
        return Tokens(self.ids[count:], types, attended)


@dataclass(frozen=True)
class PackedBatch:
    input_ids: Tensor  # [T] int64, all sequences back to back
    position_ids: Tensor  # [T] int64, restarting at 0 with each sequence
    cu_seqlens: Tensor  # [B+1] int32, sequence i is tokens cu_seqlens[i] : cu_seqlens[i+1]
    max_seqlen: int
    lengths: tuple[int, ...]  # the same boundaries, kept on the CPU so loops never call .item()
    token_type_ids: Tensor | None = None  # [T] int64, a pair's segments (BERT); None: segment 0 everywhere
    # Per sequence, how many of its first tokens are attended to; the rest only attend (ColBERT's query expansion
    # tokens with attend=False: engine/attention.py). None: every token.
    attended: tuple[int, ...] | None = None
    attended_counts: Tensor | None = None  # [B] int64, `attended` on the batch's device (with_attended sets both)

    @classmethod
    def from_sequences(
        cls, sequences: Sequence[Sequence[int]], position_offset: int = 0,
        token_types: Sequence[Sequence[int]] | None = None,
    ) -> PackedBatch:  # fmt: skip
        """Pack token-id lists; `position_offset` starts positions at e.g. padding_idx + 1 (RoBERTa);
        `token_types`: each sequence's segment ids, as a tokenizer gives them for a pair."""
        lengths = tuple(len(ids) for ids in sequences)
        if not lengths or min(lengths) == 0:
            raise ValueError("A PackedBatch needs at least one sequence and no empty sequence.")
        cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.tensor(lengths).cumsum(0)
        input_ids = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long)
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), torch.tensor(lengths))  # [T]
        position_ids = torch.arange(len(input_ids)) - starts + position_offset
        types = None
        if token_types is not None:
            types = torch.tensor(list(itertools.chain.from_iterable(token_types)), dtype=torch.long)
        return cls(input_ids, position_ids, cu_seqlens, max(lengths), lengths, types)

    @classmethod
    def from_tokens(cls, sequences: Sequence[Tokens], position_offset: int = 0) -> PackedBatch:
        """Pack `Tokens` records: their ids, their token types where they have them, their attended counts where
        any has one."""
        typed = {s.token_types is not None for s in sequences}
        if len(typed) > 1:
            raise ValueError("A pack of sequences some with token types and some without.")
        types = [s.token_types for s in sequences] if typed == {True} else None
        batch = cls.from_sequences([s.ids for s in sequences], position_offset, types)
        if any(s.attended is not None for s in sequences):
            batch = batch.with_attended([len(s) if s.attended is None else s.attended for s in sequences])
        return batch

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    def sequence_ids(self) -> Tensor:
        """[T] int64: the index of the sequence each token belongs to."""
        counts = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        index = torch.arange(self.num_sequences, device=self.cu_seqlens.device)
        return torch.repeat_interleave(index, counts, output_size=self.num_tokens)

    def with_attended(self, attended: Sequence[int]) -> PackedBatch:
        """The batch with `attended` counts, given before .to(): they then reach the device in its one copy."""
        return replace(self, attended=tuple(attended), attended_counts=torch.tensor(attended, device=self.device))

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @functools.cached_property
    def attended_keys(self) -> tuple[Tensor, Tensor, int]:
        """With `attended`: the positions of the attended tokens [K], their cu_seqlens [B+1] and the longest count;
        computed at the first layer that asks, kept for the others (a moved batch is a new object)."""
        device, counts = self.device, self.attended_counts
        cu = torch.zeros(len(counts) + 1, dtype=torch.int32, device=device)
        cu[1:] = counts.cumsum(0)
        total = sum(self.attended)
        within = torch.arange(total, device=device) - cu[:-1].long().repeat_interleave(counts, output_size=total)
        starts = self.cu_seqlens[:-1].long().repeat_interleave(counts, output_size=total)
        return starts + within, cu, max(self.attended)

    @functools.cached_property
    def attended_tokens(self) -> Tensor:
        """[T] bool, with `attended`: whether each token is among its sequence's attended ones; computed on the
        device at the first layer that asks (the SDPA loop views each run's key mask in it)."""
        counts = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        starts = self.cu_seqlens[:-1].long().repeat_interleave(counts, output_size=self.num_tokens)
        limits = self.attended_counts.repeat_interleave(counts, output_size=self.num_tokens)
        return torch.arange(self.num_tokens, device=self.device) - starts < limits

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """On a GPU, non_blocking copies go through pinned memory so they never wait for the GPU's queue."""
        device = torch.device(device)
        pin = non_blocking and device.type == "cuda" and self.input_ids.device.type == "cpu"
        names = ("input_ids", "position_ids", "cu_seqlens", "token_type_ids", "attended_counts")
        tensors = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        moved = {name: (t.pin_memory() if pin else t) for name, t in tensors.items()}
        return replace(self, **{name: t.to(device, non_blocking=non_blocking) for name, t in moved.items()})


def host_to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """A host tensor on `device` without the host waiting for the device's queue: on a GPU through pinned memory
    (from pageable memory even a non_blocking copy waits). The caching host allocator keeps the pinned block until
    the copy is done."""
    device = torch.device(device)
    pinned = tensor.pin_memory() if device.type == "cuda" and tensor.device.type == "cpu" else tensor
    return pinned.to(device, non_blocking=True)


def plan_batches(lengths: Sequence[int], max_texts: int, max_tokens: int) -> list[range]:
    """Split sequences, in the given order, into consecutive batches of at most `max_texts` sequences
    and `max_tokens` tokens (a sequence longer than `max_tokens` forms a batch of its own)."""
    batches: list[range] = []
    start, tokens = 0, 0
    for i, length in enumerate(lengths):
        if i > start and (i - start == max_texts or tokens + length > max_tokens):
            batches.append(range(start, i))
            start, tokens = i, 0
        tokens += length
    if start < len(lengths):
        batches.append(range(start, len(lengths)))
    return batches
