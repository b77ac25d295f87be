"""Every model family the fast backend runs, as one table: model_type -> the spec that reads its config (with the
family's flags), the engine that runs it, and what it can do. engine/registry.py builds engines from it, the modules
read a model's capabilities from its family instead of asking which class its engine is, and the tests parametrize
over it."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from st_fastbackend.engine.decoder import Decoder
from st_fastbackend.engine.encoder import DistilBert, Encoder, ModernBert
from st_fastbackend.engine.spec import DecoderSpec, EncoderSpec, ModernBertSpec


@dataclass(frozen=True)
class Family:
    spec: type[DecoderSpec | EncoderSpec | ModernBertSpec]  # reads a config, refusing what the engine lacks
    engine: type[nn.Module]
    # A decoder: causal attention (unless its config turns it off, as EmbeddingGemma's does), so a prompt's keys and
    # values can serve every text after it, a *ForCausalLM checkpoint can score pairs (LogitScore), and no token can
    # be kept out of the keys (ColBERT's query expansion with attend=False).
    causal: bool = False
    token_types: bool = False  # its transformers forward takes token type ids (a pair's second text is segment 1)
    flags: dict[str, bool | str] = field(default_factory=dict)  # the spec's own, keyword arguments of from_config


def _decoder(**flags: bool | str) -> Family:
    """A decoder family, its differences DecoderSpec flags: True/False, or the config field that decides."""
    return Family(DecoderSpec, Decoder, causal=True, flags=flags)


FAMILIES: dict[str, Family] = {
    "mistral": _decoder(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "llama": _decoder(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias", qk_norm=False),
    "qwen2": _decoder(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen3": _decoder(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=True),
    # Gemma 3 (transformers' Gemma3TextModel): every norm times (1 + weight), norms after the attention and
    # the MLP too, embeddings times sqrt(hidden); EmbeddingGemma sets use_bidirectional_attention.
    "gemma3_text": _decoder(
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=True,
        norm_offset=True, sandwich_norms=True, scaled_embeddings=True, bidirectional="use_bidirectional_attention",
    ),
    # positions_after_padding: RoBERTa's create_position_ids_from_input_ids starts at padding_idx + 1.
    "bert": Family(EncoderSpec, Encoder, token_types=True, flags=dict(positions_after_padding=False)),
    "roberta": Family(EncoderSpec, Encoder, token_types=True, flags=dict(positions_after_padding=True)),
    "xlm-roberta": Family(EncoderSpec, Encoder, token_types=True, flags=dict(positions_after_padding=True)),
    "distilbert": Family(EncoderSpec, DistilBert, flags=dict(positions_after_padding=False)),
    "modernbert": Family(ModernBertSpec, ModernBert),
}  # fmt: skip
