"""What the engine needs to know about a model, read from its transformers config.

Anything in a config that would change the math and that the engine does not implement raises
UnsupportedModelError naming it; the engine never silently computes something else.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# Decoder families differ only in these flags: True/False, or the config field that decides.
DECODER_FAMILIES: dict[str, dict[str, bool | str]] = {
    "llama": dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias", qk_norm=False),
    "mistral": dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen3": dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=True),
}
# Families trained in bf16 whose activations overflow fp16's range (inf/NaN embeddings); their authors
# advise bf16 (QwenLM/Qwen3#868, #761). fp16 only when asked for by name.
FP16_OVERFLOWS = ("qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# model_type -> whether positions start after the padding index (RoBERTa's create_position_ids_from_input_ids).
ENCODER_FAMILIES = {"bert": False, "roberta": True, "xlm-roberta": True}


@dataclass(frozen=True)
class DecoderSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    windows: tuple[int | None, ...]  # per layer: the sliding window, or None for full causal attention
    inv_freq: torch.Tensor  # [head_dim / 2] fp32 rotary frequencies
    rope_scaling: float  # multiplies cos and sin (yarn's attention factor; 1.0 otherwise)
    max_rope_positions: int | None  # dynamic NTK rotary: Hugging Face rescales beyond this length

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> DecoderSpec:
        family = DECODER_FAMILIES[config.model_type]
        flags = {name: getattr(config, v, False) if isinstance(v, str) else v for name, v in family.items()}
        if config.hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r}")
        if getattr(config, "is_causal", True) is False:
            raise UnsupportedModelError("A bidirectional decoder (is_causal=false)")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        inv_freq, rope_scaling, rope_type = _rotary(config, head_dim)
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            norm_eps=config.rms_norm_eps,
            windows=_layer_windows(config),
            inv_freq=inv_freq,
            rope_scaling=rope_scaling,
            max_rope_positions=config.max_position_embeddings if rope_type == "dynamic" else None,
            **flags,
        )


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


def _rotary(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float, str]:
    params = dict(config.rope_parameters or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {params['partial_rotary_factor']}")
    if rope_type == "default":  # transformers' compute_default_rope_parameters, same float32 formula
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0, rope_type
    # Dynamic NTK starts from the unscaled table and only changes past max_position_embeddings.
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
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
