"""The one packing schedule, for encode() and the server's worker alike: token sequences sorted by length,
cut into packs of at most `max_texts` texts and `max_tokens_per_batch` tokens, each pack run with
out-of-memory back-off; yields (indices into the sequences, the model's outputs for them)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from st_fastbackend.engine import runtime
from st_fastbackend.engine.batch import Tokens, plan_batches
from st_fastbackend.engine.prefix import Prefix
from st_fastbackend.engine.spec import mlp_width

# Tokens per pack on a CPU: large enough for efficient matrix products, small enough that activations stay
# in the tens of MiB for small models. A GPU sizes it from its free memory, never below MIN_GPU_TOKENS.
CPU_TOKENS = 8192
MIN_GPU_TOKENS = 8192
# Texts a CPU pack may hold whatever the caller's batch_size: as many as the token budget takes. Each pack costs a
# fixed part besides its tokens, which short texts at batch_size=32 feel; results do not depend on the pack
# (eval/RESULTS.md, "2026-12-05 07:08 — short texts").
CPU_PACK_TEXTS = 4096


def texts_per_pack(batch_size: int, device: torch.device) -> int:
    """How many texts a pack of encode() (or the corpus job) may hold: on a CPU, as many as the token budget takes
    (batch_size is not a cap there); on a device of varlen kernels (a GPU, or a CPU standing in for one in the
    tests: runtime.VARLEN_DEVICES) batch_size, as plain sentence-transformers."""
    return batch_size if device.type in runtime.VARLEN_DEVICES else max(batch_size, CPU_PACK_TEXTS)


class Schedule:
    """Runs token sequences through `model.forward_sequences` in packs. A pack that runs out of device
    memory is split in two and the halves retried, first half first, so no text is lost or reordered; the
    budget learned (half the failed pack's tokens) holds for every later pack of this schedule.

    Everything a pack is run with besides its sequences is decided here, once: the prompt, the prefix computed once
    (`prefix`: a causal decoder's prompt, or what a chunk of pairs shares) and what the modules take besides the
    features (`module_kwargs`: a task, a SparseEncoder's max_active_dims)."""

    def __init__(self, model, prompt: str | None, device: torch.device, max_texts: int, max_tokens: int,
                 module_kwargs: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        self.model, self.prompt, self.device = model, prompt, device
        self.max_texts, self.max_tokens = max_texts, max_tokens
        self.module_kwargs = MappingProxyType(dict(module_kwargs or {}))
        self.prefix = model.prompt_prefix(prompt)  # computed before the first pack that follows it
        self._computed: tuple[Any, Any] = (None, None)  # (a prefix, its computed form)

    def run(self, sequences: Sequence[Tokens | Sequence[int]]) -> Iterator[tuple[list[int], dict]]:
        """Longest first (equal lengths side by side, which the CPU attention runs as one call). A change of
        PyTorch's setting for fp32 products is followed from here on (one read per run: a chunk of an encode()
        call, a server batch), as plain sentence-transformers follows it. `sequences`: token ids, or Tokens
        records (a pair's token types, a query's attended count) as they reach the model."""
        self.model.packed_input.refresh_runtime()
        for prefix, own in self._groups([Tokens.of(s) for s in sequences]):
            order = sorted(own, key=lambda i: -len(own[i]))
            for pack in plan_batches([len(own[i]) for i in order], self.max_texts, self.max_tokens):
                yield from self._run_pack(own, [order[j] for j in pack], prefix)

    def _groups(self, sequences: list[Tokens]) -> list[tuple[Prefix | None, dict[int, Tokens]]]:
        """(None, the texts to run whole); with a prompt computed once, also (the prompt computed, the texts that
        begin with exactly its tokens, without them)."""
        if self.prefix is None:
            return [(None, dict(enumerate(sequences)))]
        follows = [self.prefix.follows(tokens.ids) for tokens in sequences]
        whole = {i: tokens for i, tokens in enumerate(sequences) if not follows[i]}
        after = {i: tokens.after(self.prefix.length) for i, tokens in enumerate(sequences) if follows[i]}
        return [(None, whole)] + ([(self._computed_prefix(), after)] if after else [])

    def _computed_prefix(self) -> Prefix:
        """The prefix's own pass, once for each prefix the schedule is given."""
        if self._computed[0] is not self.prefix:
            self._computed = (self.prefix, self.model.packed_input.computed_prefix(self.prefix, self.device))
        return self._computed[1]

    def _run_pack(
        self, sequences: dict[int, Tokens], pack: list[int], prefix: Prefix | None
    ) -> Iterator[tuple[list[int], dict]]:
        packs = [pack]
        while packs:
            picked = packs.pop()
            tokens = sum(len(sequences[i]) for i in picked)
            if len(picked) > 1 and tokens > self.max_tokens:  # over the budget learned from a failure
                packs += _halves(picked)
                continue
            try:
                out = self.model.forward_sequences([sequences[i] for i in picked], self.prompt, self.device,
                                                   prefix=prefix, module_kwargs=self.module_kwargs)  # fmt: skip
            except torch.OutOfMemoryError:
                if len(picked) == 1:
                    raise
                self.max_tokens = max(1, tokens // 2)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                packs += _halves(picked)
                continue
            yield picked, out


def _halves(picked: list[int]) -> list[list[int]]:
    """The two halves of a pack, the first half last: popped first from a stack of packs."""
    middle = len(picked) // 2
    return [picked[middle:], picked[:middle]]


def default_max_tokens(config, dtype: torch.dtype, device: torch.device) -> int:
    """CPU_TOKENS on a CPU; on a GPU, what half its free memory holds."""
    return cuda_max_tokens(config, dtype, device) if device.type == "cuda" else CPU_TOKENS


def cuda_max_tokens(
    config, dtype: torch.dtype, device: torch.device, fraction: float = 0.5, share: float = 1.0
) -> int:
    """Tokens per pack whose activations fit in `fraction` of the GPU memory still free. Per token, a
    layer holds at most about 4 x (hidden + intermediate) values at once (hidden states and their norm,
    fused q/k/v, fused gate/up with the activation and its product); attention kernels add O(tokens).
    `share`: the part of the GPU this process holds (a Ray actor of gpus_per_worker=0.5): the others on it
    see the same free memory, so this one counts at most its part of the total, less what it already holds."""
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # cached by PyTorch
    free = min(free, int(share * total) - torch.cuda.memory_allocated(device))
    per_token = 4 * (config.hidden_size + mlp_width(config)) * dtype.itemsize
    return max(MIN_GPU_TOKENS, int(free * fraction) // per_token)
