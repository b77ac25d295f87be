"""Dynamic batching, fair between requests. Requests from every client wait in one queue as token ids; a single
worker thread runs them in token-budget packs, one pack at a time, and lets in whatever arrived before it
starts the next. Each pack is filled from the requests served least recently (a new one first), one sequence
of each in turn, so a one-text request waits for the pack that was running when it came and for no more,
however large the requests ahead of it. Packs are also kept to about `pack_seconds` of model time (the rate is
measured as the worker runs), which bounds that wait on a slow machine.

A text's embedding does not depend on what it was packed with, so a pack that fails is run again request by
request: only the request that fails alone gets the error. A CUDA error is the exception: it leaves the device
unusable for the process, so every request gets it and the worker stops (the server then exits to be
restarted)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from st_fastbackend.engine.host_memory import release_memory
from st_fastbackend.engine.runtime import is_device_failure
from st_fastbackend.engine.schedule import Schedule
from st_fastbackend.serve.metrics import Metrics
from st_fastbackend.serve.servable import Servable

logger = logging.getLogger(__name__)
PACK_SECONDS = 0.25  # model time per pack the worker aims at: a request arriving mid-pack waits about this long


class ShuttingDown(RuntimeError):
    """The server stopped taking requests (SIGTERM): answered with 503."""


class DeviceFailed(ShuttingDown):
    """The device failed for the rest of the process: every request from then on is answered with 503."""


class ClientLeft(RuntimeError):
    """The request's client disconnected while it was being embedded: its remaining packs were skipped."""


@dataclass
class Job:
    token_ids: list[list[int]]  # tokenized with `prompt`, cut at the input limit
    prompt: str | None
    future: Future = field(default_factory=Future)  # cancelled: the client left, the job is dropped
    queued_at: float = field(default_factory=time.perf_counter)
    left: bool = False  # set by the endpoint when its client disconnects: the packs still to run are skipped
    output: str = "sentence_embedding"  # what each sequence's row is: one of the model's outputs, or LATE_CHUNKS
    spans: list[list[tuple[int, int]]] | None = None  # LATE_CHUNKS: per sequence its chunks' token spans in it


@dataclass(eq=False)
class Running:
    """A job the worker has taken: its rows so far and its sequences still to run, longest first."""

    job: Job
    rows: list
    todo: deque[int]
    served: int = -1  # the last round it had sequences in; -1 (none yet) goes first
    over: bool = False  # its future is set

    @classmethod
    def of(cls, job: Job) -> Running:
        order = sorted(range(len(job.token_ids)), key=lambda i: -len(job.token_ids[i]))
        return cls(job, [None] * len(job.token_ids), deque(order))

    def end(self, error: BaseException | None = None) -> None:
        if error is None:
            self.job.future.set_result(self.rows)
        else:
            self.job.future.set_exception(error)
        self.over = True


def fill_pack(group: list[Running], max_texts: int, max_tokens: int) -> list[tuple[Running, int]]:
    """One pack's (job, sequence index): a sequence of each job in turn, least recently served first, while
    the pack has under `max_texts` texts and the next fits in `max_tokens` (the first goes in whatever its
    length; a job whose next sequence does not fit gives no more to this pack)."""
    # sorted() is stable: among jobs served as recently, the first to come goes first
    turns = deque(sorted((running for running in group if running.todo), key=lambda running: running.served))
    picked: list[tuple[Running, int]] = []
    tokens = 0
    while turns and len(picked) < max_texts:
        running = turns.popleft()
        length = len(running.job.token_ids[running.todo[0]])
        if picked and tokens + length > max_tokens:
            continue
        picked.append((running, running.todo.popleft()))
        tokens += length
        if running.todo:
            turns.append(running)
    return picked


# Per sequence its chunks' vectors [k, dim], pooled from its token embeddings over the job's spans (an Embedder's
# late_chunks: only its routes ask for them).
LATE_CHUNKS = "late_chunks"


class Batcher:
    def __init__(self, served: Servable, max_tokens_per_batch: int, max_batch_size: int, metrics: Metrics,
                 dynamic: bool = True, on_failure: Callable[[DeviceFailed], None] | None = None,
                 pack_seconds: float = PACK_SECONDS) -> None:  # fmt: skip
        self.served = served
        self.max_tokens_per_batch = max_tokens_per_batch  # lowered for good when a pack runs out of memory
        self.max_batch_size = max_batch_size
        self.metrics = metrics
        self.dynamic = dynamic  # False: one request at a time (the baseline the benchmark compares with)
        self.pack_seconds = pack_seconds
        self._seconds_per_token: float | None = None  # measured on every pack
        self._pending: deque[Job] = deque()
        self._active: list[Running] = []  # taken, in the order they came; touched by the worker only
        self._schedules: dict[str | None, Schedule] = {}  # one per prompt: a prompt computed once serves all packs
        self._round = 0
        self._trimmed_at = 0  # the round after which memory was last handed back
        self._wake = threading.Condition()
        self._stopping = False
        self.failure: DeviceFailed | None = None  # set once the device failed; the worker has stopped
        self.on_failure = on_failure  # called on the worker's thread when it does
        self._thread = threading.Thread(target=self._run, name="embedding-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> Future:
        with self._wake:
            if self.failure is not None:
                raise DeviceFailed(str(self.failure))
            if self._stopping:
                raise ShuttingDown("The server is shutting down.")
            self._pending.append(job)
            self._wake.notify()
        return job.future

    def stop(self) -> None:
        """Finish what is queued, then end the worker."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def _run(self) -> None:
        while self._admit():
            try:
                self._run_round()
            except DeviceFailed as failed:
                self._fail(failed)
                return
            self._active = [running for running in self._active if not running.over]
            prompts = {running.job.prompt for running in self._active}
            self._schedules = {p: s for p, s in self._schedules.items() if p in prompts}

    def _admit(self) -> bool:
        """Take what is waiting (one job at a time without dynamic batching) and drop jobs whose client left;
        False once stopping with nothing left to run."""
        while True:
            with self._wake:
                idle = not self._pending and not self._active
            if idle and self._round > self._trimmed_at:  # a burst has ended: hand back what it freed (~0.1 s)
                self._trimmed_at = self._round
                release_memory()
            with self._wake:
                while not self._pending and not self._active and not self._stopping:
                    self._wake.wait()
                if not self._pending and not self._active:
                    return False  # stopping
                taken = []
                while self._pending and (self.dynamic or not (self._active or taken)):
                    taken.append(self._pending.popleft())
            self._take(taken)
            if self._active:
                return True

    def _take(self, taken: list[Job]) -> None:
        now = time.perf_counter()
        for job in taken:
            self.metrics.queue_wait.observe(now - job.queued_at)
            if job.future.set_running_or_notify_cancel():
                self._active.append(Running.of(job))
            else:
                self.metrics.dropped.inc()
        for running in self._active:
            if running.job.left:
                self.metrics.dropped.inc()
                running.end(ClientLeft("The client disconnected."))
        self._active = [running for running in self._active if not running.over]

    def _run_round(self) -> None:
        """One pack (two where a prompt computed once does not prefix every text) for the prompt of the job
        served least recently; the jobs it completes get their rows."""
        prompt = min(self._active, key=lambda running: running.served).job.prompt
        group = [running for running in self._active if running.job.prompt == prompt]
        items = fill_pack(group, self.max_batch_size, self._pack_tokens())
        self._round += 1
        for running, _ in items:
            running.served = self._round
        if prompt not in self._schedules:
            self._schedules[prompt] = self.served.schedule(prompt, self.max_batch_size, self.max_tokens_per_batch)
        schedule = self._schedules[prompt]
        schedule.max_tokens = self.max_tokens_per_batch  # as learned by any schedule
        self._run_isolated(schedule, items)
        self.max_tokens_per_batch = min(self.max_tokens_per_batch, schedule.max_tokens)
        for running in dict.fromkeys(running for running, _ in items):
            if not running.over and not running.todo:
                running.end()

    def _pack_tokens(self) -> int:
        """The token budget, or fewer where the rate measured says a pack of them would take over pack_seconds."""
        if self._seconds_per_token is None:
            return self.max_tokens_per_batch
        return max(1, min(self.max_tokens_per_batch, int(self.pack_seconds / self._seconds_per_token)))

    def _measure(self, seconds_per_token: float) -> None:
        """Averaged with the rate so far: one slow pack (a compilation, a busy machine) halves, not rules."""
        last = self._seconds_per_token
        self._seconds_per_token = seconds_per_token if last is None else (last + seconds_per_token) / 2

    def _fail(self, failed: DeviceFailed) -> None:
        """After a device failure: no more jobs; the ones taken and the ones waiting get the error."""
        logger.error("The device failed; the worker stops", exc_info=failed.__cause__)
        with self._wake:
            self.failure, self._stopping = failed, True
            waiting = list(self._pending)
            self._pending.clear()
        for running in self._active:
            if not running.over:
                running.end(failed)
        for job in waiting:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(failed)
        if self.on_failure is not None:
            self.on_failure(failed)

    def _run_isolated(self, schedule: Schedule, items: list[tuple[Running, int]]) -> None:
        """Run the pack; if that fails, each job's part of it alone, so the failure reaches only its own job."""
        try:
            self._embed(schedule, items)
        except Exception as error:  # the worker must outlive any failure but the device's
            if is_device_failure(error):
                message = f"The device failed ({type(error).__name__}: {error}); the server is shutting down."
                raise DeviceFailed(message) from error
            jobs = list(dict.fromkeys(running for running, _ in items))
            if len(jobs) > 1:
                self.metrics.reruns.inc()
                for job in jobs:
                    self._run_isolated(schedule, [item for item in items if item[0] is job])
            else:
                logger.exception("Embedding a request failed")
                jobs[0].end(error)

    def _embed(self, schedule: Schedule, items: list[tuple[Running, int]]) -> None:
        """Run the sequences through the schedule, each row into its job's rows. Jobs asking for different outputs
        share packs (the forward pass is the same); each output's rows are the model's class's (Servable.rows)."""
        ids = [running.job.token_ids[index] for running, index in items]
        start = time.perf_counter()
        with torch.inference_mode():
            for picked, out in schedule.run(ids):
                asked = {items[k][0].job.output for k in picked}
                rows = {output: self.served.rows(output, out) for output in asked if output != LATE_CHUNKS}
                if LATE_CHUNKS in asked:
                    jobs = [items[k] for k in picked]
                    spans = [r.job.spans[i] if r.job.output == LATE_CHUNKS else [] for r, i in jobs]
                    rows[LATE_CHUNKS] = self.served.late_chunks(out, spans)
                seconds, tokens = time.perf_counter() - start, sum(len(ids[k]) for k in picked)
                self.metrics.compute.observe(seconds)
                self.metrics.batch_tokens.observe(tokens)
                self.metrics.batch_texts.observe(len(picked))
                self._measure(seconds / tokens)
                for position, k in enumerate(picked):
                    running, index = items[k]
                    running.rows[index] = (rows[running.job.output][position], len(ids[k]))
                start = time.perf_counter()
