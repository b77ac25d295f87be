"""`st-fastbackend serve`: check the port, load the model, say what is served and where, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from st_fastbackend.cli.files import CliError
from st_fastbackend.cli.options import EMBEDDING_KINDS, describe, load_model, positive
from st_fastbackend.cli.rerank import load_cross_encoder, serves_rerank
from st_fastbackend.serve.limits import ConnectionLimits, Limits

logger = logging.getLogger("st_fastbackend.serve")


def add_serve(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send; default: the model folder's name, or the Hub id")  # fmt: skip
    serve.add_argument("--max-tokens-per-batch", "--max-batch-tokens", type=positive, default=None,
                       help="tokens per packed batch; default: the model's, by device")  # fmt: skip
    serve.add_argument("--max-batch-size", type=int, default=256, help="inputs per request and per batch")
    serve.add_argument("--max-input-tokens", type=int, default=None, help="default: the model's max_seq_length")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on all but /health")
    serve.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    serve.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes, help="413 past this")
    serve.add_argument("--max-request-chars", type=int, default=Limits.max_request_chars,
                       help="characters of all inputs of one request together; 413 past this")  # fmt: skip
    serve.add_argument("--max-request-tokens", type=positive, default=None,
                       help="tokens of model work one request may hold (its inputs, chunks, late-chunking windows or "
                            "rerank pairs together); 413 past this. Default on a CPU: 32 full-length inputs (32, or "
                            "--max-batch-size if fewer, x --max-input-tokens; TEI's default client batch, seconds of "
                            "model work); on a GPU: --max-batch-size x --max-input-tokens")  # fmt: skip
    serve.add_argument("--body-timeout", type=float, default=Limits.body_timeout,
                       help="seconds for a request body to arrive; 408 past this")  # fmt: skip
    serve.add_argument("--max-pack-seconds", type=float, default=0.25,
                       help="model time a pack aims at (fewer tokens where the rate measured says so): what a "
                            "request arriving mid-pack waits")  # fmt: skip
    serve.add_argument("--no-dynamic-batching", action="store_true", help="one request at a time")
    add_connection_limits(serve)
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="for the server's and the library's log lines")  # fmt: skip
    serve.add_argument("--no-access-log", action="store_true", help="no line per request")
    serve.add_argument("--task", default="auto", choices=["auto", "embed", "rerank"],
                       help="rerank: /v1/rerank and /rerank with a cross-encoder; auto: as sentence-transformers "
                            "tells a cross-encoder folder")  # fmt: skip


def add_connection_limits(serve: argparse.ArgumentParser) -> None:
    defaults = ConnectionLimits()
    serve.add_argument("--max-connections", type=positive, default=defaults.max_connections,
                       help="open at once; over it the one waiting longest for a request is closed, or the new "
                            "one refused (503) when all are in a request")  # fmt: skip
    serve.add_argument("--max-header-bytes", type=positive, default=defaults.max_header_bytes,
                       help="request line and headers; 431 past this")  # fmt: skip
    serve.add_argument("--max-headers", type=positive, default=defaults.max_headers,
                       help="header fields per request; 431 past this")  # fmt: skip
    serve.add_argument("--header-timeout", type=float, default=defaults.header_timeout,
                       help="seconds from a request's first byte to the end of its headers; 408 past")  # fmt: skip
    serve.add_argument("--keep-alive-timeout", type=float, default=defaults.keep_alive_timeout,
                       help="seconds a connection may wait for its first or next request")  # fmt: skip


def serve(args: argparse.Namespace) -> None:
    check_port(args.host, args.port)  # before the model loads, which may take minutes
    from st_fastbackend.serve.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)-9s %(name)s: %(message)s")
    model = off_the_main_thread(
        lambda: load_cross_encoder(args) if serves_rerank(args) else load_model(args, kinds=EMBEDDING_KINDS)
    )
    max_input_tokens = args.max_input_tokens or model.max_seq_length
    if max_input_tokens > model.max_seq_length:
        raise CliError(f"--max-input-tokens {max_input_tokens} exceeds max_seq_length {model.max_seq_length}")
    name = args.served_model_name or served_name(args.model)
    budget = args.max_tokens_per_batch or model.max_tokens_per_batch
    app = create_app(
        model,
        served_model_name=name,
        max_tokens_per_batch=budget,
        max_batch_size=args.max_batch_size,
        max_input_tokens=max_input_tokens,
        api_key=args.api_key,
        dynamic_batching=not args.no_dynamic_batching,
        limits=Limits(args.max_body_bytes, args.max_request_chars, args.body_timeout, args.max_request_tokens),
        public_metrics=args.public_metrics,
        pack_seconds=args.max_pack_seconds,
    )
    logger.info(
        f"Serving {name!r} ({args.model}): {served_shape(model)}, {describe(model)}, "
        f"{budget} tokens per batch, {max_input_tokens} tokens per input, at http://{args.host}:{args.port}"
    )
    run_server(app, args)


def off_the_main_thread(load: Callable[[], Any]) -> Any:
    """load() on a thread of its own that ends with it, so that the model's operators run on one thread only, the
    worker's. PyTorch's OpenMP on Linux (libgomp) gives every thread that runs a parallel operator a pool of
    threads for its life, and once the pools hold more threads than there are CPUs, a pool's threads sleep between
    operators instead of waiting awake: a model loaded on the main thread made every operator of the worker's wait
    for a thread to wake (about twice a one-text call's time: eval/RESULTS.md, "2026-12-02 05:53 — short calls")."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="load") as thread:
        return thread.submit(load).result()  # leaving the block ends the thread, and its pool with it


def served_shape(model) -> str:
    labels = getattr(model, "num_labels", None)  # a CrossEncoder's
    return f"{labels} label(s) per pair" if labels is not None else f"dimension {model.get_embedding_dimension()}"


def run_server(app, args: argparse.Namespace) -> None:
    """uvicorn.run, plus: after a device failure the server stops and the process exits with status 1, for
    a supervisor to restart it (the CUDA context of this process is unusable)."""
    import uvicorn

    from st_fastbackend.serve.connections import Connections, fit_open_files, guarded_protocol

    # uvicorn handles SIGTERM: stop accepting, let in-flight requests finish, run the app's shutdown. Then it
    # re-raises the signal under the handler that was there before; a no-op one makes the exit status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    cap, fitted = fit_open_files(args.max_connections)
    (logger.warning if cap < args.max_connections else logger.info)(fitted)
    limits = ConnectionLimits(cap, args.max_header_bytes, args.max_headers, args.header_timeout,
                              args.keep_alive_timeout)  # fmt: skip
    connections = Connections(limits, app.state.metrics, app.state.fail.shape_for)
    # uvicorn's own keep-alive timer restarts on any byte; the guard's fires first, uvicorn's is a backstop.
    # limit_concurrency: a 503 once that many requests are in flight, counting those whose client has left
    # (the guard keeps connections at `cap`, below it).
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=not args.no_access_log, http=guarded_protocol(connections),
                            timeout_keep_alive=limits.keep_alive_timeout + 1,
                            limit_concurrency=cap + 1)  # fmt: skip
    server = uvicorn.Server(config)
    app.state.batcher.on_failure = lambda failure: setattr(server, "should_exit", True)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn.run's status for a start-up that failed (the warm-up request, say)
    if (failure := app.state.batcher.failure) is not None:
        logger.error(f"Exiting with status 1, for a supervisor to restart the server: {failure}")
        sys.exit(1)


def check_port(host: str, port: int) -> None:
    """Bind host:port and let go, so a port in use is said in one line before the model loads. The port stays
    free until uvicorn binds it, unless another process takes it in between (then uvicorn says so)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()  # SO_REUSEADDR, as uvicorn binds
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise CliError(f"cannot listen on {host}:{port}: {reason}") from None


def served_name(model: str) -> str:
    """The id clients send: a local folder's name, or the Hub id as given."""
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model
