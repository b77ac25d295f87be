"""BERT, RoBERTa and XLM-RoBERTa as one packed bidirectional encoder (post-LayerNorm, learned positions), and
DistilBERT as the same encoder under its own names; ModernBERT as a second (pre-LayerNorm, rotary positions,
alternating global and local attention, GeGLU).

Module names follow transformers' BertModel, DistilBertModel and ModernBertModel, so checkpoints load by name;
BERT's and DistilBERT's query/key/value are fused (ModernBERT's checkpoints hold them fused already).
"""

from __future__ import annotations

from torch import Tensor, nn

from st_fastbackend.engine.attention import varlen_attention
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.fused import seams
from st_fastbackend.engine.layers import Linear, Rotary
from st_fastbackend.engine.runtime import Runtime
from st_fastbackend.engine.spec import EncoderSpec, ModernBertSpec

ENCODER_FUSED = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
# Heads and buffers some checkpoints carry that embeddings never use.
ENCODER_IGNORED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")


class Embeddings(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.position_embeddings = nn.Embedding(spec.max_positions, spec.hidden_size)
        types = nn.Embedding(spec.type_vocab_size, spec.hidden_size) if spec.type_vocab_size else None
        self.token_type_embeddings = types  # None: DistilBERT, whose model takes no token_type_ids
        self.LayerNorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)

    def forward(self, batch: PackedBatch) -> Tensor:
        h = self.word_embeddings(batch.input_ids)  # [T, hidden]
        if self.token_type_embeddings is not None:
            h = h + self._token_types(batch)
        return self.LayerNorm(h + self.position_embeddings(batch.position_ids))

    def _token_types(self, batch: PackedBatch) -> Tensor:
        # Single texts have token type 0 everywhere, as plain sentence-transformers sends them; a pair's
        # second text is segment 1 (BERT's cross-encoders).
        if batch.token_type_ids is None:
            return self.token_type_embeddings.weight[0]  # [hidden], broadcast
        return self.token_type_embeddings(batch.token_type_ids)  # [T, hidden]


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

    def forward(self, x: Tensor, residual: Tensor, runtime: Runtime) -> Tensor:
        return add_norm(self.dense(x), residual, self.LayerNorm, runtime)


def add_norm(x: Tensor, residual: Tensor, norm: nn.LayerNorm, runtime: Runtime) -> Tensor:
    """norm(x + residual), one seam (engine/fused.py)."""
    return seams(runtime.fused).add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)


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
        h = self.attention.output(self.attention.self(h, batch, runtime), h, runtime)
        return self.output(self.intermediate(h), h, runtime)


class DistilBertAttention(SelfAttention):
    """DistilBERT's attention block: BERT's self-attention with its output product (out_lin) beside q/k/v."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__(spec)
        self.out_lin = Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, h: Tensor, batch: PackedBatch, runtime: Runtime) -> Tensor:
        return self.out_lin(super().forward(h, batch, runtime))


class DistilBertFFN(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.lin1 = Linear(spec.hidden_size, spec.intermediate_size)
        self.lin2 = Linear(spec.intermediate_size, spec.hidden_size)
        self.hidden_act = spec.hidden_act

    def forward(self, x: Tensor) -> Tensor:
        return self.lin2(self.lin1.act(x, self.hidden_act))


class DistilBertLayer(nn.Module):
    """transformers' DistilBERT TransformerBlock: EncoderLayer's math under DistilBERT's names."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.attention = DistilBertAttention(spec)
        self.sa_layer_norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.ffn = DistilBertFFN(spec)
        self.output_layer_norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)

    def forward(self, h: Tensor, batch: PackedBatch, runtime: Runtime) -> Tensor:
        h = add_norm(self.attention(h, batch, runtime), h, self.sa_layer_norm, runtime)
        return add_norm(self.ffn(h), h, self.output_layer_norm, runtime)


class LayerStack(nn.Module):
    def __init__(self, spec: EncoderSpec, layer_class: type[nn.Module]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(layer_class(spec) for _ in range(spec.num_layers))


class Encoder(nn.Module):
    fused = ENCODER_FUSED
    ignored = ENCODER_IGNORED
    prefixes = ("bert.", "roberta.")  # *ForMaskedLM and similar checkpoints nest the encoder
    stack, layer_class = "encoder", EncoderLayer  # where transformers keeps the layers, and what each one is

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embeddings = Embeddings(spec)
        self.add_module(self.stack, LayerStack(spec, self.layer_class))

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
        for layer in getattr(self, self.stack).layer:
            h = layer(h, batch, runtime)
        return h


class DistilBert(Encoder):
    """DistilBertModel: the encoder above without token types, under DistilBERT's names."""

    fused = {"q_lin": ("qkv", 0), "k_lin": ("qkv", 1), "v_lin": ("qkv", 2)}
    # DistilBertForMaskedLM's head (modules/ reads it on its own) and a buffer some checkpoints carry.
    ignored = ("vocab_transform.", "vocab_layer_norm.", "vocab_projector.", "embeddings.position_ids")
    prefixes = ("distilbert.",)
    stack, layer_class = "transformer", DistilBertLayer


class ModernBertEmbeddings(nn.Module):
    def __init__(self, spec: ModernBertSpec) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, bias=spec.norm_bias)

    def forward(self, batch: PackedBatch) -> Tensor:
        return self.norm(self.tok_embeddings(batch.input_ids))  # [T, hidden]


class ModernBertAttention(nn.Module):
    def __init__(self, spec: ModernBertSpec, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.window = spec.num_heads, spec.hidden_size // spec.num_heads, window
        self.Wqkv = Linear(spec.hidden_size, 3 * spec.hidden_size, bias=spec.attention_bias)
        self.Wo = Linear(spec.hidden_size, spec.hidden_size, bias=spec.attention_bias)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, batch: PackedBatch, runtime: Runtime) -> Tensor:
        heads = (self.num_heads, self.num_heads, self.head_dim)
        # [T, 3H] -> 3 x [T, heads, D], q and k rotated
        q, k, v = seams(runtime.fused).split_rotate(self.Wqkv(h), cos, sin, heads, None)
        out = varlen_attention(q, k, v, batch, causal=False, window=self.window, runtime=runtime)
        return self.Wo(out.flatten(1))  # [T, heads, D] -> [T, hidden]


class ModernBertMLP(nn.Module):
    def __init__(self, spec: ModernBertSpec) -> None:
        super().__init__()
        self.Wi = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.Wo = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.hidden_act = spec.hidden_act

    def forward(self, x: Tensor, runtime: Runtime) -> Tensor:
        return self.Wo(self.Wi.gated(x, self.hidden_act, runtime.fused))  # act(input) * gate, the halves of Wi


class ModernBertLayer(nn.Module):
    def __init__(self, spec: ModernBertSpec, index: int) -> None:
        super().__init__()
        # The first layer reads the embedding norm's output: no norm of its own before attention.
        norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, bias=spec.norm_bias)
        self.attn_norm = nn.Identity() if index == 0 else norm
        self.attn = ModernBertAttention(spec, spec.windows[index])
        self.mlp_norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, bias=spec.norm_bias)
        self.mlp = ModernBertMLP(spec)

    def forward(
        self, h: Tensor, x: Tensor, next_norm: nn.LayerNorm, cos: Tensor, sin: Tensor, batch: PackedBatch,
        runtime: Runtime,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """(residual stream h, its input norm x) -> (h after this layer, `next_norm` of it), each residual add
        one seam with the norm after it (engine/fused.py)."""
        seam = seams(runtime.fused).residual_layer_norm
        a = self.attn(x, cos, sin, batch, runtime)
        h, x = seam(h, a, self.mlp_norm.weight, self.mlp_norm.bias, self.mlp_norm.eps)
        return seam(h, self.mlp(x, runtime), next_norm.weight, next_norm.bias, next_norm.eps)


class ModernBert(nn.Module):
    fused: dict = {}
    ignored = ("head.", "decoder.")  # ModernBertForMaskedLM's
    prefixes = ("model.",)
    position_offset = 0

    def __init__(self, spec: ModernBertSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embeddings = ModernBertEmbeddings(spec)
        self.layers = nn.ModuleList(ModernBertLayer(spec, i) for i in range(spec.num_layers))
        self.final_norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, bias=spec.norm_bias)
        self.rotary = nn.ModuleDict({key: Rotary(*table) for key, table in spec.rotaries.items()})

    def forward(self, batch: PackedBatch, runtime: Runtime) -> Tensor:
        """Token ids [T] -> last hidden states [T, hidden]."""
        h = self.embeddings(batch)  # the first layer's input, normed: it has no norm of its own
        tables = {key: rotary(batch.position_ids, h.dtype) for key, rotary in self.rotary.items()}  # [T, D] pairs
        next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.final_norm]
        x = h
        for layer, key, next_norm in zip(self.layers, self.spec.layer_rotaries, next_norms, strict=True):
            h, x = layer(h, x, next_norm, *tables[key], batch, runtime)
        return x  # the final norm of h
