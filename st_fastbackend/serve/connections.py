"""What a client may hold before it has sent a request, enforced on each connection as uvicorn's httptools
protocol parses it (read in uvicorn 0.54 and httptools 0.9: neither bounds the request line or headers,
httptools joins a header's pieces with `+=`, and uvicorn's keep-alive timer starts only after a first
response and restarts on any byte, so a connection that never sends a request, or sends "\\r\\n" every few
seconds, is never closed):

- the request line and headers: at most `max_header_bytes` (counted as they arrive, so no more is buffered)
  and `max_headers` fields, else 431;
- `keep_alive_timeout` seconds to begin a request, from the connection's opening or the last response, then
  closed; `header_timeout` seconds from a request's first byte to the end of its headers, else 408 (neither
  restarted by further bytes);
- at most `max_connections` open: over it, the connection waiting longest for a request (idle, or still
  sending headers) is closed to let the new one in; with every connection inside a request, the new one is
  refused with 503. So idle or slow clients cannot starve a normal request of the listening socket.

Each closing is counted in /metrics (`embedding_connections_closed_total`) and logged, at most one line per
10 s with the counts since the last.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from st_fastbackend.serve.errors import ApiError, Shape, openai_shape
from st_fastbackend.serve.limits import ConnectionLimits
from st_fastbackend.serve.metrics import Metrics

logger = logging.getLogger("st_fastbackend.serve")
LOG_EVERY = 10.0  # seconds between log lines about connections closed
SPARE_FILES = 64  # besides those open at start and one per connection: the listening socket, logs, later opens


def fit_open_files(max_connections: int) -> tuple[int, str]:
    """(the connection cap, a line saying how it fits the open-file limit). The soft limit is raised to what
    the cap needs where the hard limit allows; else the cap is lowered to what the hard limit leaves. Past
    the limit, accept() fails and asyncio stops accepting for a while: every new client, normal ones too,
    would be turned away with nothing in the log."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else SPARE_FILES
    need = max_connections + in_use + SPARE_FILES
    if need <= soft:
        return max_connections, f"open-file limit {soft}: room for {max_connections} connections"
    if hard == resource.RLIM_INFINITY or need <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        return max_connections, f"open-file limit raised from {soft} to {need} for {max_connections} connections"
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    fits = hard - in_use - SPARE_FILES
    if fits < 1:
        raise OSError(f"the open-file limit ({hard}) leaves no room for connections: {in_use} files are open")
    raised = f"; the soft limit raised from {soft} to it" if soft < hard else ""
    return fits, (f"--max-connections lowered from {max_connections} to {fits}: the open-file limit is {hard} "
                  f"(hard{raised}), {in_use} files are open and {SPARE_FILES} kept spare")  # fmt: skip


def error_response(error: ApiError, shape: Shape) -> bytes:
    """A whole HTTP response with the error in `shape` (the dialect of the path asked), closing the connection."""
    status, body = shape(error)
    content = orjson.dumps(body)
    head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(content)
    return STATUS_LINE[status] + head + content


class Connections:
    """The open connections, and those waiting for a request in the order they began to wait."""

    def __init__(self, limits: ConnectionLimits, metrics: Metrics, shape_for=lambda path: openai_shape) -> None:
        self.limits, self.metrics = limits, metrics
        self.shape_for: Callable[[str], Shape] = shape_for  # a path's error shape (serve/errors.py ErrorResponses)
        self.open: set[GuardedProtocol] = set()
        self.waiting: OrderedDict[GuardedProtocol, None] = OrderedDict()
        self._unlogged: Counter[str] = Counter()
        self._logged_at = float("-inf")

    def admit(self, connection: GuardedProtocol) -> bool:
        """Whether the new connection may stay; over the cap, the one waiting longest goes instead."""
        self.open.add(connection)
        if len(self.open) > self.limits.max_connections:
            victim = next((c for c in self.waiting if c.between_requests()), None)
            if victim is None:
                connection.close(503, "The server is at its connection limit and every connection is in a request.",
                                 "connection_limit", "refused")  # fmt: skip
                return False
            # idle: closed as a keep-alive connection times out; half a request: told why
            status = 503 if victim.began_a_request() else None
            victim.close(status, "The server is at its connection limit; this connection had waited longest without"
                                 " sending a complete request.", "connection_limit", "evicted")  # fmt: skip
        self.waiting[connection] = None
        self.metrics.connections.set(len(self.open))
        return True

    def busy(self, connection: GuardedProtocol) -> None:
        self.waiting.pop(connection, None)

    def wait(self, connection: GuardedProtocol) -> None:
        if connection in self.open:
            self.waiting[connection] = None
            self.waiting.move_to_end(connection)

    def leave(self, connection: GuardedProtocol) -> None:
        self.open.discard(connection)
        self.waiting.pop(connection, None)
        self.metrics.connections.set(len(self.open))

    def closed(self, reason: str) -> None:
        """Counted at once; logged with the others since the last line, at most every LOG_EVERY seconds."""
        self.metrics.closed.labels(reason=reason).inc()
        self._unlogged[reason] += 1
        if (now := time.monotonic()) - self._logged_at >= LOG_EVERY:
            counts = ", ".join(f"{n} {why}" for why, n in sorted(self._unlogged.items()))
            logger.warning(f"Connections closed by the server's limits ({self._describe()}): {counts}")
            self._unlogged.clear()
            self._logged_at = now

    def _describe(self) -> str:
        limits = self.limits
        return (f"{limits.max_connections} connections, {limits.max_header_bytes} header bytes, "
                f"{limits.max_headers} headers, {limits.header_timeout:g} s for headers, "
                f"{limits.keep_alive_timeout:g} s idle")  # fmt: skip


def guarded_protocol(connections: Connections) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol under `connections`' limits, for uvicorn.Config(http=...)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"guard": connections})


class GuardedProtocol(HttpToolsProtocol):
    guard: Connections  # set by guarded_protocol (uvicorn takes self.connections: its set of them)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.limits = self.guard.limits
        self._timer = None
        self._in_request = False  # headers accepted, response not yet complete
        self._closed_by_us = False
        self._start_head()
        if self.guard.admit(self):
            self._arm(self.limits.keep_alive_timeout, self._idle_too_long)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.guard.leave(self)
        super().connection_lost(exc)

    def between_requests(self) -> bool:
        return not self._in_request and not self.transport.is_closing()

    def began_a_request(self) -> bool:
        return bool(self._head_bytes)

    def close(self, status: int | None, message: str, code: str, reason: str) -> None:
        """Close, with an error response unless `status` is None, counted under `reason`. Never called with a
        request in progress: its response is the app's."""
        if status is not None:
            path = self._url.partition(b"?")[0].decode("latin-1")  # as far as it has arrived
            self.transport.write(error_response(ApiError(status, message, code=code), self.guard.shape_for(path)))
        self._closed_by_us = True
        self._disarm()
        # Out of the counts now, not at connection_lost (a later loop turn): uvicorn's limit_concurrency counts
        # its set of connections, and a burst of new ones would otherwise count the ones closed for them.
        self.connections.discard(self)
        self.guard.leave(self)
        self.guard.closed(reason)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        """Bytes of a request head go to the parser only up to max_header_bytes, so no more is buffered."""
        while data and not self._closed_by_us:
            if self._head_bytes is None:  # in a body, or waiting for the response
                return super().data_received(data)
            room = self.limits.max_header_bytes - self._head_bytes
            if room <= 0:
                return self._head_too_large()
            head, data = data[:room], data[room:]
            self._head_bytes += len(head)
            super().data_received(head)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.limits.header_timeout, self._headers_too_slow)

    def on_url(self, url: bytes) -> None:
        self._parsed += len(url)
        self._url += url  # within max_header_bytes: the parser gets no more
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._parsed += len(name) + len(value)
        self._fields += 1
        if self._fields <= self.limits.max_headers:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._closed_by_us:
            return
        if self._fields > self.limits.max_headers:
            message = f"The request has {self._fields} header fields; the limit is {self.limits.max_headers}."
            return self.close(431, message, "too_many_headers", "too_many_headers")
        if self._parsed > self.limits.max_header_bytes:
            return self._head_too_large()
        self._disarm()
        self._in_request, self._head_bytes = True, None
        self.guard.busy(self)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._closed_by_us:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._closed_by_us:
            super().on_message_complete()
            self._start_head()  # a next request on this connection is counted from here

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._in_request = False
            self.guard.wait(self)
            if self.began_a_request():  # pipelined, its headers not all here: from now on they are timed
                self._arm(self.limits.header_timeout, self._headers_too_slow)
            else:
                self._arm(self.limits.keep_alive_timeout, self._idle_too_long)

    def _start_head(self) -> None:
        self._head_bytes, self._parsed, self._fields, self._url = 0, 0, 0, b""

    def _head_too_large(self) -> None:
        message = f"The request line and headers are over {self.limits.max_header_bytes} bytes."
        self.close(431, message, "header_too_large", "header_too_large")

    def _headers_too_slow(self) -> None:
        self._timer = None
        if self._in_request:  # a pipelined request's headers: timed again once the response before it is sent
            return
        message = f"The request headers did not arrive within {self.limits.header_timeout:g} s."
        self.close(408, message, "header_timeout", "header_timeout")

    def _idle_too_long(self) -> None:
        self._timer = None
        self.close(None, "", "", "idle_timeout")

    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
