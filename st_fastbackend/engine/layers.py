"""Linear layers, norms and rotary position embeddings; norms and rotary numerically as Hugging Face
computes them (fp32 inside)."""

from __future__ import annotations

import functools
import logging
import os
import platform

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)


class Linear(nn.Linear):
    """nn.Linear that, on a CPU without gradients, multiplies through oneDNN with its weight reordered
    once into oneDNN's blocked layout. Measured on this project's CPU: fp32 matrix products 10-40%
    faster than PyTorch's default, and activations fused into the product (eval/RESULTS.md). The dense
    weight stays the parameter (state_dict, .to(device)); the reordered copies are rebuilt whenever
    the weight changes, and cost as much memory again as the weights they copy.

    An fp32 layer multiplies in bf16 (inputs and weight rounded to bf16, fp32 sums, fp32 result) where
    PyTorch's setting allows fp32 products to: torch.set_float32_matmul_precision("medium") or
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"; everything between products stays fp32."""

    _prepacked: dict | None = None
    reorder = True  # False where the copies would not fit (see limit_reordered_copies)

    def forward(self, x: Tensor) -> Tensor:
        if not self.uses_onednn():
            return F.linear(x, self.weight, self.bias)
        return self.product(x).to(self.weight.dtype)

    def product(
        self, x: Tensor, part: int = 0, parts: int = 1, activation: str | None = None, multiply: Tensor | None = None
    ) -> Tensor:
        """x @ weight.T + bias through oneDNN, in product_dtype() (x is cast to it, and so is the result),
        for rows part/parts of the weight; then an activation (a key of ONEDNN_ACTIVATIONS) or a product
        with `multiply`, inside the same kernel: no second pass over the output."""
        dtype = self.product_dtype()
        weight, bias = self.prepacked(part, parts, dtype)
        shape = x.shape[:-1]
        x = padded(x.reshape(-1, x.shape[-1]), dtype)  # [..., in] -> [product_rows(T), in]
        if multiply is not None:
            multiply = padded(multiply.reshape(-1, multiply.shape[-1]), dtype)
            out = torch.ops.mkldnn._linear_pointwise.binary(x, multiply, weight, bias, "mul")
        else:
            attr, algorithm = ONEDNN_ACTIVATIONS[activation] if activation is not None else ("none", "")
            out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
        return out[: shape.numel()].unflatten(0, shape)  # [product_rows(T), out] -> [..., out]

    def uses_onednn(self) -> bool:
        w = self.weight
        cpu_inference = w.device.type == "cpu" and not torch.is_grad_enabled()
        return self.reorder and cpu_inference and w.dtype in _onednn_dtypes()

    def product_dtype(self) -> torch.dtype:
        """The dtype the oneDNN product runs in: the weight's, or bf16 for fp32 where PyTorch allows it."""
        return torch.bfloat16 if self.weight.dtype == torch.float32 and bf16_products_allowed() else self.weight.dtype

    def prepacked(self, part: int, parts: int, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """Rows part/parts of (weight, bias) in `dtype`, the weight in oneDNN's layout; made once."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._prepacked is None or self._prepacked["key"] != key:
            self._prepacked = {"key": key}
        if (part, parts, dtype) not in self._prepacked:
            weight = self.weight.detach().chunk(parts)[part].to(dtype).contiguous()
            bias = None if self.bias is None else self.bias.detach().chunk(parts)[part].to(dtype).contiguous()
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight, _PREPACK_ROWS)
            self._prepacked[part, parts, dtype] = (reordered, bias)
        return self._prepacked[part, parts, dtype]

    def _apply(self, fn, *args, **kwargs):
        """.to(device), .to(dtype), .half(): the reordered copies belong to the old weight."""
        self._prepacked = None
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self) -> dict:
        """Pickled (multi-process pools) and copied without the reordered copies: oneDNN's opaque
        tensors have no storage to pickle; they are rebuilt at the first forward."""
        return {k: v for k, v in self.__dict__.items() if k != "_prepacked"}


def product_rows(rows: int) -> int:
    """`rows` rounded up to one of a few sizes: a multiple of 16 up to 128, then 8 sizes per doubling
    (at most 12.5% more rows). oneDNN compiles a primitive per product shape and keeps it, ~0.6 MB each
    with PyTorch's own cache of their descriptors, up to 1,024 shapes in each cache: packs of every token
    count filled them (RSS +700 MB over 1,200 small encode calls, eval/bench_memory.py). With these
    sizes a product has at most 56 shapes up to 8,192 tokens. A row's result does not depend on the
    rows around it (tests/test_layers.py), so the zero rows added change no number."""
    step = max(16, 1 << max(0, (rows - 1).bit_length() - 4))
    return -(-rows // step) * step


def padded(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x [T, n] in `dtype`, with zero rows appended up to product_rows(T): one copy at most."""
    rows = product_rows(x.shape[0])
    if rows == x.shape[0]:
        return x.to(dtype)
    out = x.new_empty((rows, x.shape[1]), dtype=dtype)
    out[: x.shape[0]] = x
    out[x.shape[0] :] = 0
    return out


def bf16_products_allowed() -> bool:
    """PyTorch's own switch for fp32 products in bf16 on oneDNN (set by set_float32_matmul_precision
    ("medium")), honoured where oneDNN runs bf16 natively."""
    return torch.backends.mkldnn.matmul.fp32_precision == "bf16" and torch.bfloat16 in _onednn_dtypes()


# transformers' activation name (config.hidden_act) -> the oneDNN post-op computing the same function
# (attribute, algorithm); equal to transformers' ACT2FN within 5e-7 (tests/test_layers.py).
ONEDNN_ACTIVATIONS = {
    "gelu": ("gelu", "none"),  # erf
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"),
    "relu": ("relu", ""),
    "silu": ("swish", ""),
    "swish": ("swish", ""),
    "tanh": ("tanh", ""),
    "sigmoid": ("sigmoid", ""),
}


def limit_reordered_copies(engine: nn.Module) -> None:
    """Allow the reordered copies only if they take at most a quarter of the memory free now: a large
    model on a small machine keeps PyTorch's default product rather than its weights twice."""
    layers = [m for m in engine.modules() if isinstance(m, Linear)]
    size = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    allowed = size <= free_memory_bytes() / 4
    for layer in layers:
        layer.reorder = allowed
    if not allowed:
        logger.info(f"Matrix weights of {size / 2**30:.1f} GiB: no reordered copies for oneDNN (memory).")


def free_memory_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """Where the oneDNN path was measured: x86-64 CPUs; bf16 only where oneDNN runs it natively (it
    refuses bf16 without AVX-512 or AVX-NE-CONVERT)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


_PREPACK_ROWS = 4096  # the layout is chosen for products with about this many tokens


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # As transformers' LlamaRMSNorm: statistics in fp32, cast back before the weight multiply.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for the positions of a batch. `inv_freq` stays fp32 whatever the model dtype."""

    def __init__(self, inv_freq: Tensor, attention_scaling: float) -> None:
        super().__init__()
        assert inv_freq.dtype == torch.float32 and inv_freq.device.type == "cpu"
        self.inv_freq = inv_freq  # a plain attribute, so model.to(dtype) cannot round it
        self.attention_scaling = attention_scaling

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D], the rotate_half layout
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos, sin: [T, D]. Hugging Face's rotate_half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
