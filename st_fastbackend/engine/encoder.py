"""BERT, RoBERTa and XLM-RoBERTa as one packed bidirectional encoder (post-LayerNorm, learned positions).

Module names follow transformers' BertModel, so checkpoints load by name; query/key/value are fused.
"""

from __future__ import annotations

from torch import Tensor, nn

from st_fastbackend.engine.attention import varlen_attention
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.layers import Linear
from st_fastbackend.engine.runtime import Runtime
from st_fastbackend.engine.spec import EncoderSpec

ENCODER_FUSED = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
# Heads and buffers some checkpoints carry that embeddings never use.
ENCODER_IGNORED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")


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
        self.qkv = Linear(spec.hidden_size, 3 * spec.hidden_size)

    def forward(self, h: Tensor, batch: PackedBatch, runtime: Runtime) -> Tensor:
        q, k, v = self.qkv(h).view(-1, 3, self.num_heads, self.head_dim).unbind(1)  # [T, 3H] -> 3 x [T, heads, D]
        out = varlen_attention(q, k, v, batch, causal=False, window=None, runtime=runtime)
        return out.flatten(1)  # [T, heads, D] -> [T, hidden]


class DenseResidualNorm(nn.Module):
    """BERT's post-LayerNorm sublayer output: LayerNorm(dense(x) + residual)."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(d_in, d_out)
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
        self.dense = Linear(spec.hidden_size, spec.intermediate_size)
        self.hidden_act = spec.hidden_act

    def forward(self, x: Tensor) -> Tensor:
        return self.dense.act(x, self.hidden_act)


class EncoderLayer(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.attention = AttentionBlock(spec)
        self.intermediate = Intermediate(spec)
        self.output = DenseResidualNorm(spec.intermediate_size, spec.hidden_size, spec.norm_eps)

    def forward(self, h: Tensor, batch: PackedBatch, runtime: Runtime) -> Tensor:
        h = self.attention.output(self.attention.self(h, batch, runtime), h)
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

    def forward(self, batch: PackedBatch, runtime: Runtime) -> Tensor:
        """Token ids [T] -> last hidden states [T, hidden]."""
        if batch.max_seqlen + self.position_offset > self.spec.max_positions:
            # Checked on the host: on a GPU the out-of-range lookup is a device-side assert that breaks
            # every later call of the process, not an error of this batch alone.
            raise ValueError(
                f"A {batch.max_seqlen}-token sequence exceeds the model's {self.spec.max_positions} position "
                "embeddings; lower max_seq_length."
            )
        h = self.embeddings(batch)
        for layer in self.encoder.layer:
            h = layer(h, batch, runtime)
        return h
