"""What the engine needs to know about a model, read from its transformers config.

Anything in a config that would change the math and that the engine does not implement raises
UnsupportedModelError naming it; the engine never silently computes something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class UnsupportedModelError(ValueError):
    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} is not supported by the fast backend. "
            'Load the model with backend="torch" to use the Hugging Face implementation.'
        )


# What a decoder family's flags (engine/families.py) do not say: Llama's.
DECODER_DEFAULTS = dict(norm_offset=False, sandwich_norms=False, scaled_embeddings=False, bidirectional=False)
# Families trained in bf16 whose activations overflow fp16's range (inf/NaN embeddings); their authors
# advise bf16 (QwenLM/Qwen3#868, #761; EmbeddingGemma's model card: no float16). fp16 only when asked by name.
FP16_OVERFLOWS = ("qwen2", "qwen3", "gemma3_text")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# transformers' modeling_distilbert.py builds every LayerNorm with eps=1e-12; DistilBertConfig has no such field.
DISTILBERT_NORM_EPS = 1e-12
LAYER_TYPES = ("full_attention", "sliding_attention")
Rotaries = dict[str, tuple[torch.Tensor, float]]  # layer type -> (fp32 inv_freq [head_dim / 2], cos/sin factor)


@dataclass(frozen=True)
class Widths:
    """What every family's spec states: its type, vocabulary, widths, depth, heads, norm epsilon, activation."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    norm_eps: float
    hidden_act: str

    @staticmethod
    def read(config: PretrainedConfig, norm_eps: float, hidden_act: str) -> dict[str, Any]:
        """The fields every Hugging Face config names the same way, and the two each family names its own."""
        return dict(model_type=config.model_type, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                    num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                    intermediate_size=mlp_width(config), norm_eps=norm_eps, hidden_act=hidden_act)  # fmt: skip


def mlp_width(config: PretrainedConfig) -> int:
    """config.intermediate_size, which DistilBertConfig alone names hidden_dim (its attribute_map maps the rest)."""
    return config.hidden_dim if getattr(config, "model_type", None) == "distilbert" else config.intermediate_size


@dataclass(frozen=True)
class DecoderSpec(Widths):  # hidden_act: the gate's activation in act(gate) * up
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    norm_offset: bool  # RMSNorm times (1 + weight): Gemma
    sandwich_norms: bool  # a norm on each sublayer's output too (Gemma's post_attention/post_feedforward)
    embed_scale: float | None  # embeddings times this, rounded to the model dtype first (Gemma: sqrt(hidden))
    causal: bool
    attention_scale: float | None  # softmax scale; None: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-0.5)
    windows: tuple[int | None, ...]  # per layer: the sliding window (attention.py's rule), or None
    rotaries: Rotaries  # per rotary table, by layer type ("default" where one table serves every layer)
    layer_rotaries: tuple[str, ...]  # per layer: its key in `rotaries`
    max_rope_positions: int | None  # dynamic NTK rotary: Hugging Face rescales beyond this length

    @classmethod
    def from_config(cls, config: PretrainedConfig, **family_flags: bool | str) -> DecoderSpec:
        """`family_flags`: the family's (engine/families.py), each True/False or the config field that decides."""
        stated = {**DECODER_DEFAULTS, **family_flags}
        flags = {name: bool(getattr(config, v, False)) if isinstance(v, str) else v for name, v in stated.items()}
        hidden_act = getattr(config, "hidden_act", None) or config.hidden_activation  # Gemma: hidden_activation
        if hidden_act not in ACT2FN:
            raise UnsupportedModelError(f"hidden_act {hidden_act!r}")
        if getattr(config, "is_causal", True) is False:
            raise UnsupportedModelError("A bidirectional decoder (is_causal=false)")
        if getattr(config, "attn_logit_softcapping", None) is not None:  # Gemma 2's; Gemma 3 configs set None
            raise UnsupportedModelError(f"attn_logit_softcapping={config.attn_logit_softcapping}")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        scalar = getattr(config, "query_pre_attn_scalar", None)
        rotaries, layer_rotaries, dynamic = _rotaries(config, head_dim)
        return cls(
            **Widths.read(config, config.rms_norm_eps, hidden_act),
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            qkv_bias=flags["qkv_bias"],
            o_bias=flags["o_bias"],
            mlp_bias=flags["mlp_bias"],
            qk_norm=flags["qk_norm"],
            norm_offset=flags["norm_offset"],
            sandwich_norms=flags["sandwich_norms"],
            embed_scale=config.hidden_size**0.5 if flags["scaled_embeddings"] else None,
            causal=not flags["bidirectional"],
            attention_scale=scalar**-0.5 if scalar is not None and scalar != head_dim else None,
            windows=_layer_windows(config),
            rotaries=rotaries,
            layer_rotaries=layer_rotaries,
            max_rope_positions=config.max_position_embeddings if dynamic else None,
        )


@dataclass(frozen=True)
class EncoderSpec(Widths):
    max_positions: int
    type_vocab_size: int  # 0: no token type embeddings (DistilBERT)
    position_offset: int  # first position id: 0 for BERT, padding_idx + 1 for RoBERTa

    @classmethod
    def from_config(cls, config: PretrainedConfig, *, positions_after_padding: bool) -> EncoderSpec:
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(f"position_embedding_type {config.position_embedding_type!r}")
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise UnsupportedModelError("A BERT-family model configured as a decoder (is_decoder/add_cross_attention)")
        # DistilBERT's sinusoidal_pos_embds only initializes position_embeddings.weight, which the checkpoint
        # stores and transformers loads as stored: the learned-positions path reads it the same.
        distil = config.model_type == "distilbert"
        act_field = "activation" if distil else "hidden_act"
        hidden_act = getattr(config, act_field)
        if hidden_act not in ACT2FN:
            raise UnsupportedModelError(f"{act_field} {hidden_act!r}")
        norm_eps = DISTILBERT_NORM_EPS if distil else config.layer_norm_eps
        return cls(
            **Widths.read(config, norm_eps, hidden_act),
            max_positions=config.max_position_embeddings,
            type_vocab_size=0 if distil else config.type_vocab_size,
            position_offset=config.pad_token_id + 1 if positions_after_padding else 0,
        )


@dataclass(frozen=True)
class ModernBertSpec(Widths):  # hidden_act: the gate's activation in act(input) * gate (GeGLU: gelu)
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    windows: tuple[int | None, ...]  # per layer: local_attention // 2 + 1 (attention.py's rule), or None
    rotaries: Rotaries
    layer_rotaries: tuple[str, ...]

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModernBertSpec:
        if config.hidden_activation not in ACT2FN:
            raise UnsupportedModelError(f"hidden_activation {config.hidden_activation!r}")
        if unknown := set(config.layer_types) - set(LAYER_TYPES):
            raise UnsupportedModelError(f"layer_types {sorted(unknown)}")
        head_dim = config.hidden_size // config.num_attention_heads
        rotaries, layer_rotaries, dynamic = _rotaries(config, head_dim)
        if dynamic:
            raise UnsupportedModelError("dynamic rope in a ModernBERT")
        # transformers: |q - kv| <= local_attention // 2 (sliding_window_bidirectional_overlay)
        window = config.local_attention // 2 + 1
        return cls(
            **Widths.read(config, config.norm_eps, config.hidden_activation),
            norm_bias=config.norm_bias,
            attention_bias=config.attention_bias,
            mlp_bias=config.mlp_bias,
            windows=tuple(window if kind == "sliding_attention" else None for kind in config.layer_types),
            rotaries=rotaries,
            layer_rotaries=layer_rotaries,
        )


def _rotaries(config: PretrainedConfig, head_dim: int) -> tuple[Rotaries, tuple[str, ...], bool]:
    """The rotary tables, which one each layer takes, and whether one is dynamic NTK. Gemma 3 and ModernBERT
    key `rope_parameters` by layer type (a θ for sliding layers, another for full ones)."""
    params = config.rope_parameters or {}
    if set(params) <= set(LAYER_TYPES) and params:
        keys = tuple(config.layer_types)
        tables = {key: _rotary(config, head_dim, params[key], key) for key in sorted(set(keys))}
    else:
        keys = ("default",) * config.num_hidden_layers
        tables = {"default": _rotary(config, head_dim, params, None)}
    rotaries = {key: (inv_freq, scaling) for key, (inv_freq, scaling, _) in tables.items()}
    return rotaries, keys, any(rope_type == "dynamic" for _, _, rope_type in tables.values())


def _rotary(
    config: PretrainedConfig, head_dim: int, params: dict, layer_type: str | None
) -> tuple[torch.Tensor, float, str]:
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {params['partial_rotary_factor']}")
    if rope_type == "default":  # transformers' compute_default_rope_parameters, same float32 formula
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0, rope_type
    # Dynamic NTK starts from the unscaled table and only changes past max_position_embeddings.
    options = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **options)
    return inv_freq, float(scaling), rope_type


def _layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or config.model_type == "mistral":  # Mistral slides in every layer when set
        return (window,) * config.num_hidden_layers
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer_types {sorted(unknown)}")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
