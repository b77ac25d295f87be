"""How the engine runs on a device and dtype, decided once: the attention kernel with what the installed
kernel accepts, and the dtype the matrix products run in. Also the model dtype asked for at load.

Capabilities are read from the installed functions' signatures where a signature shows them. The
signatures of PyTorch's `torch.nn.attention.varlen.varlen_attn` (read from each release's wheel):
  2.10  (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)
  2.11  (..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1))    causal = window_size (w, 0)
  2.12+ (..., window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None)
Under every one of them is aten's flash kernel (mha_varlen_fwd), which takes fewer k/v heads than query heads
where they divide ("Number of heads in key/value must divide number of heads in query", in the 2.10 and 2.11
binaries too); from 2.12 varlen_attn itself refuses unequal heads unless enable_gqa=True. 2.14 sends full
non-causal attention with equal heads to cuDNN on Hopper; causal attention (window (-1, 0)) stays on flash.
flash-attn's `flash_attn_varlen_func` (read from each release's flash_attn_interface.py):
  2.0-2.2  (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            return_attn_probs)
  2.3      (..., causal, window_size=(-1, -1), return_attn_probs)
  2.4-2.8  (..., window_size, [softcap,] alibi_slopes, deterministic, return_attn_probs[, block_table])
Only one fact is not in a signature: before 2.1 a causal mask with more keys than queries was aligned with the
keys' start, from 2.1 with their end ("aligned to the bottom right corner"), so the version says that one.
Both flash kernels take fp16/bf16 only, and only on Ampere or newer GPUs. A CPU with AVX2 or AVX-512 runs our own
kernel (engine/cpu_kernel.py: fp32, and bf16 where the CPU has bf16 dot products); elsewhere, and for what that
kernel does not take, attention runs through exact SDPA, one call per run of equal-length sequences.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from st_fastbackend.engine import cpu_kernel
from st_fastbackend.engine.spec import FP16_OVERFLOWS, UnsupportedModelError

logger = logging.getLogger(__name__)
Kernel = Literal["flash_attn", "torch_varlen", "cpu_kernel", "sdpa_loop"]
HALF_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_KERNELS = ("flash_attn", "torch_varlen")  # a whole pack per call, on a GPU
VARLEN_DEVICES = ("cuda",)  # where the flash kernels exist (tests add "cpu" to run stand-ins of them)


@dataclass(frozen=True)
class Runtime:
    kernel: Kernel
    grouped_heads: bool  # takes fewer k/v heads than query heads; else k/v are repeated
    window: bool  # takes a sliding window; else a pack that a window cuts runs through the SDPA loop
    is_causal: bool  # takes `is_causal`; else causality is window_size=(left, 0)
    dtype: torch.dtype  # the model's
    product_dtype: torch.dtype | None = None  # oneDNN's products on a CPU (engine/onednn.py); None: PyTorch's
    scale: bool = True  # takes a softmax scale; else q is multiplied by it first (Gemma's query_pre_attn_scalar)
    fused: bool = False  # the elementwise seams between products run compiled (engine/fused.py)
    ask_grouped: bool = False  # grouped heads must be asked for with enable_gqa=True (PyTorch >= 2.12)
    longer_keys: bool = True  # aligns a query sequence shorter than its keys with their end (a prompt computed once)

    def __str__(self) -> str:
        names = ("grouped_heads", "window", "is_causal", "scale", "longer_keys")
        missing = [name for name in names if not getattr(self, name)]
        varlen = self.kernel in VARLEN_KERNELS
        kernel = self.kernel + (f" (without {', '.join(missing)})" if missing and varlen else "")
        products = f"oneDNN in {self.product_dtype}" if self.product_dtype else f"PyTorch's in {self.dtype}"
        seams = "compiled" if self.fused else "eager"
        return f"attention {kernel}; model in {self.dtype}; matrix products {products}; layer seams {seams}"


@functools.cache
def choose_runtime(
    device_type: str,
    dtype: torch.dtype,
    device_index: int | None = None,
    product_dtype: torch.dtype | None = None,
    fused: bool = False,
) -> Runtime:
    """flash-attn's varlen kernel where installed, else PyTorch's own, for fp16/bf16 on an Ampere or newer
    GPU; SDPA per run of equal-length sequences everywhere else (CPU, fp32, older GPUs, no varlen).
    `product_dtype`: the caller's choice for oneDNN's products (engine/onednn.product_dtype), CPU only;
    `fused`: whether the layer seams run compiled (engine/fused.py), the caller's choice too."""
    assert product_dtype is None or device_type == "cpu"
    if device_type in VARLEN_DEVICES and dtype in HALF_DTYPES and _flash_capable(device_type, device_index):
        flash = flash_attn_keywords()
        if flash is not None:
            window, longer_keys = "window_size" in flash, _flash_attn_aligns_keys_end()
            return Runtime("flash_attn", grouped_heads=True, window=window, is_causal=True, dtype=dtype, fused=fused,
                           longer_keys=longer_keys)  # fmt: skip
        keywords = torch_varlen_keywords()
        if keywords is not None:
            return Runtime(
                "torch_varlen",
                grouped_heads=True,
                ask_grouped="enable_gqa" in keywords,
                window="window_size" in keywords,
                is_causal="is_causal" in keywords,
                dtype=dtype,
                scale="scale" in keywords,
                fused=fused,
            )
    # PyTorch's CPU flash kernel takes grouped heads; on CUDA the memory-efficient SDPA kernel (fp32,
    # masks) does not, and grouped heads would send it to the math kernel: repeat k/v there.
    taken = cpu_kernel.attention_dtype(dtype, product_dtype or dtype)  # fp32 for bf16 products where it runs fp32 only
    kernel = device_type == "cpu" and cpu_kernel.attention_for(taken) is not None
    return Runtime(
        "cpu_kernel" if kernel else "sdpa_loop",
        grouped_heads=device_type == "cpu",
        window=True,
        is_causal=True,
        dtype=dtype,
        product_dtype=product_dtype,
        fused=fused,
    )


def torch_varlen_keywords() -> frozenset[str] | None:
    """The parameters of the installed varlen_attn, or None where PyTorch has none (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash_capable(device_type: str, device_index: int | None) -> bool:
    """Both flash kernels refuse GPUs before Ampere (compute capability 8.0): T4, V100."""
    return device_type != "cuda" or torch.cuda.get_device_capability(device_index) >= (8, 0)


def flash_attn_keywords() -> frozenset[str] | None:
    """The parameters of the installed flash-attn's varlen function, or None where flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return frozenset(inspect.signature(flash_attn_varlen_func).parameters)


def _flash_attn_aligns_keys_end() -> bool:
    """flash-attn >= 2.1 aligns a causal mask with the end of longer keys; 2.0 with their start (no signature
    shows it: its changelog and docstrings do)."""
    import flash_attn
    from packaging.version import Version

    return Version(flash_attn.__version__) >= Version("2.1")


def resolve_dtype(
    model_kwargs: dict[str, Any], config, device_type: str, stored: torch.dtype | None = None
) -> torch.dtype:
    """sentence-transformers' model_kwargs dtype: a torch.dtype, its name, or "auto"; none given is "auto", as in
    transformers 5, which plain sentence-transformers loads with. "auto" is the checkpoint's dtype: its config's,
    else its stored weights' (`stored`), else fp32, on every device, as transformers' from_pretrained resolves it.
    One exception, logged: fp16 for a family known to overflow in it (inf/NaN embeddings) becomes bf16 (fp32 on
    a GPU without bf16); dtype=torch.float16 by name still runs fp16, with a warning."""
    asked = model_kwargs.get("dtype") or model_kwargs.get("torch_dtype") or "auto"  # as from_pretrained reads them
    dtype = asked
    if asked == "auto":
        dtype = getattr(config, "dtype", None) or stored or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UnsupportedModelError(f"dtype {dtype!r}")
    if dtype == torch.float16 and config.model_type in FP16_OVERFLOWS:
        why = f"{config.model_type} models overflow in float16 (inf/NaN embeddings); their authors advise bfloat16"
        if asked != "auto":
            logger.warning(f"{why}. Running in float16 as asked.")
            return dtype
        dtype = torch.bfloat16 if device_type != "cuda" or torch.cuda.is_bf16_supported() else torch.float32
        logger.warning(f"{why}. The checkpoint's float16 becomes {dtype}; pass dtype=torch.float16 to insist.")
    return dtype


def is_device_failure(error: BaseException) -> bool:
    """A CUDA error (an illegal address, a device-side assert) poisons the process's CUDA context: every later
    call fails too. PyTorch >= 2.8 raises torch.AcceleratorError for it, older releases a RuntimeError whose
    message says "CUDA error". Running out of memory is neither (torch.OutOfMemoryError; the schedule backs off)."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(error, accelerator_error) or (isinstance(error, RuntimeError) and "CUDA error" in str(error))
