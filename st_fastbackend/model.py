"""`SentenceTransformer` with `backend="fast"`: the same class, the packed engine inside.

With backend "torch", "onnx" or "openvino" this is exactly sentence-transformers' class. With
"fast", the Transformer module of modules.json becomes PackedTransformer and the Pooling module
PackedPooling; every other module (Dense, Normalize, ...) stays as it is.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sentence_transformers
import torch
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.util import get_device_name
from torch import Tensor
from tqdm.autonotebook import tqdm

from st_fastbackend.engine.prefix import Prefix
from st_fastbackend.engine.schedule import Schedule, default_max_tokens
from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.modules import PackedPooling, PackedTransformer, check_texts
from st_fastbackend.modules.tokenizer import TextTokenizer

FAST_MODULES: dict[type, type] = {Transformer: PackedTransformer, Pooling: PackedPooling}
TOKENIZE_CHUNK = 4096  # texts tokenized together (while the previous chunk runs) and sorted by length
OUTPUT_VALUES = ("sentence_embedding", "token_embeddings", None)


class SentenceTransformer(sentence_transformers.SentenceTransformer):
    _max_tokens_per_batch: int | None = None
    # A prompt shared by the texts of an encode() call (or a server batch) is computed once, on causal
    # decoders (engine/prefix.py); False runs it with every text, as plain sentence-transformers does.
    prompt_reuse: bool = True

    def prompt_prefix(self, prompt: str | None) -> Prefix | None:
        return self[0].prefix_for(prompt) if self.prompt_reuse and self.backend == "fast" else None

    def __init__(self, model_name_or_path: str | None = None, *, backend: str = "torch", **kwargs: Any) -> None:
        if backend == "fast" and not hasattr(sentence_transformers.SentenceTransformer, "_inference"):
            raise ImportError(
                f'backend="fast" needs sentence-transformers >= 6.2 (its encode() loop is what we replace); '
                f"found {sentence_transformers.__version__}."
            )
        if backend == "fast":
            kwargs = _load_on_device(kwargs)
        super().__init__(model_name_or_path, backend=backend, **kwargs)
        if backend == "fast":
            self._check_fast_pipeline()

    def _check_fast_pipeline(self) -> None:
        modules = list(self._modules.values())
        if not modules or not isinstance(modules[0], PackedTransformer):
            first = type(modules[0]).__name__ if modules else "nothing"
            raise UnsupportedModelError(f"A pipeline starting with {first} (the fast backend replaces Transformer)")
        if len(modules) > 1 and not isinstance(modules[1], PackedPooling):
            raise UnsupportedModelError(f"{type(modules[1]).__name__} after the Transformer module")

    # -- loading: swap sentence-transformers' Transformer and Pooling for the packed ones ---------

    def _load_module_class_from_ref(self, class_ref: str, *args, **kwargs) -> type:
        module_class = super()._load_module_class_from_ref(class_ref, *args, **kwargs)
        return FAST_MODULES.get(module_class, module_class) if self.backend == "fast" else module_class

    def _load_default_modules(
        self, model_name_or_path: str, token, cache_folder, revision=None, trust_remote_code=False,
        local_files_only=False, model_kwargs=None, processor_kwargs=None, config_kwargs=None,
    ) -> tuple[list, dict]:  # fmt: skip
        """A bare Hugging Face checkpoint, built as plain sentence-transformers builds it: the Transformer from its
        constructor (sentence_bert_config.json is not read on this path, so max_seq_length is the tokenizer's,
        capped at the positions), last-token pooling for causal LMs, mean otherwise."""
        if self.backend != "fast":
            return super()._load_default_modules(
                model_name_or_path, token, cache_folder, revision, trust_remote_code, local_files_only,
                model_kwargs, processor_kwargs, config_kwargs,
            )  # fmt: skip
        shared = {"token": token, "trust_remote_code": trust_remote_code, "revision": revision,
                  "local_files_only": local_files_only, "cache_dir": cache_folder}  # fmt: skip
        transformer = PackedTransformer(
            model_name_or_path,
            model_kwargs={**shared, **(model_kwargs or {})},
            processor_kwargs={**shared, **(processor_kwargs or {})},
            config_kwargs={**shared, **(config_kwargs or {})},
        )
        architectures = transformer.config.architectures or [""]
        causal = architectures[0].endswith("ForCausalLM") and getattr(transformer.config, "is_causal", True)
        pooling = PackedPooling(transformer.get_embedding_dimension(), "lasttoken" if causal else "mean")
        return [transformer, pooling], {}

    # -- saving: canonical sentence-transformers types, so plain sentence-transformers loads it ----

    def save(self, path: str, *args, **kwargs) -> None:
        super().save(path, *args, **kwargs)
        if self.backend == "fast":
            _rewrite_module_types(path)

    # -- inference ----------------------------------------------------------------------------

    def _inference(self, inputs: list, **kwargs) -> list | Tensor:
        """sentence-transformers' inference loop, or the packed one with backend="fast"."""
        if self.backend != "fast":
            return super()._inference(inputs, **kwargs)
        return self._packed_inference(inputs, **kwargs)

    def _multi_process(self, inputs, *args, **kwargs) -> list | Tensor:
        """A multi-process pool: bad input is named by the caller's index, before the texts are split into chunks."""
        if self.backend == "fast":
            check_texts(inputs)
        return super()._multi_process(inputs, *args, **kwargs)

    @torch.inference_mode()
    def _packed_inference(
        self,
        inputs: list,
        *,
        prompt: str | None,
        batch_size: int,
        show_progress_bar: bool,
        output_value: str | None,
        save_to_cpu: bool,
        normalize_embeddings: bool,
        truncate_dim: int | None,
        device: str | torch.device | None,
        max_tokens_per_batch: int | None = None,
        **kwargs,
    ) -> list | Tensor:
        """Texts are tokenized a chunk at a time in a background thread, sorted by token length within
        the chunk, and packed into batches of at most `batch_size` texts and `max_tokens_per_batch`
        tokens; results return in the caller's order."""
        if output_value not in OUTPUT_VALUES:
            raise ValueError(f"output_value must be one of {OUTPUT_VALUES}, got {output_value!r}.")
        if max_tokens_per_batch is not None and max_tokens_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch must be positive, got {max_tokens_per_batch}.")
        check_texts(inputs)  # before sorting, so an error names the caller's index
        device = self._resolve_inference_device(device)
        self.eval()
        max_tokens = max_tokens_per_batch or self._max_tokens_for(device)
        schedule = Schedule(self, prompt, device, batch_size, max_tokens)  # one for the call: keeps a learned budget
        results: list = [None] * len(inputs)
        copied = device.type == "cuda" and save_to_cpu and output_value == "sentence_embedding"  # see _rows
        landing = HostRows(results, waits=copied)
        with tqdm(total=len(inputs), desc="Texts", disable=not show_progress_bar) as progress:
            for chunk, sequences in _tokenized_chunks(self[0].texts, inputs, prompt):
                for picked, out in schedule.run(sequences, **kwargs):
                    rows = _rows(out, output_value, truncate_dim, normalize_embeddings, save_to_cpu)
                    landing.add([chunk[i] for i in picked], rows)
                    progress.update(len(picked))
        landing.finish()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the rows left on the GPU, if any, are complete
        if output_value == "sentence_embedding":
            return torch.stack(results) if results else torch.tensor([], device=device)
        return results

    def forward_sequences(
        self,
        sequences: list[list[int]],
        prompt: str | None = None,
        device: torch.device | None = None,
        prefix: Prefix | None = None,
        **kwargs,
    ) -> dict[str, Any]:
        """One packed forward pass over token-id sequences (already tokenized with `prompt`, if any):
        every module's outputs, "sentence_embedding" [B, dim] among them. With `prefix`, the sequences are
        what follows that prompt computed once (engine/prefix.py)."""
        features = self[0].pack(sequences, prompt, prefix)
        features["packed"] = features["packed"].to(device or self.device, non_blocking=True)
        return self(features, **kwargs)

    # -- the token budget ---------------------------------------------------------------------

    @property
    def max_tokens_per_batch(self) -> int:
        """Tokens per packed batch in encode(): bounds peak memory whatever the text lengths."""
        return self._max_tokens_for(self.device)

    def _max_tokens_for(self, device: torch.device) -> int:
        """The budget set by the user, else a default for the device: fixed on CPUs, from free memory on GPUs."""
        if self._max_tokens_per_batch is not None:
            return self._max_tokens_per_batch
        return default_max_tokens(self[0].config, next(self[0].parameters()).dtype, device)

    @max_tokens_per_batch.setter
    def max_tokens_per_batch(self, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError(f"max_tokens_per_batch must be positive, got {value}")
        self._max_tokens_per_batch = value

    def get_model_kwargs(self) -> list[str]:
        extra = ["max_tokens_per_batch"] if self.backend == "fast" else []
        return [*super().get_model_kwargs(), *extra]


def _tokenized_chunks(texts: TextTokenizer, inputs: list[str], prompt: str | None) -> Iterator[tuple[range, list]]:
    """(positions in `inputs`, their token ids) chunk by chunk; the next chunk is tokenized in a background
    thread while the caller runs the current one."""
    chunks = [range(s, min(s + TOKENIZE_CHUNK, len(inputs))) for s in range(0, len(inputs), TOKENIZE_CHUNK)]
    if not chunks:
        return
    if prompt:  # measured (and cached) now: the tokenizer must not run in two threads at once
        texts.prompt_length(prompt)

    def tokenize(chunk: range) -> list[list[int]]:
        return texts.encode([inputs[i] for i in chunk], prompt, first_index=chunk.start)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize") as background:
        pending = background.submit(tokenize, chunks[0])
        for position, chunk in enumerate(chunks):
            sequences = pending.result()
            if position + 1 < len(chunks):
                pending = background.submit(tokenize, chunks[position + 1])
            yield chunk, sequences


def _load_on_device(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The fast backend reads the checkpoint tensor by tensor straight onto the model's device, in its
    dtype: `device_map` names that device, as sentence-transformers' own option to load a backbone
    directly on one device. Without it a 7B model would pass through host memory first."""
    model_kwargs = dict(kwargs.get("model_kwargs") or {})
    device = kwargs.get("device") or model_kwargs.get("device_map") or get_device_name()
    model_kwargs.setdefault("device_map", device)
    return {**kwargs, "device": device, "model_kwargs": model_kwargs}


class HostRows:
    """Where each pack's rows go in the caller's order. From a GPU, rows are copied to the host without waiting,
    into pinned (page-locked) memory; each pack's rows move to ordinary memory once their copy is done, at most
    DEPTH packs behind the newest, so pinned memory holds a few packs' rows rather than the whole call's (1M
    e5-mistral rows would be 16 GB pinned, kept by PyTorch's host cache after the call)."""

    DEPTH = 4  # packs in flight: the host waits for the oldest only while the GPU has newer ones queued

    def __init__(self, results: list, waits: bool, event=None) -> None:
        self.results, self.waits = results, waits
        self.event = event or (lambda: torch.cuda.Event())  # a copy's completion, recorded on the GPU's queue
        self.pending: deque[tuple[list[int], Tensor, Any]] = deque()

    def add(self, positions: list[int], rows: list | Tensor) -> None:
        if not self.waits:
            self._place(positions, rows)
            return
        done = self.event()
        done.record()
        self.pending.append((positions, rows, done))
        while len(self.pending) > self.DEPTH:
            self._land()

    def finish(self) -> None:
        while self.pending:
            self._land()

    def _land(self) -> None:
        positions, rows, done = self.pending.popleft()
        done.synchronize()
        self._place(positions, rows.clone())  # ordinary memory; the pinned block goes back to be reused

    def _place(self, positions: list[int], rows: list | Tensor) -> None:
        for i, row in zip(positions, rows, strict=True):
            self.results[i] = row


def _rows(out: dict[str, Any], output_value: str | None, truncate_dim, normalize: bool, to_cpu: bool) -> list | Tensor:
    """One batch's results, one row per text, as sentence-transformers' encode() returns them."""
    if truncate_dim is not None:
        out["sentence_embedding"] = out["sentence_embedding"][:, :truncate_dim]
    if output_value != "sentence_embedding":
        return _per_text_outputs(out, output_value)
    rows = out["sentence_embedding"]
    if normalize:
        rows = torch.nn.functional.normalize(rows, p=2, dim=1)
    # From a GPU: copied without waiting for it; the caller synchronizes once before reading the rows.
    return rows.to("cpu", non_blocking=True) if to_cpu else rows


def _per_text_outputs(out: dict[str, Any], output_value: str | None) -> list:
    """Unpadded per-text results: token embeddings [len_i, hidden], or a dict of everything."""
    lengths = list(out["packed"].lengths)
    tokens = out["token_embeddings"].split(lengths)  # [T, H] -> B x [len_i, H]
    if output_value == "token_embeddings":
        return list(tokens)
    input_ids = out["packed"].input_ids.split(lengths)
    per_text = []
    for i, (ids, token_embeddings) in enumerate(zip(input_ids, tokens, strict=True)):
        item = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_embeddings": token_embeddings}
        item["sentence_embedding"] = out["sentence_embedding"][i]
        item.update({k: v for k, v in out.items() if k not in item and k != "packed"})
        per_text.append(item)
    return per_text


def _rewrite_module_types(path: str) -> None:
    """modules.json names sentence-transformers' own classes, and their folders are named as plain
    sentence-transformers names them ("1_Pooling", not "1_PackedPooling")."""
    canonical = {f"{cls.__module__}.{cls.__name__}": base for base, cls in FAST_MODULES.items()}
    modules_json = Path(path) / "modules.json"
    modules = json.loads(modules_json.read_text())
    for module in modules:
        base = canonical.get(module["type"])
        if base is None:
            continue
        module["type"] = f"{base.__module__}.{base.__name__}"
        folder = f"{module['idx']}_{base.__name__}"
        if module["path"] and module["path"] != folder and not (Path(path) / folder).exists():
            (Path(path) / module["path"]).rename(Path(path) / folder)
            module["path"] = folder
    modules_json.write_text(json.dumps(modules, indent=2))
