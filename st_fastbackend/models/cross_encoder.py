"""`CrossEncoder` with `backend="fast"`: the same class, the packed engine inside.

With backend "torch", "onnx" or "openvino" this is exactly sentence-transformers' class. With "fast", the
Transformer module (sequence classification, or a causal LM) becomes PackedScoringTransformer, which runs
the head of its checkpoint's architecture on packed pairs; a causal LM's LogitScore becomes PackedLogitScore,
which reads the two LM-head rows it needs. predict() and rank() are the parent's; their inner loop is the
packed one of models/fast.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sentence_transformers
import torch
from sentence_transformers.base.modules import Transformer
from sentence_transformers.cross_encoder.modules import LogitScore
from transformers import PretrainedConfig

from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.models.fast import FastModel, PackRows
from st_fastbackend.modules.files import architectures
from st_fastbackend.modules.inputs import check_pairs
from st_fastbackend.modules.scoring import PackedLogitScore, PackedScoringTransformer


class CrossEncoder(FastModel, sentence_transformers.CrossEncoder):
    fast_modules = {Transformer: PackedScoringTransformer, LogitScore: PackedLogitScore}
    inference_call = "predict"
    output_kind = "scores"
    served_outputs = ("scores",)
    prompt_reuse = False  # the prompt alone is not what pairs share: the tokens they begin with are (prefix_reuse)
    # On a causal-LM reranker the tokens every pair of a call begins with (a chat template's head and instruction,
    # rank()'s query) are computed once (PackedScoringTransformer.shared_prefix); False runs them with every pair.
    prefix_reuse: bool = True

    def _check_fast_pipeline(self, modules: list) -> None:
        super()._check_fast_pipeline(modules)
        first, rest = modules[0], modules[1:]
        if first.transformer_task == "sequence-classification" and not rest:
            return
        if first.transformer_task == "text-generation" and len(rest) == 1 and isinstance(rest[0], PackedLogitScore):
            if rest[0].module_input_name != "causal_logits":
                raise UnsupportedModelError(f"LogitScore reading {rest[0].module_input_name!r}")
            first.lm_rows_for(rest[0].token_ids)
            return
        after = ", ".join(type(m).__name__ for m in rest) or "nothing"
        raise UnsupportedModelError(f"A {first.transformer_task} Transformer followed by {after}")

    def default_modules(self, model_name_or_path: str, kwargs: dict[str, dict]) -> tuple[list, dict]:
        """A bare Hugging Face checkpoint, as plain sentence-transformers builds it: *ForCausalLM as a
        text-generation Transformer + LogitScore("yes", "no"), anything else as sequence classification."""
        task = "text-generation" if _causal(model_name_or_path, kwargs["config_kwargs"]) else "sequence-classification"
        transformer = PackedScoringTransformer(model_name_or_path, transformer_task=task, **kwargs)
        if transformer.transformer_task == "sequence-classification":
            return [transformer], {}
        yes, no = (transformer.tokenizer.convert_tokens_to_ids(token) for token in ("yes", "no"))
        if yes is None or no is None:
            raise ValueError("The tokenizer does not have 'yes' and/or 'no' tokens, which LogitScore reads.")
        return [transformer, PackedLogitScore(true_token_id=yes, false_token_id=no)], {}

    def check_inputs(self, inputs: list) -> None:
        check_pairs(inputs)

    @property
    def config(self) -> PretrainedConfig | None:
        """The checkpoint's config (activation_fn and num_labels are read from it), as the parent's."""
        return self[0].config if self.backend == "fast" else super().config

    @config.setter
    def config(self, value: PretrainedConfig) -> None:
        if self.backend == "fast":
            self[0].config = value
        else:
            sentence_transformers.CrossEncoder.config.fset(self, value)

    @property
    def num_labels(self) -> int:
        if self.backend != "fast" or self[0].transformer_task == "text-generation":
            return super().num_labels
        return self[0].config.num_labels

    def served_options(self, output: str) -> dict:
        """Raw scores: the server applies the activation per request."""
        return {"activation_fn": None, "apply_softmax": False}

    def pack_rows(self, prompt: str | None, options: dict) -> PackRows:
        """Each pair's score (or scores), as the parent's predict() makes them; on the model's device."""
        activation_fn, apply_softmax = options.pop("activation_fn"), options.pop("apply_softmax")
        transformer, num_labels = self[0], self.num_labels

        def tokenize(chunk: list, positions: range) -> list[list[int]]:
            return transformer.encode_pairs(chunk, prompt, first_index=positions.start)

        def finish(scores: list, device: torch.device) -> torch.Tensor:
            return torch.stack(scores) if scores else torch.tensor([], device=device)

        return PackRows(tokenize, lambda out: (_scores(out["scores"], activation_fn, num_labels, apply_softmax), None),
                        finish, shared_prefix=transformer.shared_prefix if self.prefix_reuse else None)  # fmt: skip


def _scores(scores: torch.Tensor, activation_fn: Callable | None, num_labels: int, softmax: bool | None):
    """One pack's scores as the parent's _inference makes them: fp32, activation, [B] for one label, softmax."""
    if torch.is_floating_point(scores) and torch.finfo(scores.dtype).bits < 32:
        scores = scores.float()  # ties broken as the parent breaks them
    if activation_fn is not None:
        scores = activation_fn(scores)
    if num_labels == 1 and scores.ndim > 1:
        scores = scores.squeeze(-1)
    if softmax and scores.ndim > 1:
        scores = torch.nn.functional.softmax(scores, dim=1)
    return scores


def _causal(model_name_or_path: str, config_kwargs: dict[str, Any]) -> bool:
    """As plain sentence-transformers decides: the config's first architecture is a *ForCausalLM."""
    found = architectures(model_name_or_path, config_kwargs)
    return bool(found) and found[0].endswith("ForCausalLM")
