"""`st-fastbackend serve` start-up as a user sees it: a port in use is one line before the model loads; once
loaded, a banner says what is served and where, and each request gets an access-log line."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from helpers import DEVICE

from st_fastbackend import SentenceTransformer
from st_fastbackend.engine.runtime import choose_runtime
from st_fastbackend.engine.schedule import MIN_GPU_TOKENS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "st_fastbackend.cli", "serve", model, "--port", str(port), "--device", DEVICE,
            *extra]  # fmt: skip


def test_a_port_in_use_is_one_line_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model that cannot load: had it been loaded first, the error would be about the model.
        result = subprocess.run(serve_command("./no/such/model", port), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"st-fastbackend: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


@pytest.mark.slow
def test_banner_access_log_and_default_model_name(st_model, tmp_path):
    folder = st_model("bert", pooling_mode="mean")
    # The default budget as the code computes it, here, before the server holds any of the device's memory.
    budget = SentenceTransformer(str(folder), backend="fast", device=DEVICE).max_tokens_per_batch
    port, log = free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        process = subprocess.Popen(serve_command(str(folder), port), stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    try:
        wait_healthy(process, url)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        response = httpx.post(f"{url}/v1/embeddings", json={"input": "one text", "model": folder.name})
        assert [m["id"] for m in models] == [folder.name] and response.status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    text = log.read_text()
    banner = next(line for line in text.splitlines() if "Serving" in line)
    assert f"Serving {folder.name!r} ({folder}): dimension 64, weights float32" in banner
    kernel = choose_runtime(DEVICE, torch.float32).kernel  # ours on a CPU with AVX2 or AVX-512, else the SDPA loop
    assert f"attention {kernel}, " in banner and banner.endswith(f"at {url}")
    served = int(banner.split(f"attention {kernel}, ")[1].split(" tokens per batch")[0])
    if DEVICE == "cpu":
        assert served == budget
    else:  # from free memory, in a process that also holds its own weights and context: at most ours
        assert MIN_GPU_TOKENS <= served <= budget
    assert '"POST /v1/embeddings HTTP/1.1" 200' in text
    assert "Traceback" not in text


def wait_healthy(process: subprocess.Popen, url: str) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None, f"server exited with {process.returncode}"
        time.sleep(0.2)
    raise TimeoutError("server did not become healthy")


def test_the_model_loads_off_the_main_thread_which_ends():
    """The main thread runs no parallel operator (its OpenMP pool would make the worker's threads sleep between
    operators), and the thread that loaded the model is gone: its pool with it."""
    import threading

    from st_fastbackend.cli.serve import off_the_main_thread

    loader = off_the_main_thread(threading.current_thread)
    assert loader is not threading.main_thread() and not loader.is_alive()
    with pytest.raises(ZeroDivisionError):  # a failure to load reaches the caller
        off_the_main_thread(lambda: 1 / 0)
