"""Dynamic batching: requests from every client wait in one queue; a single worker thread takes all
that are waiting, tokenizes each on its own (a bad request fails alone), and runs them together in
token-budget packs. A text's embedding does not depend on what it was packed with."""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry, Histogram

from st_fastbackend.engine.batch import plan_batches
from st_fastbackend.model import PackRunner


class InputError(ValueError):
    """The request's own fault (too long, no tokens): answered with 400, the batch goes on."""


@dataclass
class Job:
    texts: list[str] | None  # either texts, tokenized in the worker ...
    token_ids: list[list[int]] | None  # ... or token ids as the client sent them
    prompt: str | None
    truncate: bool
    future: Future = field(default_factory=Future)
    queued_at: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(
        self,
        model,
        max_batch_tokens: int,
        max_batch_size: int,
        max_input_tokens: int,
        registry: CollectorRegistry,
        dynamic: bool = True,
    ):
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.max_input_tokens = max_input_tokens
        self.dynamic = dynamic  # False: one request per forward (the baseline the benchmark compares with)
        self._pending: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="embedding-worker", daemon=True)
        seconds = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        self.queue_wait = Histogram(
            "embedding_queue_wait_seconds", "Time a request waits for the worker", buckets=seconds, registry=registry
        )
        self.compute = Histogram(
            "embedding_compute_seconds", "Forward time per packed batch", buckets=seconds, registry=registry
        )
        self.batch_tokens = Histogram(
            "embedding_batch_tokens",
            "Tokens per packed batch",
            buckets=(16, 64, 256, 1024, 4096, 16384, 65536),
            registry=registry,
        )
        self.batch_texts = Histogram(
            "embedding_batch_texts",
            "Texts per packed batch",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
            registry=registry,
        )

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> Future:
        with self._wake:
            if self._stopping:
                raise RuntimeError("The server is shutting down.")
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
                jobs = list(self._pending) if self.dynamic else [self._pending[0]]
                for _ in jobs:
                    self._pending.popleft()
            now = time.perf_counter()
            for job in jobs:
                self.queue_wait.observe(now - job.queued_at)
            try:
                self._embed(jobs)
            except Exception as error:  # the worker must outlive any failure
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(error)

    def _embed(self, jobs: list[Job]) -> None:
        """Tokenize each job alone, then pack all sequences sharing a prompt by the token budget."""
        sequences: dict[str | None, list[tuple[Job, int, list[int]]]] = {}
        results: dict[int, list] = {}
        for job in jobs:
            try:
                ids = self._token_ids(job)
            except InputError as error:
                job.future.set_exception(error)
                continue
            results[id(job)] = [None] * len(ids)
            sequences.setdefault(job.prompt, []).extend((job, i, seq) for i, seq in enumerate(ids))
        for prompt, items in sequences.items():
            items.sort(key=lambda item: -len(item[2]))
            all_ids = [seq for _, _, seq in items]
            runner = PackRunner(self.model, prompt, self.model.device, self.max_batch_tokens)
            for batch in plan_batches([len(seq) for seq in all_ids], self.max_batch_size, self.max_batch_tokens):
                start = time.perf_counter()
                with torch.inference_mode():
                    for picked, out in runner(all_ids, list(batch)):  # split in two on out-of-memory
                        embeddings = out["sentence_embedding"].float().cpu()
                        self.compute.observe(time.perf_counter() - start)
                        self.batch_tokens.observe(sum(len(all_ids[i]) for i in picked))
                        self.batch_texts.observe(len(picked))
                        for i, row in zip(picked, embeddings, strict=True):
                            job, index, seq = items[i]
                            results[id(job)][index] = (row, len(seq))
                        start = time.perf_counter()
        for job in jobs:
            if not job.future.done():
                job.future.set_result(results[id(job)])

    def _token_ids(self, job: Job) -> list[list[int]]:
        limit = self.max_input_tokens
        # Token ids come as sent (the endpoint refused empty lists); texts are tokenized one token past
        # the limit, which tells "too long" apart from "exactly at the limit".
        ids = job.token_ids if job.token_ids is not None else self._tokenize(job, job.texts, limit + 1)
        vocab_size = self.model[0].config.vocab_size
        for index, seq in enumerate(ids):
            if job.token_ids is not None and not all(0 <= t < vocab_size for t in seq):
                raise InputError(f"Input {index} has token ids outside the vocabulary (0 to {vocab_size - 1}).")
            if len(seq) > limit:
                if not job.truncate:
                    raise InputError(f"Input {index} has more than {limit} tokens and truncate is false.")
                cut = seq[:limit] if job.token_ids is not None else self._tokenize(job, [job.texts[index]], limit)[0]
                ids = ids[:index] + [cut] + ids[index + 1 :]
        return ids

    def _tokenize(self, job: Job, texts: list[str], limit: int) -> list[list[int]]:
        """PackedTransformer's tokenization (prompt, special tokens, no-token check) at a length limit."""
        try:
            return self.model[0].tokenize_texts(texts, job.prompt, max_length=limit)
        except ValueError as error:
            raise InputError(str(error)) from error
