"""The server's Prometheus metrics, one registry per app, served at /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("embedding_requests_total", "Requests by endpoint", ["endpoint"], registry=registry)
        self.errors = Counter("embedding_errors_total", "Error responses by type", ["type"], registry=registry)
        self.queue_wait = Histogram(
            "embedding_queue_wait_seconds", "Time a request waits for the worker", buckets=SECONDS, registry=registry
        )
        self.compute = Histogram(
            "embedding_compute_seconds", "Forward time per packed batch", buckets=SECONDS, registry=registry
        )
        self.batch_tokens = Histogram(
            "embedding_batch_tokens", "Tokens per packed batch", buckets=(16, 64, 256, 1024, 4096, 16384, 65536),
            registry=registry,
        )  # fmt: skip
        self.batch_texts = Histogram(
            "embedding_batch_texts", "Texts per packed batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
            registry=registry,
        )  # fmt: skip
        self.dropped = Counter(
            "embedding_dropped_requests_total", "Requests whose client left before the model finished them",
            registry=registry,
        )  # fmt: skip
        self.reruns = Counter(
            "embedding_batch_reruns_total", "Failed batches run again job by job to isolate the failure",
            registry=registry,
        )  # fmt: skip
        self.connections = Gauge("embedding_open_connections", "Client connections open", registry=registry)
        self.closed = Counter(
            "embedding_connections_closed_total", "Connections the server closed or refused, by reason", ["reason"],
            registry=registry,
        )  # fmt: skip

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
