"""Linear layers, norms and rotary position embeddings; norms and rotary numerically as Hugging Face
computes them (fp32 inside)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_fastbackend.engine import fused, onednn, quantize

MIN_ROWS = 16  # PyTorch's CPU products take at least this many rows (pytorch_product)
# transformers' activation name -> the same function in place, bit for bit ACT2FN's (tests/engine/test_layers.py)
IN_PLACE = {
    "gelu": torch.ops.aten.gelu_,
    "gelu_pytorch_tanh": functools.partial(torch.ops.aten.gelu_, approximate="tanh"),
    "relu": torch.relu_,
    "silu": torch.ops.aten.silu_,
    "swish": torch.ops.aten.silu_,
}


class Linear(nn.Linear):
    """nn.Linear whose products run through oneDNN (engine/onednn.py) where the engine's Runtime says so:
    the engine sets `product_dtype` from it (None: PyTorch's F.linear; torch.int8: int8 products of
    engine/quantize.py), and without gradients only.

    The reordered copies are made at the first product and again whenever the weight changes. Where the engine
    sets `releases_weight` and the copy is in the weight's own dtype, the copy holds every number of the weight,
    so the dense weight's memory is given back once it is made: the parameter stays (its dtype and device) with
    no elements, and is rebuilt from the copy, exactly, wherever it is needed again: state_dict, load_state_dict,
    .to(), pickling, a product with gradients or without oneDNN. Else the copies cost as much memory again as
    the weights they copy (a quarter of it in int8)."""

    product_dtype: torch.dtype | None = None
    releases_weight: bool = False  # the engine's own layers (no weight shared with another module)
    input_range: Tensor | None = None  # int8-static: [2, in] min and max per input channel (engine/calibration.py)
    _packed: dict | None = None

    def forward(self, x: Tensor) -> Tensor:
        if not self._onednn():
            return pytorch_product(x, self.dense_weight(), self.bias)
        if self.product_dtype == torch.int8:
            return quantize.product(x, self._part(0, 1)).to(self.weight.dtype)
        return onednn.product(x, self._part(0, 1)).to(self.weight.dtype)

    def act(self, x: Tensor, name: str) -> Tensor:
        """ACT2FN[name](self(x)). Through oneDNN the activation runs inside the product and the result stays
        in the product dtype, which the next product takes."""
        if self._onednn() and self.product_dtype == torch.int8:  # the activation in the pass after the product
            return quantize.product(x, self._part(0, 1), name).to(self.weight.dtype)
        if name in onednn.ACTIVATIONS and self._onednn():
            return onednn.product(x, self._part(0, 1), activation=name)
        if name in IN_PLACE and not torch.is_grad_enabled():
            return IN_PLACE[name](self(x))  # no second [T, out] tensor beside the product's
        return quantize.activation_module(name)(self(x))

    def gated(self, x: Tensor, name: str, compiled: bool = False) -> Tensor:
        """ACT2FN[name](gate) * up, where gate and up are the two halves of this layer's outputs (Llama's
        SiLU MLP, Gemma's GELU-tanh MLP, ModernBERT's GeGLU). Through oneDNN both run inside the halves'
        products, the result in the product dtype; else after the product, compiled where asked."""
        if self._onednn() and self.product_dtype == torch.int8:
            return quantize.product(x, self._part(0, 1), name, gated=True).to(self.weight.dtype)
        if name not in onednn.ACTIVATIONS or not self._onednn():
            return fused.seams(compiled).gated(self(x), quantize.activation_module(name))
        x = x.to(self.product_dtype)  # once, for both halves
        gate = onednn.product(x, self._part(0, 2), activation=name)
        return onednn.product(x, self._part(1, 2), multiply=gate)

    def silu_mul(self, x: Tensor) -> Tensor:
        return self.gated(x, "silu")

    def dense_weight(self) -> Tensor:
        """The weight, rebuilt in place from its reordered copy if it was given back."""
        if self._released():
            self.weight.data = self._rebuilt()
            self._packed = None  # copies of the released weight; made again at the next product
        return self.weight

    def drop_copies(self) -> None:
        """Forget the reordered copies (the weight rebuilt first if a copy held it): made again at the next product,
        from the weight and `input_range` as they are then."""
        self.dense_weight()
        self._packed = None

    def _onednn(self) -> bool:
        return self.product_dtype is not None and not torch.is_grad_enabled()

    def _released(self) -> bool:
        return self._packed is not None and "released" in self._packed and self.weight.numel() == 0

    def _rebuilt(self) -> Tensor:
        parts = self._packed["released"]
        return torch.cat([self._packed[part, parts][0].to_dense() for part in range(parts)])  # exact: a reorder

    def _key(self) -> tuple:
        return self.weight.data_ptr(), self.weight._version, self.product_dtype

    def _part(self, part: int, parts: int) -> onednn.Packed | quantize.QPacked:
        """Rows part/parts of the weight and bias, reordered for oneDNN (quantized for int8 products): made
        once per weight version, all `parts` at once; then the dense weight is given back where it may be."""
        packed = self._packed
        if packed is not None and packed["key"] == self._key() and (part, parts) in packed:
            return packed[part, parts]
        self.dense_weight()  # another dtype, or other parts, from the weight a released copy holds
        if self._packed is None or self._packed["key"] != self._key():
            self._packed = {"key": self._key()}
        weights, biases = self.weight.chunk(parts), [None] * parts if self.bias is None else self.bias.chunk(parts)
        for i, (weight, bias) in enumerate(zip(weights, biases, strict=True)):
            if self.product_dtype == torch.int8:
                self._packed[i, parts] = quantize.prepack(weight, bias, self.input_range)
            else:
                self._packed[i, parts] = onednn.prepack(weight, bias, self.product_dtype)
        if self.releases_weight and self.product_dtype == self.weight.dtype:
            self.weight.data = self.weight.new_empty(0)
            self._packed.update(key=self._key(), released=parts)
        return self._packed[part, parts]

    def _apply(self, fn, *args, **kwargs):
        """.to(device), .to(dtype), .half(): on the dense weight; the copies belong to the old one (the engine
        sets `product_dtype` again for its new runtime)."""
        self.drop_copies()
        return super()._apply(fn, *args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._released():  # a dense copy for the caller; this layer keeps only the reordered one
            weight = self._rebuilt()
            destination[prefix + "weight"] = nn.Parameter(weight, self.weight.requires_grad) if keep_vars else weight

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self.dense_weight()  # the loaded weight is copied into it
        super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self) -> dict:
        """Pickled (multi-process pools) and copied with the dense weight and without the reordered copies:
        oneDNN's opaque tensors have no storage to pickle; they are rebuilt at the first forward."""
        self.dense_weight()
        return {k: v for k, v in self.__dict__.items() if k != "_packed"}


def pytorch_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear; on a CPU without gradients, fewer than MIN_ROWS rows are multiplied with zero rows appended up to
    it: MKL multiplies 1 to 11 rows with other kernels, which sum in another order, than 12 or more (so a text's
    embedding would depend on its batch); from 12 rows on a row's result does not depend on the row count
    (tests/engine/test_layers.py)."""
    rows = x.shape[:-1].numel()
    if rows >= MIN_ROWS or x.device.type != "cpu" or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = F.linear(torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])]), weight, bias)
    return out[:rows].reshape(*x.shape[:-1], -1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: Tensor) -> Tensor:
        return fused.rms_norm(x, self.weight, self.eps, self.unit_offset)

    @property
    def parts(self) -> tuple[Tensor, float, bool]:
        """What engine/fused.py's functions take of this norm."""
        return self.weight, self.eps, self.unit_offset


class Rotary(nn.Module):
    """cos/sin tables for the positions of a batch. `inv_freq` stays fp32 whatever the model dtype."""

    _on_device: Tensor | None = None  # inv_freq on the device the positions were last on

    def __init__(self, inv_freq: Tensor, attention_scaling: float) -> None:
        super().__init__()
        assert inv_freq.dtype == torch.float32 and inv_freq.device.type == "cpu"
        self.inv_freq = inv_freq  # a plain attribute, so model.to(dtype) cannot round it
        self.attention_scaling = attention_scaling

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = position_ids.float()[:, None] * self._inv_freq_on(position_ids.device)[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D], the rotate_half layout
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def _inv_freq_on(self, device: torch.device) -> Tensor:
        """Copied to the device once, not at every pack: a copy from pageable host memory makes the host wait
        until the GPU's queue reaches it, so the host could no longer run ahead of the GPU."""
        if self._on_device is None or self._on_device.device != device:
            self._on_device = self.inv_freq.to(device)
        return self._on_device

    def __getstate__(self) -> dict:
        """Pickled (multi-process pools) without the device copy: a worker may not have that device."""
        return {k: v for k, v in self.__dict__.items() if k != "_on_device"}
