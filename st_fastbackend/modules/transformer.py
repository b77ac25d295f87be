"""The sentence-transformers input module of the fast backend: tokenize without padding, pack,
run the engine, return packed token embeddings [T, hidden].

It reads and writes the same files as sentence-transformers' Transformer module
(sentence_bert_config.json, config.json, safetensors, tokenizer files), so a saved folder loads in
plain sentence-transformers and back into the fast backend.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from sentence_transformers.base.modules import InputModule, Transformer
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from st_fastbackend.engine import fused, host_memory, onednn, quantize
from st_fastbackend.engine.batch import PackedBatch, Tokens
from st_fastbackend.engine.calibration import calibrate, calibration_texts
from st_fastbackend.engine.layers import Linear
from st_fastbackend.engine.prefix import Prefix
from st_fastbackend.engine.registry import build_engine, family_of
from st_fastbackend.engine.runtime import Kernel, Runtime, choose_runtime, resolve_dtype
from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.engine.weights import INDEX_FILE, checkpoint_files, load_weights, stored_dtype
from st_fastbackend.modules.files import resolve_folder
from st_fastbackend.modules.inputs import check_texts
from st_fastbackend.modules.options import check_model_kwargs, load_device, module_config, without_hub_kwargs
from st_fastbackend.modules.tokenizer import (
    TextTokenizer,
    check_tokenizer_files,
    keep_special_token_flags,
    lowercase_input,
    missing_special_tokens,
)

logger = logging.getLogger(__name__)


class PackedTransformer(InputModule):
    config_file_name = "sentence_bert_config.json"
    save_in_root = True

    def __init__(
        self,
        model_name_or_path: str,
        *,
        max_seq_length: int | None = None,
        do_lower_case: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
        config_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        model_kwargs, processor_kwargs = dict(model_kwargs or {}), dict(processor_kwargs or {})
        self.folder = resolve_folder(model_name_or_path, **processor_kwargs) / processor_kwargs.get("subfolder", "")
        config = AutoConfig.from_pretrained(self.folder, **without_hub_kwargs(config_kwargs or {}))
        check_model_kwargs(model_kwargs)
        check_tokenizer_files(self.folder)  # before minutes of loading a large model
        self.family = family_of(config)  # what the model can do, as data: no module asks its engine's class
        self.model = build_engine(config).eval()  # for good: see train()
        # A prompt's states do not depend on what follows it only under causal attention (engine/prefix.py).
        self.reuses_prefix = self.family.causal and self.model.spec.causal
        device = load_device(model_kwargs.get("device_map"))
        self.quantize = quantize.check_quantize(model_kwargs.get("quantize"), device)  # None or one of QUANTIZE
        dtype = resolve_dtype(model_kwargs, config, device.type, stored_dtype(self.folder))
        self.config = config
        self.load_checkpoint(device, dtype)
        self.onednn_copies = device.type == "cpu" and onednn.copies_fit(self.model)  # else PyTorch's products
        self._compiled_seams: bool | None = None  # True/False: on or off; None: fused.on_by_default for the device
        self._decide()

        # As sentence-transformers' Transformer: max_seq_length becomes the tokenizer's model_max_length,
        # capped at the model's max_position_embeddings unless the caller set model_max_length.
        if max_seq_length is not None and "model_max_length" not in processor_kwargs:
            processor_kwargs["model_max_length"] = max_seq_length
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            self.folder, **without_hub_kwargs(processor_kwargs)
        )
        if "model_max_length" not in processor_kwargs and getattr(config, "max_position_embeddings", -1) != -1:
            self.tokenizer.model_max_length = min(self.tokenizer.model_max_length, config.max_position_embeddings)
        self.do_lower_case = do_lower_case
        if do_lower_case:
            lowercase_input(self.tokenizer)
        self.texts = TextTokenizer(self.tokenizer, *missing_special_tokens(self.folder, self.tokenizer))
        texts = calibration_texts(model_kwargs, self.quantize)
        if texts is not None:  # int8-static: each product's input range, from the unquantized model
            calibrate(self.model, lambda pack: self.forward(self.preprocess(list(pack))), texts)

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        model_name_or_path: str,
        subfolder: str = "",
        token: bool | str | None = None,
        cache_folder: str | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
        trust_remote_code: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
        config_kwargs: dict[str, Any] | None = None,
        **kwargs,
    ) -> PackedTransformer:
        """Read sentence_bert_config.json exactly as sentence-transformers' Transformer does."""
        init_kwargs = Transformer._load_init_kwargs(
            model_name_or_path,
            subfolder=subfolder,
            token=token,
            cache_folder=cache_folder,
            revision=revision,
            local_files_only=local_files_only,
            trust_remote_code=trust_remote_code,
            model_kwargs=model_kwargs,
            processor_kwargs=processor_kwargs,
            config_kwargs=config_kwargs,
        )
        return cls(model_name_or_path, **module_config(init_kwargs))

    def load_checkpoint(self, device: torch.device, dtype: torch.dtype) -> None:
        """The engine's tensors from the folder; a module with a head on top also reads the head's."""
        load_weights(self.model, self.folder, device, dtype)

    # -- sentence-transformers' InputModule API -----------------------------------------------

    @property
    def max_seq_length(self) -> int:
        return self.tokenizer.model_max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self.tokenizer.model_max_length = value

    @property
    def runtime(self) -> Runtime:
        """The attention kernel with its capabilities, and the dtype of the matrix products, for the model's device
        and dtype: decided at load, at each move (_apply) and when compiled_seams is set, and passed down to every
        layer; here as PyTorch's setting of fp32 products is now (refresh_runtime)."""
        return self.refresh_runtime()

    def refresh_runtime(self) -> Runtime:
        """The runtime, decided again if PyTorch's setting of fp32 products on a CPU changed since: engine/schedule.py
        asks once per run (an encode() call's chunk, a server batch), no pack or product does."""
        if self._products_setting != onednn.bf16_products_allowed():
            self._decide()
        return self._runtime

    @property
    def compiled_seams(self) -> bool | None:
        """Whether the layer seams run compiled (engine/fused.py): True/False, the caller's choice; None (the
        default): fused.on_by_default for the device."""
        return self._compiled_seams

    @compiled_seams.setter
    def compiled_seams(self, value: bool | None) -> None:
        self._compiled_seams = value
        self._decide()

    @property
    def float_products(self) -> torch.dtype | None:
        """The dtype of floating-point products through oneDNN's reordered copies: on a CPU where they fit (for
        PyTorch's setting of fp32 products), else None (PyTorch's own products)."""
        weight = next(self.model.parameters())
        return onednn.product_dtype(weight.dtype) if self.onednn_copies and weight.device.type == "cpu" else None

    def _decide(self) -> None:
        """The runtime for where the weights are now, set up in the engine's layers (logged) when it changed."""
        weight = next(self.model.parameters())
        products = self.float_products
        if self.quantize:  # int8 products in the Linear layers (_use); attention's as quantize.attention_products says
            quantize.check_device(weight.device)
            products = quantize.attention_products(weight.dtype)
        seams = fused.on_by_default(weight.device.type) if self._compiled_seams is None else self._compiled_seams
        self._products_setting = onednn.bf16_products_allowed()
        runtime = choose_runtime(weight.device.type, weight.dtype, weight.device.index, products, seams)
        if runtime is not getattr(self, "_runtime", None):
            self._use(runtime)

    @property
    def attention_kernel(self) -> Kernel:
        return self.runtime.kernel

    @property
    def product_dtype(self) -> torch.dtype:
        """The dtype inference runs the matrix products in: the model's, or bf16 for an fp32 model on a
        CPU where PyTorch's setting allows it (torch.set_float32_matmul_precision("medium"))."""
        runtime = self.runtime
        return torch.int8 if self.quantize else runtime.product_dtype or runtime.dtype

    def get_embedding_dimension(self) -> int:
        return self.config.hidden_size

    def get_config_dict(self) -> dict[str, Any]:
        return {"max_seq_length": self.max_seq_length, "do_lower_case": self.do_lower_case}

    def preprocess(
        self, inputs: list[str], prompt: str | None = None, processing_kwargs: dict | None = None, **kwargs
    ) -> dict[str, Any]:
        """Texts -> {"packed": PackedBatch, "prompt_length": int when a prompt is given}.

        `kwargs` may carry `task` ("query"/"document"), which only matters with per-task lengths,
        and those are refused at load time.
        """
        if processing_kwargs:
            raise UnsupportedModelError("processing_kwargs in encode()")
        check_texts(inputs)
        return self.pack([Tokens(ids) for ids in self.texts.encode(inputs, prompt)], prompt)

    def pack(self, sequences: list[Tokens], prompt: str | None = None, prefix: Prefix | None = None) -> dict:
        """Token sequences tokenized with `prompt` -> features; with a computed `prefix`, the sequences are what
        follows the prompt computed once (their positions start after it)."""
        offset = self.model.position_offset + (prefix.length if prefix is not None else 0)
        features: dict[str, Any] = {"packed": PackedBatch.from_tokens(sequences, offset)}
        if prompt:
            features["prompt_length"] = self.texts.prompt_length(prompt)
        if prefix is not None:
            features["prefix"] = prefix
        return features

    def prefix_for(self, prompt: str | None) -> Prefix | None:
        """The prompt's tokens to compute once for every text that begins with them, on a causal decoder;
        None for no prompt or any other model."""
        if not prompt or not self.reuses_prefix:
            return None
        ids = self.texts.prompt_ids(prompt)
        return Prefix(ids[:-1], len(ids)) if len(ids) > 1 else None

    def computed_prefix(self, prefix: Prefix, device: torch.device) -> Prefix:
        """The prefix's own pass, once, before the packs after it: a new Prefix holding each layer's keys and values
        and its final states (engine/prefix.py)."""
        ids = PackedBatch.from_sequences([prefix.ids], self.model.position_offset).to(device)
        return self.model.prefix_pass(prefix, ids, _sized(self._runtime, ids))

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        packed = features["packed"]
        if packed.input_ids.device.type == "cpu":  # freed activations stay in the process for the next pack
            host_memory.keep_freed_memory()
        runtime, prefix = _sized(self._runtime, packed), features.get("prefix")
        extra = () if prefix is None else (prefix,)  # a causal decoder's prompt computed once
        features["token_embeddings"] = self.model(packed, runtime, *extra)  # [T, hidden]; T without the prompts
        return features

    def _use(self, runtime: Runtime) -> None:
        """Set the engine's layers up for `runtime` (logged): at load, and again whenever it changes."""
        for layer in self.model.modules():
            if isinstance(layer, Linear):
                layer.product_dtype = torch.int8 if self.quantize else runtime.product_dtype
                layer.releases_weight = True  # the engine's own: no weight shared with another module
        logger.info(f"Runtime: {runtime}" + (f"; Linear layers quantize={self.quantize!r}" if self.quantize else ""))
        self._runtime = runtime

    def train(self, mode: bool = True) -> PackedTransformer:
        """As nn.Module.train, except that the engine's own modules stay in eval mode: none of them acts differently
        in training (no dropout, no batch statistics), and encode() sets the mode at every call: a visible part of
        a one-text call for a model of many small modules (eval/RESULTS.md, "2026-12-02 07:30 — one short text")."""
        self.training = mode
        for child in self.children():
            if child is not self.model:
                child.train(mode)
        return self

    def _apply(self, fn, *args, **kwargs):
        """.to(device), .to(dtype): the engine's layers are set up for the new device and dtype at once."""
        module = super()._apply(fn, *args, **kwargs)
        self._decide()
        return module

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        """The checkpoint files as loaded, the tokenizer, and sentence_bert_config.json."""
        out = Path(output_path)
        sources = [self.folder / "config.json", *checkpoint_files(self.folder)]
        if (self.folder / INDEX_FILE).is_file():
            sources.append(self.folder / INDEX_FILE)
        for source in sources:
            if source.resolve() != (out / source.name).resolve():
                shutil.copyfile(source, out / source.name)
        self.tokenizer.save_pretrained(output_path)
        keep_special_token_flags(self.folder, out)
        self.save_config(output_path)

    def __repr__(self) -> str:
        return (
            f"PackedTransformer({self.get_config_dict()}, model_type={self.config.model_type!r}, "
            f"attention_kernel={self.attention_kernel!r}, product_dtype={self.product_dtype})"
        )


def _sized(runtime: Runtime, batch: PackedBatch) -> Runtime:
    """The runtime for one pack: the layer seams run eagerly in a pack too small for a compiled call to pay."""
    return replace(runtime, fused=False) if runtime.fused and batch.num_tokens < fused.MIN_TOKENS else runtime
