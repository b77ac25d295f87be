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

"int8-static" fixes each product's activation scale and zero point ahead of time, from the range of its inputs
over calibration texts (engine/calibration.py), as OpenVINO's and ONNX Runtime's static int8 do: no per-token
maximum, and the kernel itself applies both scales, the bias and the activation (no pass after it). Before the
range is taken, each input channel is divided by SmoothQuant's factor max|x_c|^a / max|W_c|^(1-a) (a = SMOOTHING),
and the weight's column multiplied by it (the product is unchanged): outlier channels, which a single scale
per product would otherwise spend its codes on, move into the weight's per-channel scales. The division is in
the quantize pass (one multiply per element, as the static scale needs anyway). Asymmetric (a zero point) since
inputs after an activation are mostly positive. A token's codes depend on nothing else in its pack.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN

from st_fastbackend.engine import fused, onednn
from st_fastbackend.engine.spec import UnsupportedModelError

QUANTIZE = ("int8", "int8-static")  # the values of model_kwargs["quantize"]
SMOOTHING = 0.65  # SmoothQuant's migration strength a: on MiniLM the smallest error among 0, 0.3, 0.5, 0.6, ..., 0.8
_SHIFT = 128  # signed int8 -> oneDNN's unsigned activations, as zero point 128
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row: scale > 0, its codes 0


class QPacked(NamedTuple):
    weight: Tensor  # int8 in oneDNN's layout, [in, out] logically
    scale: Tensor  # [out] fp32: weight row o = scale[o] * codes[o]
    zero_points: Tensor  # [out] int64 zeros (symmetric), as the kernel takes them
    bias: Tensor | None  # [out] fp32


class QStatic(NamedTuple):
    weight: Tensor  # int8 in oneDNN's layout: the weight with each column times its smoothing factor
    scale: Tensor
    zero_points: Tensor
    bias: Tensor | None
    inverse: Tensor  # [in] fp32: 1 / (smoothing factor * x_scale), per input channel
    offset: Tensor  # 0-dim fp32: x_zero + 0.5 (floor(v + 0.5) rounds), a tensor so compiled passes take any
    x_scale: float  # of the smoothed input, per tensor
    x_zero: int  # in 0..255


# transformers' activation name -> the post-op qlinear_pointwise runs inside the int8 kernel (attribute, algorithm)
KERNEL_ACTIVATIONS = {name: onednn.ACTIVATIONS[name] for name in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")}


def check_quantize(value: str | None, device: torch.device) -> str | None:
    """model_kwargs["quantize"]: None, or one of QUANTIZE on a CPU whose int8 products this was measured on."""
    if value is None:
        return None
    if value not in QUANTIZE:
        raise UnsupportedModelError(f"quantize={value!r} (supported: {', '.join(map(repr, QUANTIZE))})")
    check_device(device)
    if not int8_supported():
        raise UnsupportedModelError(
            f"quantize={value!r} on this CPU (it needs an x86-64 CPU with AVX512-VNNI and PyTorch with oneDNN)"
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


def prepack(weight: Tensor, bias: Tensor | None, input_range: Tensor | None = None) -> QPacked | QStatic:
    """For the kernel: per-token scales (QPacked), or static ones from `input_range` [2, in], each input channel's
    minimum and maximum over the calibration texts (QStatic)."""
    if input_range is not None:
        return prepack_static(weight, bias, input_range)
    codes, scale = quantize_weight(weight)
    packed = torch.ops.onednn.qlinear_prepack(codes, [onednn.PREPACK_ROWS, codes.shape[1]])
    bias = None if bias is None else bias.detach().float().contiguous()
    return QPacked(packed, scale, torch.zeros(len(scale), dtype=torch.int64), bias)


def static_scales(weight: Tensor, input_range: Tensor) -> tuple[Tensor, float, int]:
    """(smoothing factor per input channel [in], the smoothed input's scale, its zero point)."""
    lo, hi = input_range.float()
    x_max, w_max = torch.maximum(lo.abs(), hi.abs()), weight.detach().float().abs().amax(dim=0)
    smooth = x_max.pow(SMOOTHING) / w_max.pow(1 - SMOOTHING)
    smooth = torch.where((x_max > 0) & (w_max > 0), smooth, 1.0)  # a channel never seen, or with zero weights
    lo, hi = (lo / smooth).min().clamp_max(0).item(), (hi / smooth).max().clamp_min(0).item()  # 0 has a code
    x_scale = max((hi - lo) / 255, _TINY)
    return smooth, x_scale, min(255, max(0, round(-lo / x_scale)))


def prepack_static(weight: Tensor, bias: Tensor | None, input_range: Tensor) -> QStatic:
    smooth, x_scale, x_zero = static_scales(weight, input_range)
    packed = prepack(weight.detach().float() * smooth, bias)
    offset = torch.tensor(x_zero + 0.5)
    return QStatic(*packed, inverse=1 / (smooth * x_scale), offset=offset, x_scale=x_scale, x_zero=x_zero)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per token, symmetric: (codes + 128 as uint8 [T, in], scale fp32 [T, 1]).
    floor(x / scale + 128.5) is round(x / scale) + 128 (halves rounded up), in 1..255 as |x / scale| <= 127."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).div(127).clamp_min(_TINY)
    return torch.floor(x / scale + (_SHIFT + 0.5)).to(torch.uint8), scale


def quantize_static(x: Tensor, inverse: Tensor, offset: Tensor) -> Tensor:
    """round(x_c / (smooth_c * x_scale)) + x_zero, clamped to the codes 0..255 (a value past the calibrated
    range takes the nearest code): uint8 [T, in]."""
    return torch.floor(torch.addcmul(offset, x.float(), inverse)).clamp_(0, 255).to(torch.uint8)


def dequantize(sums: Tensor, scale: Tensor, bias: Tensor | None, activation: nn.Module | None) -> Tensor:
    """The kernel's output (integer sums times the weight's scales) times each token's scale, plus the bias,
    then the activation where there is one."""
    out = sums * scale if bias is None else torch.addcmul(bias, sums, scale)
    return out if activation is None else activation(out)


def product(x: Tensor, packed: QPacked | QStatic, activation: str | None = None, compiled: bool = True) -> Tensor:
    """activation(x @ weight.T + bias) for x [..., in] in any float dtype: fp32 [..., out]. In eager PyTorch the
    passes around the kernel cost more than the int8 product itself; compiled into one kernel each, as the layer
    seams are (engine/fused.py), they pay (eval/RESULTS.md, "2026-12-01 (night) — int8 products"). Packs under
    fused.MIN_TOKENS tokens run them eagerly, as the seams do; `compiled=False` always (passes_compiled, decided
    at load). `activation` is a transformers activation name (config.hidden_act)."""
    shape = x.shape[:-1]
    x = onednn.padded(x.reshape(-1, x.shape[-1]), torch.float32)  # [rows(T), in]
    seams = _seams(compiled and x.shape[0] >= fused.MIN_TOKENS)
    if isinstance(packed, QStatic):
        out = _static_product(x, packed, activation, seams)
        return out[: shape.numel()].unflatten(0, shape)
    codes, scale = seams.quantize_rows(x)
    # (codes, their scale and zero point, weight, its scales and zero points, bias, output scale and zero point,
    # output dtype, post-op): [rows(T), out], sum(codes * weight codes) * weight scale
    sums = torch.ops.onednn.qlinear_pointwise(
        codes, 1.0, _SHIFT, *packed[:3], None, 1.0, 0, torch.float32, "none", [], ""
    )
    out = seams.dequantize(sums, scale, packed.bias, None if activation is None else activation_module(activation))
    return out[: shape.numel()].unflatten(0, shape)  # [rows(T), out] -> [..., out]


def _static_product(x: Tensor, packed: QStatic, activation: str | None, seams: SimpleNamespace) -> Tensor:
    """The kernel scales the sums by both scales, adds the bias and applies the activation where oneDNN has it."""
    codes = seams.quantize_static(x, packed.inverse, packed.offset)
    attr, algorithm = KERNEL_ACTIVATIONS.get(activation, ("none", ""))  # None or another: after the kernel
    out = torch.ops.onednn.qlinear_pointwise(
        codes, packed.x_scale, packed.x_zero, *packed[:4], 1.0, 0, torch.float32, attr, [], algorithm
    )
    return activation_module(activation)(out) if activation and activation not in KERNEL_ACTIVATIONS else out


@functools.cache
def activation_module(name: str) -> nn.Module:
    """ACT2FN[name], one module per name (transformers makes a new one at each lookup; a compiled pass takes
    the same one every time)."""
    return ACT2FN[name]


def passes_compiled() -> bool:
    """Whether the passes around the int8 kernel run compiled: yes, unless ST_FASTBACKEND_COMPILE=0 (read when a
    model decides its runtime, not at each product)."""
    return os.environ.get("ST_FASTBACKEND_COMPILE") != "0"


@functools.cache
def _seams(compiled: bool) -> SimpleNamespace:
    """The two passes around the kernel, compiled (once per process, dynamic shapes, failures logged and run
    eagerly: engine/fused.py's wrapper) or eager."""
    wrap = fused._Timed if compiled else (lambda f: f)
    return SimpleNamespace(
        quantize_rows=wrap(quantize_rows), dequantize=wrap(dequantize), quantize_static=wrap(quantize_static)
    )


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


def reference_static_product(x: Tensor, weight: Tensor, bias: Tensor | None, input_range: Tensor) -> Tensor:
    """The static product in exact integer arithmetic, for tests."""
    x = x.reshape(-1, x.shape[-1]).float()
    smooth, x_scale, x_zero = static_scales(weight, input_range)
    codes, scale = quantize_weight(weight.detach().float() * smooth)
    x_codes = torch.floor(x / (smooth * x_scale) + (x_zero + 0.5)).clamp(0, 255).long() - x_zero
    out = (x_codes @ codes.long().T).double() * x_scale * scale.double()
    return (out if bias is None else out + bias.double()).float()
