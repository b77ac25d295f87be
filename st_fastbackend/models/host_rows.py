"""Where a call's rows go, in the caller's order, and how rows copied from a GPU leave pinned memory."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor


class HostRows:
    """Where each pack's rows go in the caller's order. From a GPU, rows are copied to the host without waiting,
    into pinned (page-locked) memory; each pack's rows move to ordinary memory once their copy is done, at most
    DEPTH packs behind the newest, so pinned memory holds a few packs' rows rather than the whole call's (1M
    e5-mistral rows would be 16 GB pinned, kept by PyTorch's host cache after the call)."""

    DEPTH = 4  # packs in flight: the host waits for the oldest only while the GPU has newer ones queued

    def __init__(self, results: list, copied_from: torch.device | None = None, event=None, stream=None) -> None:
        """`copied_from`: the GPU the rows are copied from without waiting; None: rows are placed as they come.
        `event`, `stream`: torch.cuda.Event and torch.cuda.current_stream (stand-ins in the tests)."""
        self.results, self.device = results, copied_from
        self.event = event or torch.cuda.Event  # a copy's completion
        self.stream = stream or torch.cuda.current_stream
        self.pending: deque[tuple[list[int], Tensor, list[int] | None, Any]] = deque()

    def add(self, positions: list[int], rows: list | Tensor, counts: list[int] | None = None) -> None:
        """`counts`: `rows` holds every position's rows one after the other, this many each (a MultiVectorEncoder's
        [n_i, dim]): one tensor to copy, split where it lands."""
        if self.device is None:
            self._place(positions, rows, counts)
            return
        done = self.event()
        # On the queue of the model's GPU, where the copy was queued: the current device's (record()'s default)
        # is another GPU's for a model on cuda:1 or in a multi-process pool, and would be done at once.
        done.record(self.stream(self.device))
        self.pending.append((positions, rows, counts, done))
        while len(self.pending) > self.DEPTH:
            self._land()

    def finish(self) -> None:
        while self.pending:
            self._land()

    def _land(self) -> None:
        positions, rows, counts, done = self.pending.popleft()
        done.synchronize()
        self._place(positions, rows.clone(), counts)  # ordinary memory; the pinned block goes back to be reused

    def _place(self, positions: list[int], rows: list | Tensor, counts: list[int] | None) -> None:
        for i, row in zip(positions, rows if counts is None else rows.split(counts), strict=True):
            self.results[i] = row
