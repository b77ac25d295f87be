"""Llama, Mistral, Qwen2, Qwen3 and Gemma 3 as one packed decoder; the family differences are DecoderSpec flags.

Activations are flat, [T, hidden] between layers and [T, heads, head_dim] inside attention. No KV
cache, no LM head, no padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from st_fastbackend.engine.attention import varlen_attention
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.fused import seams
from st_fastbackend.engine.layers import Linear, RMSNorm, Rotary
from st_fastbackend.engine.prefix import LayerKV, Prefix, prefixed_attention
from st_fastbackend.engine.runtime import Runtime
from st_fastbackend.engine.spec import DecoderSpec

# Checkpoint tensor -> (our fused tensor, slot): q/k/v and gate/up are each one matrix product.
DECODER_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
DECODER_IGNORED = ("lm_head.",)  # in *ForCausalLM checkpoints; embeddings never reach it
# Each layer's norms: (before attention, on its output, before the MLP, on its output); "" where there is none.
PRE_NORMS = ("input_layernorm", "", "post_attention_layernorm", "")  # Llama: before each sublayer
SANDWICH_NORMS = (  # Gemma: before and after each sublayer
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.window, self.causal, self.scale = window, spec.causal, spec.attention_scale
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.norm_eps, spec.norm_offset) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.norm_eps, spec.norm_offset) if spec.qk_norm else None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, batch: PackedBatch, runtime: Runtime, kv: LayerKV | None
    ) -> Tensor:
        """`kv`: this layer's part of a prompt computed once (engine/prefix.py): kept by the prefix pass,
        attended to by the texts after it."""
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        qk_norm = None if self.q_norm is None else (self.q_norm.weight, *self.k_norm.parts)  # Qwen3, Gemma 3
        # [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k and v [T, Hkv, D], q and k normed per head and rotated
        q, k, v = seams(runtime.fused).split_rotate(self.qkv_proj(x), cos, sin, heads, qk_norm)
        if kv is not None and kv.keys is not None:  # texts after a prompt computed once
            out = prefixed_attention(q, k, v, batch, kv, window=self.window, runtime=runtime, scale=self.scale)
        else:
            if kv is not None:  # the prompt's own pass: its keys and values serve every text after it
                kv.keys, kv.values = k, v
            out = varlen_attention(
                q, k, v, batch, causal=self.causal, window=self.window, runtime=runtime, scale=self.scale
            )
        return self.o_proj(out.flatten(1))  # [T, Hq, D] -> [T, Hq*D] -> [T, hidden]


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.hidden_act = spec.hidden_act

    def forward(self, x: Tensor, runtime: Runtime) -> Tensor:
        return self.down_proj(self.gate_up_proj.gated(x, self.hidden_act, runtime.fused))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, window: int | None) -> None:
        super().__init__()
        self.norm_names = SANDWICH_NORMS if spec.sandwich_norms else PRE_NORMS
        for name in filter(None, self.norm_names):
            setattr(self, name, RMSNorm(spec.hidden_size, spec.norm_eps, spec.norm_offset))
        self.self_attn = Attention(spec, window)
        self.mlp = MLP(spec)

    @property
    def input_norm(self) -> RMSNorm:
        return getattr(self, self.norm_names[0])

    def forward(
        self, h: Tensor, x: Tensor, next_norm: RMSNorm, cos: Tensor, sin: Tensor, batch: PackedBatch,
        runtime: Runtime, kv: LayerKV | None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """(residual stream h, its input norm x) -> (h after this layer, `next_norm` of it): each residual
        add is one seam with the norms around it (engine/fused.py)."""
        _, attn_out, mlp_in, mlp_out = self.norm_names
        out_weights = [getattr(self, name).weight if name else None for name in (attn_out, mlp_out)]  # Gemma's
        seam = seams(runtime.fused).residual_rms
        a = self.self_attn(x, cos, sin, batch, runtime, kv)
        h, x = seam(h, a, out_weights[0], *getattr(self, mlp_in).parts)
        return seam(h, self.mlp(x, runtime), out_weights[1], *next_norm.parts)


class Decoder(nn.Module):
    fused = DECODER_FUSED
    ignored = DECODER_IGNORED
    prefixes = ("model.",)  # *ForCausalLM checkpoints nest the decoder
    position_offset = 0

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, window) for window in spec.windows)
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps, spec.norm_offset)
        self.rotary = nn.ModuleDict({key: Rotary(*table) for key, table in spec.rotaries.items()})

    def forward(self, batch: PackedBatch, runtime: Runtime, prefix: Prefix | None = None) -> Tensor:
        """Token ids [T] -> final hidden states [T, hidden]. With a computed `prefix` (prefix_pass): the texts after
        it, at positions after it, attending to its keys too."""
        if prefix is None:
            return self._layers(batch, runtime, [None] * len(self.layers), before=0)
        if not prefix.computed:
            raise ValueError("A prefix must be computed (prefix_pass) before the texts after it run.")
        return self._layers(batch, runtime, prefix.layers, before=prefix.length)

    def prefix_pass(self, prefix: Prefix, batch: PackedBatch, runtime: Runtime) -> Prefix:
        """The prefix's own pass (`batch`: its tokens alone): the computed Prefix, each layer's keys and values and
        the final states kept for every text after it."""
        layers = tuple(LayerKV() for _ in self.layers)
        states = self._layers(batch, runtime, layers, before=0)  # [P, hidden]
        return replace(prefix, layers=layers, states=states)

    def _layers(self, batch: PackedBatch, runtime: Runtime, kvs: Sequence[LayerKV | None], before: int) -> Tensor:
        """`kvs`: per layer, None, or the prefix's keys and values (filled by this pass if empty, else read);
        `before`: tokens computed before the pack's (a prefix's), for the position limit."""
        limit = self.spec.max_rope_positions
        if limit is not None and before + batch.max_seqlen > limit:
            raise ValueError(
                f"A {before + batch.max_seqlen}-token sequence exceeds max_position_embeddings={limit}, past "
                "which dynamic NTK rotary rescales per batch in Hugging Face; lower max_seq_length."
            )
        h = self.embed_tokens(batch.input_ids)  # [T, hidden]
        if self.spec.embed_scale is not None:  # Gemma: the factor in the model dtype, as transformers has it
            h = h * torch.tensor(self.spec.embed_scale, dtype=h.dtype)
        tables = {key: rotary(batch.position_ids, h.dtype) for key, rotary in self.rotary.items()}  # [T, D] pairs
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        x = seams(runtime.fused).rms_norm(h, *self.layers[0].input_norm.parts)
        for layer, key, kv, next_norm in zip(self.layers, self.spec.layer_rotaries, kvs, next_norms, strict=True):
            h, x = layer(h, x, next_norm, *tables[key], batch, runtime, kv)
        return x  # the final norm of h
