"""SPLADE on the packed engine: a masked-LM checkpoint's head on packed tokens, and SpladePooling fused with its
vocabulary projection so that no activation is wider than a slice of tokens times the vocabulary.

PackedMaskedLM stands in for sentence-transformers' Transformer with transformer_task "fill-mask" (and the
legacy MLMTransformer): the body, then the head's transform (dense, activation, LayerNorm) on packed tokens
[T, hidden]. The projection onto the vocabulary is left to PackedSpladePooling, which runs it a slice of tokens
at a time and keeps only each text's running max (or sum) [B, vocab]. Plain sentence-transformers holds the
logits of a padded batch [B, L, vocab], and a masked copy of them, at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sparse_encoder.modules import SpladePooling
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.layers import Linear
from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.engine.weights import CheckpointError, read_tensors
from st_fastbackend.modules.options import task_config
from st_fastbackend.modules.transformer import PackedTransformer

# Logits computed at once: tokens per slice x vocabulary stays under this. On a CPU 64 MiB in fp32, which stays in
# cache while each text's part of the slice is reduced; elsewhere (a GPU) one scatter per slice reduces every text
# in it, and larger slices mean fewer launches (256 MiB in fp32; 256 tokens of XLM-R's 250k vocabulary).
SLICE_ELEMENTS = 1 << 24
SCATTER_SLICE_ELEMENTS = 1 << 26
PER_TEXT_DEVICES = ("cpu",)  # where each text's part of a slice is reduced on its own (tests force the scatter)
PARTS = ("weight", "bias")


@dataclass(frozen=True)
class MaskedLMHead:
    """Where a *ForMaskedLM checkpoint keeps its head, and how its transformers class computes it."""

    dense: str
    norm: str
    decoder: str
    bias: str | None  # the output bias kept beside the decoder (BERT, RoBERTa); None: the decoder's own
    activation: str | None  # the config field naming the activation; None: gelu
    eps: str | None  # the config field of the LayerNorm's epsilon; None: 1e-12
    dense_bias: str | None = None  # config fields that turn biases off (ModernBERT); None: always there
    norm_bias: str | None = None
    decoder_bias: str | None = None


_BERT = MaskedLMHead("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                     "cls.predictions.decoder", "cls.predictions.bias", "hidden_act", "layer_norm_eps")  # fmt: skip
_ROBERTA = MaskedLMHead("lm_head.dense", "lm_head.layer_norm", "lm_head.decoder", "lm_head.bias", None,
                        "layer_norm_eps")  # fmt: skip
MASKED_LM_HEADS = {
    "BertForMaskedLM": _BERT,
    "RobertaForMaskedLM": _ROBERTA,
    "XLMRobertaForMaskedLM": _ROBERTA,
    "DistilBertForMaskedLM": MaskedLMHead("vocab_transform", "vocab_layer_norm", "vocab_projector", None,
                                          "activation", None),
    "ModernBertForMaskedLM": MaskedLMHead("head.dense", "head.norm", "decoder", None, "classifier_activation",
                                          "norm_eps", "classifier_bias", "norm_bias", "decoder_bias"),
}  # fmt: skip


class PackedMaskedLM(PackedTransformer):
    """The body and a masked-LM head's transform: features["token_embeddings"] is [T, hidden] after the
    transform, and features["mlm_head"] the head, whose logits() project rows onto the vocabulary."""

    def __init__(self, model_name_or_path: str, *, transformer_task: str = "fill-mask", **kwargs) -> None:
        if transformer_task != "fill-mask":
            raise UnsupportedModelError(f"A SPLADE Transformer with transformer_task={transformer_task!r}")
        super().__init__(model_name_or_path, **kwargs)

    def load_checkpoint(self, device: torch.device, dtype: torch.dtype) -> None:
        super().load_checkpoint(device, dtype)
        architecture = (self.config.architectures or ["(none)"])[0]
        if architecture not in MASKED_LM_HEADS:
            raise UnsupportedModelError(
                f"A SPLADE model of architecture {architecture} (the fast backend reads the masked-LM heads of "
                f"{', '.join(sorted(MASKED_LM_HEADS))})"
            )
        self.head = _head(MASKED_LM_HEADS[architecture], self.config, self.folder, self.model, device, dtype)

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs) -> PackedMaskedLM:
        init_kwargs = Transformer._load_init_kwargs(model_name_or_path, subfolder=subfolder, **kwargs)
        return cls(model_name_or_path, **task_config(init_kwargs, "fill-mask"))

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), "transformer_task": "fill-mask"}

    def _use(self, runtime) -> None:
        """The body as PackedTransformer sets it up; the head's products in floating point: oneDNN's on a CPU
        where the body's may (its int8 products too), else PyTorch's."""
        super()._use(runtime)
        for layer in self.head.modules():
            if isinstance(layer, Linear):
                layer.product_dtype = self.float_products if self.quantize else runtime.product_dtype

    def get_embedding_dimension(self) -> int:
        return self.config.vocab_size

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        features = super().forward(features, **kwargs)
        features["token_embeddings"] = self.head.transform(features["token_embeddings"])
        features["mlm_head"] = self.head  # its logits() are PackedSpladePooling's, a slice of tokens at a time
        return features


class _Head(nn.Module):
    """The transform and the decoder, both engine Linears: on a CPU their products go through oneDNN on reordered
    weights as the body's do (PackedMaskedLM._use), in floating point also where the body runs int8."""

    def __init__(self, dense: Linear, act, norm: nn.LayerNorm, decoder: Linear) -> None:
        super().__init__()
        self.dense, self.act, self.norm, self.decoder = dense, act, norm, decoder

    @property
    def vocab_size(self) -> int:
        return self.decoder.weight.shape[0]

    def transform(self, h: Tensor) -> Tensor:
        return self.norm(self.act(self.dense(h)))

    def logits(self, rows: Tensor) -> Tensor:
        return self.decoder(rows)  # [n, hidden] -> [n, vocab]


def _head(layout: MaskedLMHead, config: PretrainedConfig, folder, body: nn.Module, device, dtype) -> _Head:
    """The head's tensors from the checkpoint, as its transformers class ties them: the decoder's weight is the
    input embeddings' where the config ties them and the checkpoint leaves it out, its bias the separate output
    bias where the checkpoint keeps only that."""
    names = {f"{module}.{part}" for module in (layout.dense, layout.norm, layout.decoder) for part in PARTS}
    found = read_tensors(folder, names | ({layout.bias} if layout.bias else set()), device, dtype)

    def need(name: str) -> Tensor:
        if name not in found:
            raise CheckpointError(f"Checkpoint in {folder} lacks the masked-LM head's {name}")
        return found[name]

    def has(field: str | None) -> bool:
        return field is None or bool(getattr(config, field))

    hidden = config.hidden_size if hasattr(config, "hidden_size") else config.dim
    dense = Linear(hidden, hidden, bias=has(layout.dense_bias), device=device, dtype=dtype)
    eps = getattr(config, layout.eps) if layout.eps else 1e-12
    norm = nn.LayerNorm(hidden, eps=eps, bias=has(layout.norm_bias), device=device, dtype=dtype)
    with torch.no_grad():
        for module, prefix in ((dense, layout.dense), (norm, layout.norm)):
            module.weight.copy_(need(f"{prefix}.weight"))
            if module.bias is not None:
                module.bias.copy_(need(f"{prefix}.bias"))
    weight = found.get(f"{layout.decoder}.weight")
    if weight is None and getattr(config, "tie_word_embeddings", True):
        weight = next(m.weight for m in body.modules() if isinstance(m, nn.Embedding)
                      and m.num_embeddings == config.vocab_size)  # fmt: skip
    bias = found.get(f"{layout.decoder}.bias", found.get(layout.bias)) if has(layout.decoder_bias) else None
    if weight is None:
        raise CheckpointError(f"Checkpoint in {folder} lacks {layout.decoder}.weight (and ties no embeddings)")
    if has(layout.decoder_bias) and bias is None:
        named = layout.bias or f"{layout.decoder}.bias"
        raise CheckpointError(f"Checkpoint in {folder} lacks the output bias {named}")
    act_name = getattr(config, layout.activation) if layout.activation else "gelu"
    if act_name not in ACT2FN:
        raise UnsupportedModelError(f"The masked-LM head's activation {act_name!r}")
    with torch.device("meta"):
        decoder = Linear(hidden, config.vocab_size, bias=bias is not None)
    decoder.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        decoder.bias = nn.Parameter(bias, requires_grad=False)
    return _Head(dense, ACT2FN[act_name], norm, decoder)


class PackedSpladePooling(SpladePooling):
    """SpladePooling (same config and files) on packed tokens: the vocabulary logits a slice of tokens at a time,
    each text's max (or sum) kept. For max, the activation runs on the pooled [B, vocab] only: relu and log1p
    are monotonic, so the max of the activated logits is the activated max."""

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        if "mlm_head" not in features:
            raise UnsupportedModelError("SpladePooling after a module other than a masked-LM Transformer")
        h, head, packed = features["token_embeddings"], features["mlm_head"], features["packed"]
        # A few kernels per text per slice are cheap on a CPU, with the slice in its cache; on a GPU they would be
        # thousands of launches a pack, so there one scatter per slice reduces all its texts.
        per_text = h.device.type in PER_TEXT_DEVICES
        reduce = _reduce_per_text if per_text else _reduce_per_slice
        step = max(1, (SLICE_ELEMENTS if per_text else SCATTER_SLICE_ELEMENTS) // head.vocab_size)
        step = 1 << (step.bit_length() - 1) if step > 64 else step  # a size the oneDNN product takes unpadded
        pooled = reduce(h, head, packed, step, self.pooling_strategy, self._activate)
        if self.pooling_strategy == "max":
            pooled = self._activate(pooled)
        if self.embedding_dimension is None:
            self.embedding_dimension = pooled.shape[1]
        features["sentence_embedding"] = pooled  # [B, vocab]
        return features

    def _activate(self, x: Tensor) -> Tensor:
        x = x.relu_().log1p_()
        return x.log1p_() if self.activation_function == "log1p_relu" else x


def _reduce_per_text(h: Tensor, head: _Head, packed: PackedBatch, step: int, strategy: str, activate) -> Tensor:
    """[T, hidden] -> [B, vocab]: each slice's logits, each text's part of them reduced into its row (sums
    activated first, max not yet)."""
    lengths, pooled = packed.lengths, None
    sequence, start_of_sequence = 0, 0  # the sequence the slice starts in, and where that sequence starts
    for start in range(0, h.shape[0], step):
        rows = head.logits(h[start : start + step])  # [n, vocab]
        if pooled is None:
            fill = float("-inf") if strategy == "max" else 0.0
            pooled = torch.full((len(lengths), rows.shape[1]), fill, dtype=rows.dtype, device=rows.device)
        if strategy == "sum":
            rows = activate(rows)
        end = start + rows.shape[0]
        while sequence < len(lengths) and start_of_sequence < end:
            stop = start_of_sequence + lengths[sequence]
            part = rows[max(start_of_sequence, start) - start : min(stop, end) - start]
            if strategy == "max":  # (no out=: forward_sequences may run with gradients on)
                pooled[sequence] = torch.maximum(pooled[sequence], part.amax(dim=0))
            else:
                pooled[sequence] = pooled[sequence] + part.sum(dim=0)
            if stop > end:  # the sequence goes on in the next slice
                break
            sequence, start_of_sequence = sequence + 1, stop
    return pooled


def _reduce_per_slice(h: Tensor, head: _Head, packed: PackedBatch, step: int, strategy: str, activate) -> Tensor:
    """As _reduce_per_text, with one scatter over the tokens' sequence ids per slice, whatever the number of texts
    in it. Sums accumulate in fp32 (a bf16 buffer would round at every token) and end in the logits' dtype."""
    sequence_ids, pooled = packed.sequence_ids(), None  # [T]
    for start in range(0, h.shape[0], step):
        rows = head.logits(h[start : start + step])  # [n, vocab]
        ids = sequence_ids[start : start + rows.shape[0]]  # [n]
        if pooled is None:
            dtype = rows.dtype if strategy == "max" else torch.float32
            fill = float("-inf") if strategy == "max" else 0.0
            pooled = torch.full((packed.num_sequences, rows.shape[1]), fill, dtype=dtype, device=rows.device)
        if strategy == "max":
            pooled.scatter_reduce_(0, ids[:, None].expand_as(rows), rows, reduce="amax")  # [n, vocab] -> [B, vocab]
        else:
            pooled.index_add_(0, ids, activate(rows).float())
    return pooled.to(rows.dtype)
