"""BERT, RoBERTa and XLM-RoBERTa as one packed bidirectional encoder (post-LayerNorm, learned positions).

Module names follow transformers' BertModel, so checkpoints load by name; query/key/value are fused.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from st_fastbackend.engine.attention import Kernel, varlen_attention
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.spec import UnsupportedModelError

# model_type -> whether positions start after the padding index (RoBERTa's create_position_ids_from_input_ids).
ENCODER_FAMILIES = {"bert": False, "roberta": True, "xlm-roberta": True}
ENCODER_FUSED = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
# Heads and buffers some checkpoints carry that embeddings never use.
ENCODER_IGNORED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")


@dataclass(frozen=True)
class EncoderSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    norm_eps: float
    hidden_act: str
    max_positions: int
    type_vocab_size: int
    position_offset: int  # first position id: 0 for BERT, padding_idx + 1 for RoBERTa

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> EncoderSpec:
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(f"position_embedding_type {config.position_embedding_type!r}")
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise UnsupportedModelError("A BERT-family model configured as a decoder (is_decoder/add_cross_attention)")
        if config.hidden_act not in ACT2FN:
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r}")
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            norm_eps=config.layer_norm_eps,
            hidden_act=config.hidden_act,
            max_positions=config.max_position_embeddings,
            type_vocab_size=config.type_vocab_size,
            position_offset=config.pad_token_id + 1 if ENCODER_FAMILIES[config.model_type] else 0,
        )


class Embeddings(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.position_embeddings = nn.Embedding(spec.max_positions, spec.hidden_size)
        self.token_type_embeddings = nn.Embedding(spec.type_vocab_size, spec.hidden_size)
        self.LayerNorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)

    def forward(self, batch: PackedBatch) -> Tensor:
        # Single texts have token type 0 everywhere, as plain sentence-transformers sends them.
        h = self.word_embeddings(batch.input_ids) + self.token_type_embeddings.weight[0]  # [T, hidden]
        return self.LayerNorm(h + self.position_embeddings(batch.position_ids))


class SelfAttention(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.hidden_size // spec.num_heads
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size)

    def forward(self, h: Tensor, batch: PackedBatch, kernel: Kernel) -> Tensor:
        q, k, v = self.qkv(h).view(-1, 3, self.num_heads, self.head_dim).unbind(1)  # [T, 3H] -> 3 x [T, heads, D]
        out = varlen_attention(q, k, v, batch, causal=False, window=None, kernel=kernel)
        return out.flatten(1)  # [T, heads, D] -> [T, hidden]


class DenseResidualNorm(nn.Module):
    """BERT's post-LayerNorm sublayer output: LayerNorm(dense(x) + residual)."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class AttentionBlock(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.self = SelfAttention(spec)
        self.output = DenseResidualNorm(spec.hidden_size, spec.hidden_size, spec.norm_eps)


class Intermediate(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.dense = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.act = ACT2FN[spec.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.dense(x))


class EncoderLayer(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.attention = AttentionBlock(spec)
        self.intermediate = Intermediate(spec)
        self.output = DenseResidualNorm(spec.intermediate_size, spec.hidden_size, spec.norm_eps)

    def forward(self, h: Tensor, batch: PackedBatch, kernel: Kernel) -> Tensor:
        h = self.attention.output(self.attention.self(h, batch, kernel), h)
        return self.output(self.intermediate(h), h)


class LayerStack(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(spec) for _ in range(spec.num_layers))


class Encoder(nn.Module):
    fused = ENCODER_FUSED
    ignored = ENCODER_IGNORED
    prefixes = ("bert.", "roberta.")  # *ForMaskedLM and similar checkpoints nest the encoder

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embeddings = Embeddings(spec)
        self.encoder = LayerStack(spec)

    @property
    def position_offset(self) -> int:
        return self.spec.position_offset

    def forward(self, batch: PackedBatch, kernel: Kernel) -> Tensor:
        """Token ids [T] -> last hidden states [T, hidden]."""
        h = self.embeddings(batch)
        for layer in self.encoder.layer:
            h = layer(h, batch, kernel)
        return h
