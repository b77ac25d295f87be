"""The elementwise work between two matrix products, one function per seam: the residual add with the
norms around it (fp32 statistics), q/k norm with the rotation, a gated activation. Each runs eagerly, or
compiled by torch.compile into one kernel where the engine's Runtime says `fused` (by default on CUDA only,
ON_BY_DEFAULT); the same code either way, so the eager functions are also the reference for the compiled
ones (tests/engine/test_fused.py).

Compiled once per process for every model of a dtype and device (dynamic shapes; hidden sizes and head
counts are not baked in), and kept in PyTorch's compile cache on disk, so a second process starts faster.
A compiled call costs ~0.1 ms more than the eager ops on a CPU, which only pays above a few hundred
tokens: packs smaller than MIN_TOKENS run eagerly (eval/RESULTS.md).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_fastbackend.engine.runtime import is_device_failure

logger = logging.getLogger(__name__)
MIN_TOKENS = 512  # the smallest pack the compiled seams run for


def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool) -> Tensor:
    """As Hugging Face computes it: statistics in fp32; Llama casts back before the weight multiply,
    Gemma multiplies by (1 + weight) in fp32 and casts after."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def residual_rms(
    h: Tensor, delta: Tensor, out_weight: Tensor | None, weight: Tensor, eps: float, unit_offset: bool
) -> tuple[Tensor, Tensor]:
    """A decoder's seam after attention or the MLP: h + out_norm(delta) (Gemma's norm on the sublayer's
    output; none for Llama), and the next norm of that sum (the next sublayer's input, or the final norm)."""
    if out_weight is not None:
        delta = rms_norm(delta, out_weight, eps, unit_offset)
    h = h + delta
    return h, rms_norm(h, weight, eps, unit_offset)


def residual_layer_norm(
    h: Tensor, delta: Tensor, weight: Tensor, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """A pre-LayerNorm encoder's seam (ModernBERT): h + delta, and the next LayerNorm of it."""
    h = h + delta
    return h, F.layer_norm(h, h.shape[-1:], weight, bias, eps)


def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """A post-LayerNorm encoder's seam (BERT): LayerNorm(x + residual)."""
    return F.layer_norm(x + residual, x.shape[-1:], weight, bias, eps)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos, sin: [T, D]. Hugging Face's rotate_half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def split_rotate(
    qkv: Tensor, cos: Tensor, sin: Tensor, heads: tuple[int, int, int], qk_norm: tuple | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The fused q/k/v product's output [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k and v [T, Hkv, D]: q and k
    normed per head where `qk_norm` = (q weight, k weight, eps, unit_offset) (Qwen3, Gemma 3), then rotated."""
    num_heads, num_kv_heads, head_dim = heads
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim)
    if qk_norm is not None:
        q_weight, k_weight, eps, unit_offset = qk_norm
        q, k = rms_norm(q, q_weight, eps, unit_offset), rms_norm(k, k_weight, eps, unit_offset)
    return rotate(q, cos, sin), rotate(k, cos, sin), v.view(-1, num_kv_heads, head_dim)


def gated(gate_up: Tensor, activation: nn.Module) -> Tensor:
    """activation(gate) * up, the two halves of one product's output (SiLU, GELU-tanh, GeGLU MLPs)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate) * up


SEAMS = (rms_norm, residual_rms, residual_layer_norm, add_layer_norm, split_rotate, gated)
EAGER = SimpleNamespace(**{f.__name__: f for f in SEAMS})


# Where the compiled seams are on unless said otherwise. CPU: off; measured side by side, the matrix products (most of
# the time) ran slower between compiled seams than the seams gained (eval/RESULTS.md, "2026-12-01 — quiet CPU
# tables"). CUDA: on, as issue 15's experiment on an H200 measured them (not yet run from this code on a GPU).
ON_BY_DEFAULT = {"cuda": True}


def on_by_default(device_type: str) -> bool:
    """ST_FASTBACKEND_COMPILE=1 or 0 in the environment turns them on or off for every model (code that cannot set
    model[0].compiled_seams); else ON_BY_DEFAULT for the device."""
    said = os.environ.get("ST_FASTBACKEND_COMPILE", "")
    if said not in ("", "0", "1"):
        raise ValueError(f"ST_FASTBACKEND_COMPILE={said!r}: 1 turns the compiled layer seams on, 0 off")
    return said == "1" if said else ON_BY_DEFAULT.get(device_type, False)


def seams(fused: bool) -> SimpleNamespace:
    """The seam functions, compiled or eager."""
    return _compiled() if fused else EAGER


@functools.cache
def _compiled() -> SimpleNamespace:
    return SimpleNamespace(**{f.__name__: _Timed(f) for f in SEAMS})


# Inductor indexes a kernel with int32 where every buffer it touches has fewer elements, and guards on that
# (torch/_inductor/codegen/simd.py, can_use_32bit_indexing): a pack past it (e5-mistral's gate/up output
# [T, 28672] at ~75k tokens) would compile the seam once more. The seams work row by row (a row: one token), so
# a pack that large runs as several calls, each under it: the same numbers, one compiled variant.
MAX_ELEMENTS = torch.iinfo(torch.int32).max


class _Timed:
    """torch.compile(f) whose calls that compile (the first for each dtype and device) are logged with their
    time. A compilation that fails, at the first call or at any recompilation, leaves the eager function for
    the rest of the process (the same math; fp32 within rounding, bf16/fp16 rounded after each operation where
    the compiled seam rounds once, within their bound); running out of memory or a device error is the caller's
    to see (the schedule's back-off), never a reason to stop compiling."""

    def __init__(self, fn) -> None:
        self.fn = fn
        # Not fullgraph: past PyTorch's limit of recompilations per function (8 dtype, device and
        # argument variants, reached by a test suite, not by a process serving a model), the calls of a new
        # variant run eagerly instead of raising.
        self.compiled = torch.compile(fn, dynamic=True)
        self.seen: set[tuple] = set()
        self.failed = False

    def __call__(self, *args):
        if self.failed:
            return self.fn(*args)
        args = _unparameterized(args)
        rows = _rows_per_call(args)
        if rows is None:
            return self._run(args)
        return _joined([self._run(part) for part in _row_parts(args, rows)])

    def _run(self, args: tuple):
        if self.failed:
            return self.fn(*args)
        key = tuple((a.dtype, a.device.type) for a in args if isinstance(a, Tensor))
        start = time.perf_counter()
        try:
            out = self.compiled(*args)
        except Exception as error:
            if (device_error := _device_error(error)) is not None:
                raise device_error from None
            logger.warning(f"torch.compile failed ({type(error).__name__}: {error}); the layer seams run eagerly.")
            self.failed = True
            return self.fn(*args)
        if key not in self.seen:
            self.seen.add(key)
            seconds = time.perf_counter() - start
            logger.info(f"Compiled {self.fn.__name__} for {key[0][0]} on {key[0][1]} in {seconds:.1f} s")
        return out


def _unparameterized(args: tuple) -> tuple:
    """Dynamo keeps an nn.Parameter's shape static (force_parameter_static_shapes): one compilation per model
    width. A detached view of it is an ordinary tensor, dynamic like the rest; also inside a tuple (q/k norms)."""
    return tuple(
        a.detach() if isinstance(a, nn.Parameter) else _unparameterized(a) if isinstance(a, tuple) else a for a in args
    )


def _device_error(error: BaseException | None) -> BaseException | None:
    """Out of memory or a device error, raised as it is or inside a compiler's error (Inductor wraps what
    fails while it compiles or benchmarks)."""
    while error is not None:
        if isinstance(error, torch.OutOfMemoryError) or is_device_failure(error):
            return error
        error = error.__cause__ or error.__context__
    return None


def _rows_per_call(args: tuple) -> int | None:
    """Rows per call where some activation (an argument of 2 or more dimensions; weights have 1) reaches
    MAX_ELEMENTS; None where one call takes them all."""
    activations = [a for a in args if isinstance(a, Tensor) and a.dim() >= 2]
    widest = max(max(a.stride(0), a[0].numel()) for a in activations)
    rows = activations[0].shape[0]
    return None if rows * widest < MAX_ELEMENTS else max(1, (MAX_ELEMENTS - 1) // widest)


def _row_parts(args: tuple, rows: int) -> list[tuple]:
    total = next(a.shape[0] for a in args if isinstance(a, Tensor) and a.dim() >= 2)
    return [
        tuple(a[start : start + rows] if isinstance(a, Tensor) and a.dim() >= 2 else a for a in args)
        for start in range(0, total, rows)
    ]


def _joined(parts: list):
    """The parts' outputs (a tensor, or a tuple of tensors) joined along the rows."""
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return tuple(torch.cat(outputs) for outputs in zip(*parts, strict=True))
