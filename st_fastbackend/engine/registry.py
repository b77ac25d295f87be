"""model_type -> its family (engine/families.py) and the engine that runs it; anything else is refused by name."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from st_fastbackend.engine.families import FAMILIES, Family
from st_fastbackend.engine.spec import UnsupportedModelError

SUPPORTED_MODEL_TYPES = sorted(FAMILIES)


def family_of(config: PretrainedConfig) -> Family:
    if config.model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {config.model_type!r} (architectures {config.architectures}; "
            f"the fast backend runs {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return FAMILIES[config.model_type]


def build_engine(config: PretrainedConfig) -> nn.Module:
    """The engine for `config`, on the meta device: no memory until the checkpoint's tensors are assigned."""
    family = family_of(config)
    spec = family.spec.from_config(config, **family.flags)
    with torch.device("meta"):
        return family.engine(spec)
