"""The sentence-transformers input module of the fast backend: tokenize without padding, pack,
run the engine, return packed token embeddings [T, hidden].

It reads and writes the same files as sentence-transformers' Transformer module
(sentence_bert_config.json, config.json, safetensors, tokenizer files), so a saved folder loads in
plain sentence-transformers and back into the fast backend.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from sentence_transformers.base.modules import InputModule, Transformer
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.layers import Linear, limit_reordered_copies
from st_fastbackend.engine.registry import build_engine
from st_fastbackend.engine.runtime import Kernel, Runtime, choose_runtime
from st_fastbackend.engine.spec import FP16_OVERFLOWS, UnsupportedModelError
from st_fastbackend.engine.weights import INDEX_FILE, checkpoint_files, load_weights
from st_fastbackend.modules.files import resolve_folder

logger = logging.getLogger(__name__)

# What sentence-transformers adds to model/processor/config kwargs for the Hub.
_HUB_KWARGS = {"subfolder", "token", "cache_dir", "revision", "local_files_only", "trust_remote_code"}
# model_kwargs that do not change the math; any other is refused.
# ("device_map" naming one device: where the weights are read to.)
_NEUTRAL_MODEL_KWARGS = _HUB_KWARGS | {
    "dtype",
    "torch_dtype",
    "attn_implementation",
    "low_cpu_mem_usage",
    "device_map",
}
# sentence_bert_config.json keys read here; any other key with a non-default value is refused.
_DEFAULT_MODULE_CONFIG = {
    "transformer_task": "feature-extraction",
    "module_output_name": "token_embeddings",
    "processing_kwargs": {},
    "unpad_inputs": None,
    "query_length": None,
    "document_length": None,
    "query_expansion": None,
}
_TEXT_MODALITY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
_INIT_KEYS = {"max_seq_length", "do_lower_case", "model_kwargs", "processor_kwargs", "config_kwargs"}


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
        config = AutoConfig.from_pretrained(self.folder, **_without_hub_kwargs(config_kwargs or {}))
        if unknown := set(model_kwargs) - _NEUTRAL_MODEL_KWARGS:
            raise UnsupportedModelError(f"model_kwargs {sorted(unknown)}")
        check_tokenizer_files(self.folder)  # before minutes of loading a large model
        self.model = build_engine(config)
        device = _load_device(model_kwargs.get("device_map"))
        load_weights(self.model, self.folder, device, _resolve_dtype(model_kwargs, config))
        if device.type == "cpu":
            limit_reordered_copies(self.model)
        self.config = config

        # As sentence-transformers' Transformer: max_seq_length becomes the tokenizer's model_max_length,
        # capped at the model's max_position_embeddings unless the caller set model_max_length.
        if max_seq_length is not None and "model_max_length" not in processor_kwargs:
            processor_kwargs["model_max_length"] = max_seq_length
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            self.folder, **_without_hub_kwargs(processor_kwargs)
        )
        if "model_max_length" not in processor_kwargs and getattr(config, "max_position_embeddings", -1) != -1:
            self.tokenizer.model_max_length = min(self.tokenizer.model_max_length, config.max_position_embeddings)
        self.do_lower_case = do_lower_case
        if do_lower_case:
            _lowercase_input(self.tokenizer)
        self.add_bos, self.add_eos = _missing_special_tokens(self.folder, self.tokenizer)
        self._prompt_lengths: dict[str, int] = {}
        self._in_use: tuple[Runtime, torch.dtype] | None = None  # attention runtime, product dtype: logged

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
        init_kwargs.pop("backend")
        if (modalities := init_kwargs.pop("modality_config", _TEXT_MODALITY)) != _TEXT_MODALITY:
            raise UnsupportedModelError(f"modality_config {modalities}")
        for key, default in _DEFAULT_MODULE_CONFIG.items():
            if (value := init_kwargs.pop(key, default)) not in (default, None):
                raise UnsupportedModelError(f"{key}={value!r} in sentence_bert_config.json")
        if unknown := set(init_kwargs) - _INIT_KEYS:
            raise UnsupportedModelError(f"sentence_bert_config.json keys {sorted(unknown)}")
        return cls(model_name_or_path, **init_kwargs)

    # -- sentence-transformers' InputModule API -----------------------------------------------

    @property
    def max_seq_length(self) -> int:
        return self.tokenizer.model_max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self.tokenizer.model_max_length = value

    @property
    def runtime(self) -> Runtime:
        """The attention kernel and its capabilities for the model's device and dtype (decided once for each)."""
        weight = next(self.model.parameters())
        return choose_runtime(weight.device.type, weight.dtype)

    @property
    def attention_kernel(self) -> Kernel:
        return self.runtime.kernel

    @property
    def product_dtype(self) -> torch.dtype:
        """The dtype inference runs the matrix products in: the model's, or bf16 for an fp32 model on a
        CPU where PyTorch's setting allows it (torch.set_float32_matmul_precision("medium"))."""
        layer = next(m for m in self.model.modules() if isinstance(m, Linear))
        with torch.inference_mode():
            return layer.product_dtype() if layer.uses_onednn() else layer.weight.dtype

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
        return self.pack(self.tokenize_texts(inputs, prompt), prompt)

    def tokenize_texts(
        self, texts: list[str], prompt: str | None = None, first_index: int = 0, max_length: int | None = None
    ) -> list[list[int]]:
        """Token ids of prompt + text for each text; an input without any token is an error naming it
        (as `first_index` + its position, the caller's numbering)."""
        sequences = self.token_ids([prompt + text for text in texts] if prompt else texts, max_length)
        for index, ids in enumerate(sequences):
            if not ids:
                raise ValueError(
                    f"Input {first_index + index} ({texts[index][:80]!r}) has no tokens; there is nothing to embed."
                )
        return sequences

    def pack(self, sequences: list[list[int]], prompt: str | None = None) -> dict[str, Any]:
        features: dict[str, Any] = {"packed": PackedBatch.from_sequences(sequences, self.model.position_offset)}
        if prompt:
            features["prompt_length"] = self.prompt_length(prompt)
        return features

    def token_ids(self, texts: list[str], max_length: int | None = None) -> list[list[int]]:
        """Token ids as the model expects them, truncated to `max_length` (default max_seq_length),
        without padding."""
        extra = int(self.add_bos) + int(self.add_eos)
        limit = {"max_length": (max_length or self.max_seq_length) - extra} if extra or max_length else {}
        encoded = self.tokenizer(
            texts, truncation="longest_first", return_attention_mask=False, return_token_type_ids=False, **limit
        )["input_ids"]
        bos, eos = [self.tokenizer.bos_token_id] * self.add_bos, [self.tokenizer.eos_token_id] * self.add_eos
        return [bos + ids + eos for ids in encoded] if extra else encoded

    def prompt_length(self, prompt: str) -> int:
        """Prompt tokens at the start of each text, without a trailing special token (as sentence-transformers)."""
        if prompt not in self._prompt_lengths:
            ids = self.token_ids([prompt])[0]
            trailing_special = bool(ids) and ids[-1] in self.tokenizer.all_special_ids
            self._prompt_lengths[prompt] = len(ids) - trailing_special
        return self._prompt_lengths[prompt]

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        runtime = self.runtime
        in_use = (runtime, self.product_dtype)
        if in_use != self._in_use:
            dtype = next(self.model.parameters()).dtype
            logger.info(f"Attention kernel: {runtime}; model in {dtype}, matrix products in {in_use[1]}")
            self._in_use = in_use
        features["token_embeddings"] = self.model(features["packed"], runtime)  # [T, hidden]
        return features

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
        _keep_special_token_flags(self.folder, out)
        self.save_config(output_path)

    def __repr__(self) -> str:
        return (
            f"PackedTransformer({self.get_config_dict()}, model_type={self.config.model_type!r}, "
            f"attention_kernel={self.attention_kernel!r}, product_dtype={self.product_dtype})"
        )


def check_texts(inputs: list) -> None:
    for index, text in enumerate(inputs):
        if not isinstance(text, str):
            kinds = {dict: "a dict (multimodal input)", list: "a list (a pair of texts?)", tuple: "a tuple (a pair?)"}
            kind = kinds.get(type(text), type(text).__name__)
            raise TypeError(
                f"The fast backend embeds plain strings; input {index} is {kind}. "
                'Text pairs and dict inputs are not supported by it; backend="torch" accepts them.'
            )


# The files one of transformers' tokenizers is built from: a tokenizer.json, or a vocabulary of its own.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.txt",
                   "vocab.json")  # fmt: skip


def check_tokenizer_files(folder: Path) -> None:
    """transformers 5 builds a 5-token tokenizer for a folder without tokenizer files, and every text then
    embeds to nearly the same vector; refuse such a folder instead."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
            "copy the model's tokenizer into the folder."
        )


def _without_hub_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The folder is already resolved; keyword arguments for the Hub do not apply to it."""
    return {k: v for k, v in kwargs.items() if k not in _HUB_KWARGS}


def _load_device(device_map) -> torch.device:
    """Where the weights are read to: sentence-transformers' device_map naming one device (our
    SentenceTransformer sets it to the model's device), else the CPU."""
    if device_map is None:
        return torch.device("cpu")
    try:
        return torch.device(device_map)
    except (TypeError, RuntimeError, ValueError):
        raise UnsupportedModelError(f"device_map={device_map!r} (one device, e.g. 'cuda:1', is supported)") from None


def _resolve_dtype(model_kwargs: dict[str, Any], config) -> torch.dtype:
    """sentence-transformers' model_kwargs dtype: a torch.dtype, its name, or "auto".

    "auto" takes the checkpoint's dtype on a CUDA machine (as transformers does), except fp16 for a
    family known to overflow in it, which gets bf16 (fp32 where the GPU has no bf16). On a CPU-only
    machine "auto" takes bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), else fp32.
    """
    asked = model_kwargs.get("dtype", model_kwargs.get("torch_dtype")) or torch.float32
    dtype = asked
    if asked == "auto":
        if torch.cuda.is_available():
            dtype = getattr(config, "dtype", None) or torch.float32
        else:
            dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
            logger.info(f'dtype="auto" on a CPU-only machine: {dtype} (native bf16: {cpu_has_native_bf16()})')
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UnsupportedModelError(f"dtype {dtype!r}")
    if dtype == torch.float16 and config.model_type in FP16_OVERFLOWS:
        why = f"{config.model_type} models overflow in float16 (inf/NaN embeddings); their authors advise bfloat16"
        if asked != "auto":
            logger.warning(f"{why}. Running in float16 as asked.")
            return dtype
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        logger.warning(f'{why}. dtype="auto" takes {dtype} instead; pass dtype=torch.float16 to insist.')
    return dtype


def cpu_has_native_bf16() -> bool:
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, hence the getattr
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


def _lowercase_input(tokenizer: PreTrainedTokenizerBase) -> None:
    """do_lower_case, as sentence-transformers applies it: a Lowercase normalizer in front."""
    from tokenizers.normalizers import Lowercase, Sequence

    normalizer = tokenizer.backend_tokenizer.normalizer
    tokenizer.backend_tokenizer.normalizer = Lowercase() if normalizer is None else Sequence([Lowercase(), normalizer])


def _missing_special_tokens(folder: Path, tokenizer: PreTrainedTokenizerBase) -> tuple[bool, bool]:
    """(add BOS, add EOS): what tokenizer_config.json asks for and the loaded tokenizer does not add.

    e5-mistral-7b-instruct sets "add_eos_token": true while its tokenizer.json post-processor adds
    only <s>; transformers >= 5 follows tokenizer.json and drops the </s> that last-token pooling
    reads. The model card tokenizes to max_length - 1 and appends </s>; so do we.
    """
    asked = _tokenizer_config(folder)
    probe = tokenizer("a")["input_ids"]
    add_bos = asked.get("add_bos_token") is True and tokenizer.bos_token_id not in (None, probe[0])
    add_eos = asked.get("add_eos_token") is True and tokenizer.eos_token_id not in (None, probe[-1])
    for name, missing in (("BOS", add_bos), ("EOS", add_eos)):
        if missing:
            logger.info(
                f"tokenizer_config.json asks for {name} but the tokenizer does not add it: the fast backend adds it."
            )
    return add_bos, add_eos


def _keep_special_token_flags(source: Path, target: Path) -> None:
    """transformers >= 5 drops add_bos_token/add_eos_token when saving a tokenizer; write them back."""
    flags = {k: v for k, v in _tokenizer_config(source).items() if k in ("add_bos_token", "add_eos_token")}
    if flags:
        path = target / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **flags}, indent=2))


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
