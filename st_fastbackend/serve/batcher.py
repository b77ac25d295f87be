"""Dynamic batching: requests from every client wait in one queue as token ids; a single worker thread
takes all that are waiting and runs them together in token-budget packs. A text's embedding does not
depend on what it was packed with, so a batch that fails is run again job by job: only the job that
fails alone gets the error. A CUDA error is the exception: it leaves the device unusable for the process, so
every job gets it and the worker stops (the server then exits to be restarted)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from st_fastbackend.embedder import Embedder
from st_fastbackend.serve.metrics import Metrics

logger = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """The server stopped taking requests (SIGTERM): answered with 503."""


class DeviceFailed(ShuttingDown):
    """The device failed for the rest of the process: every request from then on is answered with 503."""


def is_device_failure(error: BaseException) -> bool:
    """A CUDA error (an illegal address, a device-side assert) poisons the process's CUDA context: every later
    call fails too. PyTorch >= 2.8 raises torch.AcceleratorError for it, older releases a RuntimeError whose
    message says "CUDA error". Running out of memory is neither (torch.OutOfMemoryError; the schedule backs off)."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(error, accelerator_error) or (isinstance(error, RuntimeError) and "CUDA error" in str(error))


@dataclass
class Job:
    token_ids: list[list[int]]  # tokenized with `prompt`, cut at the input limit
    prompt: str | None
    future: Future = field(default_factory=Future)  # cancelled: the client left, the job is dropped
    queued_at: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(self, embedder: Embedder, max_tokens_per_batch: int, max_batch_size: int, metrics: Metrics,
                 dynamic: bool = True, on_failure: Callable[[DeviceFailed], None] | None = None) -> None:  # fmt: skip
        self.embedder = embedder
        self.max_tokens_per_batch = max_tokens_per_batch
        self.max_batch_size = max_batch_size
        self.metrics = metrics
        self.dynamic = dynamic  # False: one request per forward (the baseline the benchmark compares with)
        self._pending: deque[Job] = deque()
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
        while True:
            with self._wake:
                while not self._pending and not self._stopping:
                    self._wake.wait()
                if not self._pending:
                    return
                taken = list(self._pending) if self.dynamic else [self._pending[0]]
                for _ in taken:
                    self._pending.popleft()
            now = time.perf_counter()
            jobs = []
            for job in taken:
                self.metrics.queue_wait.observe(now - job.queued_at)
                if job.future.set_running_or_notify_cancel():
                    jobs.append(job)
                else:
                    self.metrics.dropped.inc()
            try:
                self._embed_isolated(jobs)
            except DeviceFailed as failed:
                self._fail(failed, jobs)
                return

    def _fail(self, failed: DeviceFailed, jobs: list[Job]) -> None:
        """After a device failure: no more jobs; the ones taken and the ones waiting get the error."""
        logger.error("The device failed; the worker stops", exc_info=failed.__cause__)
        with self._wake:
            self.failure, self._stopping = failed, True
            waiting = list(self._pending)
            self._pending.clear()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(failed)
        for job in waiting:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(failed)
        if self.on_failure is not None:
            self.on_failure(failed)

    def _embed_isolated(self, jobs: list[Job]) -> None:
        """Run the jobs together; if that fails, each alone, so the failure reaches only its own job."""
        try:
            self._embed(jobs)
        except Exception as error:  # the worker must outlive any failure but the device's
            if is_device_failure(error):
                message = f"The device failed ({type(error).__name__}: {error}); the server is shutting down."
                raise DeviceFailed(message) from error
            if len(jobs) > 1:
                self.metrics.reruns.inc()
                for job in jobs:
                    self._embed_isolated([job])
            elif jobs:
                logger.exception("Embedding a request failed")
                jobs[0].future.set_exception(error)

    def _embed(self, jobs: list[Job]) -> None:
        """Pack all sequences sharing a prompt by the token budget; the futures are set only once all succeeded."""
        sequences: dict[str | None, list[tuple[Job, int, list[int]]]] = {}
        results: dict[int, list] = {id(job): [None] * len(job.token_ids) for job in jobs}
        for job in jobs:
            sequences.setdefault(job.prompt, []).extend((job, i, seq) for i, seq in enumerate(job.token_ids))
        for prompt, items in sequences.items():
            all_ids = [seq for _, _, seq in items]
            schedule = self.embedder.schedule(prompt, self.max_batch_size, self.max_tokens_per_batch)
            start = time.perf_counter()
            with torch.inference_mode():
                for picked, out in schedule.run(all_ids):
                    embeddings = out["sentence_embedding"].float().cpu()
                    self.metrics.compute.observe(time.perf_counter() - start)
                    self.metrics.batch_tokens.observe(sum(len(all_ids[i]) for i in picked))
                    self.metrics.batch_texts.observe(len(picked))
                    for i, row in zip(picked, embeddings, strict=True):
                        job, index, seq = items[i]
                        results[id(job)][index] = (row, len(seq))
                    start = time.perf_counter()
            self.max_tokens_per_batch = schedule.max_tokens  # a budget learned from running out of memory stays
        for job in jobs:
            job.future.set_result(results[id(job)])
