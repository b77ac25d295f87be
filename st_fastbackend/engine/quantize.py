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
from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN

from st_fastbackend.engine import cpu_kernel, fused, onednn
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
    offset: Tensor  # 0-dim fp32: x_zero + 0.5 (floor(v + 0.5) rounds), for PyTorch's pass (addcmul)
    x_scale: float  # of the smoothed input, per tensor
    x_zero: int  # in 0..255


# transformers' activation name -> the post-op qlinear_pointwise runs inside the int8 kernel (attribute, algorithm)
KERNEL_ACTIVATIONS = {name: onednn.ACTIVATIONS[name] for name in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")}
# transformers' activation name -> its id in csrc/quantize.cpp's dequantize pass (0: none)
PASS_ACTIVATIONS = {"gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2, "gelu_fast": 2, "relu": 3, "silu": 4, "swish": 4}


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
    """int8 products run on the CPU only."""
    if device.type != "cpu":
        raise UnsupportedModelError(f"quantize='int8' on {device.type} (int8 products run on the CPU)")


def attention_products(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of attention's two products (q.k, p.v) in an int8 model of `dtype`: bf16 where our CPU kernel runs
    bf16 products (AVX-512 with bf16 dot products), as OpenVINO's int8 runs everything that is not an int8 product,
    else None (the model's). 1.2x as fast as fp32 attention on a Zen 4; within int8's own error (eval/RESULTS.md)."""
    return torch.bfloat16 if dtype == torch.float32 and torch.bfloat16 in cpu_kernel.dtypes() else None


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


def product(x: Tensor, packed: QPacked | QStatic, activation: str | None = None, gated: bool = False) -> Tensor:
    """activation(x @ weight.T + bias) for x [..., in] in any float dtype: fp32 [..., out]; `gated`:
    activation(gate) * up of the output's two halves [..., out / 2] (a gated MLP). `activation` is a transformers
    activation name (config.hidden_act).

    The passes before and after the kernel run row by row in our C++ kernels (csrc/quantize.cpp) where they are built,
    else in eager PyTorch: the same code for every pack, so a token's codes, and its numbers, do not depend on its
    pack. Compiled passes for large packs and eager ones for small packs gave a row 1-ulp differences, which the next
    product's codes turned into 1e-2 in an embedding (eval/RESULTS.md, 2026-12-07). An activation the C++ pass does
    not have (not in PASS_ACTIVATIONS) runs in eager PyTorch after it."""
    shape = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1]).float()  # [T, in]
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, kernels = onednn.product_rows(x.shape[0]), cpu_kernel.int8_passes()
    if kernels is None:
        out = _pytorch_product(onednn.padded(x, torch.float32), packed, activation, gated)
    elif isinstance(packed, QStatic):
        codes = x.new_empty((rows, x.shape[1]), dtype=torch.uint8)
        kernels.quantize_static(x, packed.inverse, packed.x_zero + 0.5, codes)
        inside = activation if activation in KERNEL_ACTIVATIONS and not gated else None  # oneDNN's post-op
        out = _static_kernel(codes, packed, inside)
        if activation != inside:
            out = _finished(out, None, None, activation, gated, x.shape[0], kernels)
    else:
        codes, scale = x.new_empty((rows, x.shape[1]), dtype=torch.uint8), x.new_empty(rows)
        kernels.quantize_rows(x, codes, scale)
        out = _finished(_dynamic_kernel(codes, packed), scale, packed.bias, activation, gated, x.shape[0], kernels)
    return out[: shape.numel()].unflatten(0, shape)  # [rows(T), out] -> [..., out]


def _dynamic_kernel(codes: Tensor, packed: QPacked) -> Tensor:
    """(codes, their scale and zero point, weight, its scales and zero points, bias, output scale and zero point,
    output dtype, post-op): [rows(T), out], sum(codes * weight codes) * weight scale."""
    return torch.ops.onednn.qlinear_pointwise(codes, 1.0, _SHIFT, *packed[:3], None, 1.0, 0, torch.float32, "none",
                                              [], "")  # fmt: skip


def _static_kernel(codes: Tensor, packed: QStatic, activation: str | None) -> Tensor:
    """The kernel scales the sums by both scales, adds the bias and applies the activation (one of
    KERNEL_ACTIVATIONS, or None)."""
    attr, algorithm = KERNEL_ACTIVATIONS.get(activation, ("none", ""))
    return torch.ops.onednn.qlinear_pointwise(codes, packed.x_scale, packed.x_zero, *packed[:4], 1.0, 0,
                                              torch.float32, attr, [], algorithm)  # fmt: skip


def _finished(y: Tensor, scale: Tensor | None, bias: Tensor | None, activation: str | None, gated: bool, tokens: int,
              kernels) -> Tensor:  # fmt: skip
    """The C++ pass after the kernel on y [rows(T), n]'s first `tokens` rows, in place: each token's scale, the bias,
    the activation or act(gate) * up (into the first half: the result is y[:, :n / 2])."""
    known = activation is None or activation in PASS_ACTIVATIONS
    kernels.dequantize(y, scale, bias, PASS_ACTIVATIONS.get(activation, 0), tokens, gated and known)
    if known:
        return y[:, : y.shape[1] // 2] if gated else y
    act = activation_module(activation)
    return fused.EAGER.gated(y, act) if gated else act(y)


def _pytorch_product(x: Tensor, packed: QPacked | QStatic, activation: str | None, gated: bool) -> Tensor:
    """The same product with PyTorch's passes, where our C++ kernels are not built: x [rows(T), in]."""
    act = None if activation is None else activation_module(activation)
    if isinstance(packed, QStatic):
        inside = activation if activation in KERNEL_ACTIVATIONS and not gated else None
        out = _static_kernel(quantize_static(x, packed.inverse, packed.offset), packed, inside)
        act = None if activation == inside else act
    else:
        codes, scale = quantize_rows(x)
        out = dequantize(_dynamic_kernel(codes, packed), scale, packed.bias, None if gated else act)
        act = act if gated else None
    if act is None:
        return out
    return fused.EAGER.gated(out, act) if gated else act(out)


@functools.cache
def activation_module(name: str) -> nn.Module:
    """ACT2FN[name], one module per name (transformers makes a new one at each lookup)."""
    return ACT2FN[name]


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
