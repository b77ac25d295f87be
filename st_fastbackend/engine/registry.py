"""model_type -> the engine that runs it; anything else is refused by name."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from st_fastbackend.engine.decoder import Decoder
from st_fastbackend.engine.encoder import ENCODER_CLASSES, Encoder, ModernBert
from st_fastbackend.engine.spec import (
    DECODER_FAMILIES,
    ENCODER_FAMILIES,
    MODERNBERT_FAMILIES,
    DecoderSpec,
    EncoderSpec,
    ModernBertSpec,
    UnsupportedModelError,
)

SUPPORTED_MODEL_TYPES = sorted([*DECODER_FAMILIES, *ENCODER_FAMILIES, *MODERNBERT_FAMILIES])


def build_engine(config: PretrainedConfig) -> nn.Module:
    """The engine for `config`, on the meta device: no memory until the checkpoint's tensors are assigned."""
    if config.model_type in DECODER_FAMILIES:
        engine_class, spec = Decoder, DecoderSpec.from_config(config)
    elif config.model_type in ENCODER_FAMILIES:
        engine_class, spec = ENCODER_CLASSES.get(config.model_type, Encoder), EncoderSpec.from_config(config)
    elif config.model_type in MODERNBERT_FAMILIES:
        engine_class, spec = ModernBert, ModernBertSpec.from_config(config)
    else:
        raise UnsupportedModelError(
            f"model_type {config.model_type!r} (architectures {config.architectures}; "
            f"the fast backend runs {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    with torch.device("meta"):
        return engine_class(spec)
