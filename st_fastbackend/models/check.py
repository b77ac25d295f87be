"""`model.check()` and `st-fastbackend check`: the fast backend against plain sentence-transformers on the user's
model, case by case (models/probes.py), with the contract it holds to, what ran, and the speed ratio.

Plain sentence-transformers is loaded beside the model, from the same arguments, on its device and in its
dtype, one model at a time (each freed before the next): the one timed, plain fp32 as the reference where the
fast model is not fp32, and plain in the low dtype for its own error there.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from st_fastbackend.models.probes import Case, Probing, probing_for

# The contract, in one place (DESIGN.md "Correctness contract"):
EXACT = 1e-5  # fp32: max |fast - plain| on unit-norm embeddings, or on predict()'s scores
# bf16/fp16 (the model's dtype, or an fp32 model's products): the error against plain fp32 at most this many times
# plain sentence-transformers' own in that dtype (DESIGN.md's ~3x; tests/engine/test_bf16.py asserts 2x over 40 texts).
LOW_PRECISION_FACTOR = 3.0
# int8 products: 1 - cosine against plain fp32 (tests/engine/test_int8.py; docs/cpu.md: 1.8e-2 the worst STS-B text).
INT8_ONE_MINUS_COS = 2e-2


@dataclass(frozen=True)
class CaseResult:
    name: str
    inputs: int
    max_diff: float  # against the reference (plain, fp32)
    one_minus_cos: float | None  # worst over the case; None for scores
    measured: float  # the figure the bound is on
    bound: float | None  # None: no bound known (int8 scores)
    worst: int  # the input with the largest error, counted from 0 in the case

    @property
    def passed(self) -> bool:
        return self.bound is None or self.measured <= self.bound


@dataclass(frozen=True)
class CheckReport:
    model: str
    model_class: str
    contract: str  # what the bound is on, in words
    ran: str  # kernel, dtype, products, seams, quantize
    cases: list[CaseResult]
    plain_seconds: float
    fast_seconds: float
    exact: bool  # fp32: the contract is exactness; else a low-precision or int8 bound

    @property
    def passed(self) -> bool:
        return all(case.passed for case in self.cases)

    @property
    def failed(self) -> list[str]:
        return [case.name for case in self.cases if not case.passed]

    @property
    def speedup(self) -> float:
        return self.plain_seconds / max(self.fast_seconds, 1e-9)

    def verdict(self) -> str:
        if not self.passed:
            word = "NOT EXACT" if self.exact else "OUT OF BOUND"
            return f"{word}: {len(self.failed)} of {len(self.cases)} cases fail the contract: {', '.join(self.failed)}"
        if self.exact:
            return f"EXACT: every case within {EXACT:g} of plain sentence-transformers"
        if any(case.bound is None for case in self.cases):
            return "NO BOUND KNOWN (not exact, by design): the figures only"
        return "WITHIN BOUND (not exact, by design): every case within its low-precision bound"

    def __str__(self) -> str:
        inputs = sum(case.inputs for case in self.cases)
        lines = [
            self.verdict(),
            f"model: {self.model} ({self.model_class})",
            f"contract: {self.contract}",
            f"ran: {self.ran}",
            f"speed: fast {self.speedup:.2f}x plain ({self.fast_seconds:.3f} s against {self.plain_seconds:.3f} s "
            f"on {inputs} inputs, one pass each after a warm-up call; {machine_load()})",
            "",
            f"{'case':<22} {'inputs':>6} {'max|diff|':>10} {'1-cos':>10} {'bound':>10}  result",
        ]
        for case in self.cases:
            cosine = "-" if case.one_minus_cos is None else f"{case.one_minus_cos:.2e}"
            bound = "none" if case.bound is None else f"{case.bound:.2e}"
            result = "ok" if case.passed else f"FAIL (input {case.worst})"
            lines.append(f"{case.name:<22} {case.inputs:>6} {case.max_diff:>10.2e} {cosine:>10} {bound:>10}  {result}")
        return "\n".join(lines)


def check(model, texts: list[str] | None = None) -> CheckReport:
    """`model` (backend="fast") against plain sentence-transformers loaded from the same arguments, on the probes
    of its class (models/probes.py) or on `texts`."""
    if getattr(model, "backend", None) != "fast" or not hasattr(model, "loaded_with"):
        raise ValueError('check() compares a model loaded with backend="fast" against plain sentence-transformers; '
                         "this one is not")  # fmt: skip
    args, kwargs = model.loaded_with
    name = args[0] if args else kwargs.get("model_name_or_path")
    if not name:
        raise ValueError("check() needs a model loaded from a folder or Hub id, to load plain from the same")
    probing = probing_for(model)
    cases = probing.cases(model, texts)
    fast, fast_seconds = _timed(probing, model, cases)
    transformer = getattr(model, "packed_input", model[0])  # the packed engine's module (a Router picks one)
    dtype = next(transformer.parameters()).dtype
    low = transformer.product_dtype if transformer.product_dtype in (torch.float16, torch.bfloat16) else None
    plain, plain_seconds = _with_plain(model, probing, cases, dtype, warm_up=True)
    reference = plain if dtype == torch.float32 else _with_plain(model, probing, cases, torch.float32)[0]
    own = None
    if low is not None:
        own = plain if low == dtype else _with_plain(model, probing, cases, low)[0]
    results = [_compare(probing, c, f, r, o, transformer.quantize) for c, f, r, o in
               zip(cases, fast, reference, own or [None] * len(cases), strict=True)]  # fmt: skip
    exact = low is None and not transformer.quantize
    return CheckReport(
        model=str(name), model_class=type(model).__name__,
        contract=_contract(probing, low, transformer.quantize), ran=_ran(transformer), cases=results,
        plain_seconds=plain_seconds, fast_seconds=fast_seconds, exact=exact,
    )  # fmt: skip


def _compare(probing: Probing, case: Case, fast, reference, own, quantize: str | None) -> CaseResult:
    diff, cosine = probing.errors(fast, reference)
    measured, bound = diff, EXACT
    if quantize:
        measured, bound = (cosine, INT8_ONE_MINUS_COS) if probing.vectors else (diff, None)
    elif own is not None:
        own_diff, own_cosine = probing.errors(own, reference)
        measured, bound = (cosine, own_cosine) if probing.vectors else (diff, own_diff)
        bound = LOW_PRECISION_FACTOR * bound.max()
    worst = int(np.argmax(measured))
    return CaseResult(
        name=case.name, inputs=len(case.inputs), max_diff=float(diff.max()),
        one_minus_cos=None if cosine is None else float(cosine.max()), measured=float(measured.max()),
        bound=bound, worst=worst,
    )  # fmt: skip


def _timed(probing: Probing, model, cases: list[Case], warm_up: bool = True) -> tuple[list, float]:
    """Every case's outputs, and the seconds of one pass over all of them; after a warm-up on the first case (the
    one-time costs of a first call; a pass over every case would double the time of a check)."""
    if warm_up:
        probing.outputs(model, cases[0])
    start = time.perf_counter()
    outputs = [probing.outputs(model, case) for case in cases]
    return outputs, time.perf_counter() - start


def _with_plain(model, probing: Probing, cases, dtype, warm_up=False) -> tuple[list, float]:
    """Plain sentence-transformers' outputs in `dtype` (fp32 products exact); freed before the next is loaded."""
    args, kwargs = model.loaded_with
    model_kwargs = {k: v for k, v in (kwargs.get("model_kwargs") or {}).items()
                    if k not in ("quantize", "device_map", "torch_dtype")}  # fmt: skip
    with _exact_fp32():
        plain_class = getattr(model, "plain_class", type(model))  # the class a backend="torch" model loads as
        plain = plain_class(*args, **{**kwargs, "backend": "torch", "device": str(model.device),
                                      "model_kwargs": {**model_kwargs, "dtype": dtype}})  # fmt: skip
        probing.copy_settings(model, plain)
        found = _timed(probing, plain, cases, warm_up)
    del plain
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return found


@contextlib.contextmanager
def _exact_fp32():
    """fp32 products in fp32, whatever the user set for the fast model. PyTorch's per-backend settings, not
    set_float32_matmul_precision: mixing the two makes get_float32_matmul_precision() raise."""
    backends = (torch.backends.mkldnn.matmul, torch.backends.cuda.matmul)
    before = [backend.fp32_precision for backend in backends]
    for backend in backends:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        for backend, precision in zip(backends, before, strict=True):
            backend.fp32_precision = precision


def _contract(probing: Probing, low: torch.dtype | None, quantize: str | None) -> str:
    if quantize:
        if not probing.vectors:
            return f"{quantize} products: no bound known for {probing.output}; the figures only"
        return f"{quantize} products: 1 - cos against plain fp32 <= {INT8_ONE_MINUS_COS:g} on {probing.output}"
    if low is not None:
        figure = "1 - cos" if probing.vectors else "max |diff|"
        name = str(low).removeprefix("torch.")
        return (f"{name}: {figure} against plain fp32 <= {LOW_PRECISION_FACTOR:g}x plain sentence-transformers' own "
                f"in {name}, case by case, on {probing.output}")  # fmt: skip
    return f"fp32: max |fast - plain| <= {EXACT:g} on {probing.output}"


def _ran(transformer) -> str:
    quantize = f"; Linear layers {transformer.quantize}" if transformer.quantize else ""
    device = next(transformer.parameters()).device.type
    setting = (torch.backends.cuda if device == "cuda" else torch.backends.mkldnn).matmul.fp32_precision
    return f"{transformer.runtime}{quantize}; PyTorch's fp32 matmul precision {setting!r} ({device})"


def machine_load() -> str:
    """The load beside a printed speed ratio: on a busy machine the ratio is distorted (issue 47: 0.76x seen so)."""
    if not hasattr(os, "getloadavg"):  # Windows
        return "load unknown"
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    note = f"load {load:.1f} on {cores} cores over the last minute, this run included"
    return note + (": busy, so the ratio is distorted; time it on a quiet machine" if load > cores else "")
