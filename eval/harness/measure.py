"""Measuring side by side: alternating timed rounds (plain, fast, plain, fast, ...), peak memory, a GEMM
ceiling and a model's FLOPs."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


@dataclass
class Rounds:
    """The seconds of each system's timed calls, and what its last call returned."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    last: dict = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def ratio(self, name: str, base: str = "plain") -> float:
        """How many times faster `name` is than `base`, median against median."""
        return self.median(base) / self.median(name)


@contextlib.contextmanager
def contention(threads: int) -> Iterator[None]:
    """`threads` processes spinning on the CPU beside everything run inside (the same for every system, peers too):
    a busy host, as a server in a container with neighbours has one. Ended, whatever happens, on leaving."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(threads)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


def alternate(calls: dict[str, Callable[[], object]], rounds: int, device: str = "cpu", block: int = 1) -> Rounds:
    """`rounds` rounds, each calling every system in turn, so that a machine's slower minutes fall on all of them
    alike rather than on whichever ran then. `block` > 1: each turn is `block` timed calls in a row after an untimed
    one (which finds the caches holding the other systems' weights): a system called again and again, warm."""
    out = Rounds({name: [] for name in calls})
    for _ in range(rounds):
        for name, call in calls.items():
            if block > 1:
                call()
            for _ in range(block):
                sync(device)
                start = time.perf_counter()
                out.last[name] = call()
                sync(device)
                out.seconds[name].append(time.perf_counter() - start)
    return out


def encode_rounds(
    systems: dict, texts: list[str], batch_size: int, rounds: int, device: str, prompt: str | None = None,
    method: str = "encode", block: int = 1,
) -> dict[str, dict]:  # fmt: skip
    """Each system's embeddings (as arrays() makes them) and peak extra memory from an untimed call (after a
    warm-up call on one batch), then alternating timed rounds of its `method` (encode, or a MultiVectorEncoder's
    encode_document ...), `block` calls per turn (alternate()): {name: {"embeddings", "peak_extra_bytes", "times"}}."""
    results: dict[str, dict] = {}
    for name, model in systems.items():
        encode = getattr(model, method)
        encode(texts[:batch_size], batch_size=batch_size, prompt=prompt)
        with PeakMemory(device) as memory:
            embeddings = encode(texts, batch_size=batch_size, prompt=prompt)
        results[name] = {"embeddings": arrays(embeddings), "peak_extra_bytes": memory.extra}
    calls = {
        name: (lambda m=model: getattr(m, method)(texts, batch_size=batch_size, prompt=prompt))
        for name, model in systems.items()
    }
    for name, seconds in alternate(calls, rounds, device, block).seconds.items():
        results[name]["times"] = seconds
    return results


def arrays(output):
    """What an encode method returned, as float32 numpy: an array as it is (a SentenceTransformer's [N, dim]), a
    tensor as an array (a SparseEncoder's sparse [N, vocab]: its dense view), a list (a MultiVectorEncoder's
    [len_i, dim] per text) item by item."""
    import numpy as np

    if isinstance(output, list):
        return [arrays(item) for item in output]
    if hasattr(output, "to_dense"):  # a torch tensor, sparse or strided
        output = output.to_dense().float().cpu().numpy()
    return np.asarray(output, dtype=np.float32)


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set size (this one's by default)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's highest resident set size so far (the kernel's VmHWM): what the machine had to hold."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rss_mib(pid: int | str = "self") -> float:
    return rss_bytes(pid) / 2**20


class PeakMemory:
    """Peak resident memory above the level at start, sampled every millisecond (CUDA: the allocator's peak)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            import torch

            self.extra = torch.cuda.max_memory_allocated() - self.base
            return
        self._stop.set()
        self._thread.join()
        self.extra = max(self.peak, rss_bytes()) - self.base


def gemm_ceiling(dtype, device: str, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one large matrix product, the best of a few runs; on a CPU the better of PyTorch's
    default product and oneDNN's on a prepacked weight (what the fast backend uses)."""
    import torch

    from st_fastbackend.engine.onednn import onednn_dtypes

    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    products = [lambda: a @ b]
    if device == "cpu" and dtype in onednn_dtypes():  # oneDNN refuses bf16 on CPUs without native bf16
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()
        best = min(best, *alternate({"product": product}, repeats, device).seconds["product"])
    return 2 * n**3 / best / 1e9


def flops(model, token_ids: list[list[int]]) -> float:
    """2 x non-embedding parameters per token, plus attention (QK^T and PV; half of it when causal)."""
    from torch import nn

    engine = model[0].model
    embedding = sum(p.numel() for name, p in engine.named_parameters() if "embed" in name)
    # a Linear's shape, not its weight's numel: the weight is given back once oneDNN holds its reordered copy
    linears = [m for m in engine.modules() if isinstance(m, nn.Linear)]
    linear = sum(m.in_features * m.out_features - m.weight.numel() for m in linears)
    params = sum(p.numel() for p in engine.parameters()) + linear - embedding
    spec = engine.spec
    width = spec.num_heads * getattr(spec, "head_dim", spec.hidden_size // spec.num_heads)  # encoders: no head_dim
    causal = 0.5 if getattr(spec, "causal", False) else 1.0  # windows not counted: an upper bound
    attention = sum(4 * len(ids) ** 2 * width * spec.num_layers * causal for ids in token_ids)
    return 2 * params * sum(len(ids) for ids in token_ids) + attention
