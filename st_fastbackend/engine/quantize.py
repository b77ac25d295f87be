"""int8 matrix products on the CPU (model_kwargs={"quantize": "int8"}): weights quantized per output channel
once at load, activations per token at each product, int8 x int8 -> int32 sums in oneDNN's VNNI kernel.

The kernel is PyTorch's onednn::qlinear_pointwise (aten/src/ATen/native/quantized/cpu/qlinear.cpp, the op
PyTorch's own x86 int8 path lowers to), on a weight reordered once by onednn::qlinear_prepack. It multiplies
the weight's per-channel scales in and returns fp32; each token's scale and the bias follow in one pass.
Chosen by measurement (eval/RESULTS.md, "2026-12-01 (night) — int8 products") over torch._int_mm (also
oneDNN, s8 x s8 -> s32), as fast but needing two more passes over its int32 output. oneDNN's fast int8 kernels
take unsigned activations: a signed int8 activation q is passed as q + 128 with zero point 128 (the weight's
compensation is in its prepacked form); signed activations go to oneDNN's reference kernel, thousands of times
slower. Per token, not per tensor: a text's numbers do not depend on the other texts of its pack.

Symmetric on both sides, as in LLM.int8() and SmoothQuant's per-token dynamic W8A8 (Dettmers et al. 2022,
Xiao et al. 2022): scale = max |row| / 127, q = round(x / scale).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from st_fastbackend.engine import fused, onednn
from st_fastbackend.engine.spec import UnsupportedModelError

QUANTIZE = ("int8",)  # the values of model_kwargs["quantize"]
_SHIFT = 128  # signed int8 -> oneDNN's unsigned activations, as zero point 128
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row: scale > 0, its codes 0


class QPacked(NamedTuple):
    weight: Tensor  # int8 in oneDNN's layout, [in, out] logically
    scale: Tensor  # [out] fp32: weight row o = scale[o] * codes[o]
    zero_points: Tensor  # [out] int64 zeros (symmetric), as the kernel takes them
    bias: Tensor | None  # [out] fp32


def check_quantize(value: str | None, device: torch.device) -> str | None:
    """model_kwargs["quantize"]: None, or one of QUANTIZE on a CPU whose int8 products this was measured on."""
    if value is None:
        return None
    if value not in QUANTIZE:
        raise UnsupportedModelError(f"quantize={value!r} (supported: {', '.join(map(repr, QUANTIZE))})")
    check_device(device)
    if not int8_supported():
        raise UnsupportedModelError(
            "quantize='int8' on this CPU (it needs an x86-64 CPU with AVX512-VNNI and PyTorch with oneDNN)"
        )
    return value


def check_device(device: torch.device) -> None:
    """int8 products run on the CPU only; None: the Runtime's own product dtype (attention's) stays the model's."""
    if device.type != "cpu":
        raise UnsupportedModelError(f"quantize='int8' on {device.type} (int8 products run on the CPU)")


@functools.cache
def int8_supported() -> bool:
    """x86-64 with oneDNN and AVX512-VNNI (Cascade Lake, Zen 4 and later): where oneDNN's int8 kernels were
    measured. Without VNNI oneDNN's int8 is not faster than fp32, so it is refused rather than run slowly."""
    return torch.float32 in onednn.onednn_dtypes() and torch.cpu._is_vnni_supported()


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per output channel, symmetric: (codes int8 [out, in], scale fp32 [out])."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).div(127).clamp_min(_TINY)
    return torch.round(weight / scale[:, None]).to(torch.int8), scale


def prepack(weight: Tensor, bias: Tensor | None) -> QPacked:
    codes, scale = quantize_weight(weight)
    packed = torch.ops.onednn.qlinear_prepack(codes, [onednn.PREPACK_ROWS, codes.shape[1]])
    bias = None if bias is None else bias.detach().float().contiguous()
    return QPacked(packed, scale, torch.zeros(len(scale), dtype=torch.int64), bias)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per token, symmetric: (codes + 128 as uint8 [T, in], scale fp32 [T, 1]).
    floor(x / scale + 128.5) is round(x / scale) + 128 (halves rounded up), in 1..255 as |x / scale| <= 127."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).div(127).clamp_min(_TINY)
    return torch.floor(x / scale + (_SHIFT + 0.5)).to(torch.uint8), scale


def dequantize(sums: Tensor, scale: Tensor, bias: Tensor | None, activation: nn.Module | None) -> Tensor:
    """The kernel's output (integer sums times the weight's scales) times each token's scale, plus the bias,
    then the activation where there is one."""
    out = sums * scale if bias is None else torch.addcmul(bias, sums, scale)
    return out if activation is None else activation(out)


def product(x: Tensor, packed: QPacked, activation: nn.Module | None = None, compiled: bool = True) -> Tensor:
    """activation(x @ weight.T + bias) for x [..., in] in any float dtype: fp32 [..., out]. In eager PyTorch the
    passes around the kernel cost more than the int8 product itself; compiled into one kernel each, as the layer
    seams are (engine/fused.py), they pay (eval/RESULTS.md, "2026-12-01 (night) — int8 products"). Packs under
    fused.MIN_TOKENS tokens run them eagerly, as the seams do; `compiled=False` always (passes_compiled, decided
    at load)."""
    shape = x.shape[:-1]
    x = onednn.padded(x.reshape(-1, x.shape[-1]), torch.float32)  # [rows(T), in]
    seams = _seams(compiled and x.shape[0] >= fused.MIN_TOKENS)
    codes, scale = seams.quantize_rows(x)
    # (codes, their scale and zero point, weight, its scales and zero points, bias, output scale and zero point,
    # output dtype, post-op): [rows(T), out], sum(codes * weight codes) * weight scale
    sums = torch.ops.onednn.qlinear_pointwise(
        codes, 1.0, _SHIFT, *packed[:3], None, 1.0, 0, torch.float32, "none", [], ""
    )
    out = seams.dequantize(sums, scale, packed.bias, activation)
    return out[: shape.numel()].unflatten(0, shape)  # [rows(T), out] -> [..., out]


def passes_compiled() -> bool:
    """Whether the passes around the int8 kernel run compiled: yes, unless ST_FASTBACKEND_COMPILE=0 (read when a
    model decides its runtime, not at each product)."""
    return os.environ.get("ST_FASTBACKEND_COMPILE") != "0"


@functools.cache
def _seams(compiled: bool) -> SimpleNamespace:
    """The two passes around the kernel, compiled (once per process, dynamic shapes, failures logged and run
    eagerly: engine/fused.py's wrapper) or eager."""
    wrap = fused._Timed if compiled else (lambda f: f)
    return SimpleNamespace(quantize_rows=wrap(quantize_rows), dequantize=wrap(dequantize))


def reference_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The same quantized product in exact integer arithmetic (int64 sums), for tests: what product() must
    return up to fp32 rounding of the scales."""
    x = x.reshape(-1, x.shape[-1]).float()
    codes, scale = quantize_weight(weight)
    x_scale = x.abs().amax(dim=-1, keepdim=True).div(127).clamp_min(_TINY)
    x_codes = torch.floor(x / x_scale + (_SHIFT + 0.5)).long() - _SHIFT  # as quantize_rows rounds
    sums = x_codes @ codes.long().T  # [T, out], exact
    out = sums.double() * x_scale.double() * scale.double()
    return (out if bias is None else out + bias.double()).float()
