"""What `backend="fast"` means, for every sentence-transformers model class (they share BaseModel's hooks):
module classes swapped for packed ones at load, weights read straight onto the device, a pipeline check, the
packed inference loop over the one schedule, and save() under the canonical module types.

A model class is `FastModel` before the sentence-transformers class it replaces, with its own `fast_modules`
(which module classes become which), its pipeline check and what it makes of each pack's outputs. With any
other backend it is exactly the sentence-transformers class: each of sentence-transformers' hooks it overrides is a
`fast_method`, the parent's own where the model was not loaded with backend="fast".
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import sentence_transformers
import torch
from sentence_transformers.base.modules import Router
from sentence_transformers.util import get_device_name
from sentence_transformers.util.misc import import_from_string
from tqdm.autonotebook import tqdm

from st_fastbackend.engine.batch import Tokens
from st_fastbackend.engine.prefix import Prefix
from st_fastbackend.engine.schedule import Schedule, default_max_tokens, texts_per_pack
from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.models.host_rows import HostRows
from st_fastbackend.modules import PackedTransformer, check_texts
from st_fastbackend.modules.files import unreadable_json
from st_fastbackend.modules.tokenizer import TextTokenizer

TOKENIZE_CHUNK = 4096  # inputs tokenized together (while the previous chunk runs) and sorted by length
# (the chunk's inputs, their positions) -> token ids, or Tokens records where a sequence has more (engine/batch.py)
Tokenize = Callable[[list, range], list]
SharedPrefix = Callable[[list], Prefix | None]  # a chunk's sequences (as tokenized) -> what to compute once for them


@dataclass(frozen=True)
class PackRows:
    """A class's row rule for its encode() or predict() (FastModel._packed_inference): how its inputs are tokenized,
    what a pack's outputs become (its rows; where a text has several, one tensor of them all and how many are each
    text's), and what the call returns of every text's rows in the caller's order."""

    tokenize: Tokenize
    rows: Callable[[dict], tuple[Any, list[int] | None]]
    finish: Callable[[list, torch.device], Any]  # (every text's rows, the device) -> the call's result
    copied_to_host: bool = False  # the rows are copied off a GPU without waiting (HostRows lands them packs behind)
    shared_prefix: SharedPrefix | None = None  # packed_runs' shared_prefix


class fast_method:  # lower case: a decorator, as functools.cached_property
    """A sentence-transformers hook as the fast backend overrides it; on a model loaded with any other backend, the
    parent class's own (the next class in the method resolution order that defines it). The backend is read here,
    the one place, instead of a branch at the top of every override."""

    def __init__(self, method: Callable) -> None:
        self.method = method
        functools.update_wrapper(self, method)

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner, name

    def __call__(self, model, *args, **kwargs):  # called through the class: FastModel.save(model, path)
        return self.__get__(model, type(model))(*args, **kwargs)

    def __get__(self, model, kind: type | None = None):
        if model is None:
            return self
        if model.backend != "fast":
            return getattr(super(self.owner, model), self.name)
        return self.method.__get__(model, kind)


class FastModel:
    fast_modules: ClassVar[dict[type, type]] = {}  # sentence-transformers' module class -> ours
    inference_call: ClassVar[str] = "encode"  # the method whose options errors name
    # What a text's row is, declared by the class (a subclass keeps it): the server's outputs and the corpus job's
    # rows are chosen by it (embedder.py, corpus/job.py), never by a class's name.
    output_kind: ClassVar[str] = "dense"
    # The outputs the server's worker asks a pack for (serve/batcher.py), under the names routes ask for them, the
    # first its main one: each through the class's one row rule (served_rows).
    served_outputs: ClassVar[tuple[str, ...]] = ()
    _max_tokens_per_batch: int | None = None
    _placed: tuple[str, torch.device] | None = None  # (the device asked, where every tensor was found), until a move
    # A prompt shared by the texts of a call (or a server batch) is computed once, on causal decoders
    # (engine/prefix.py); False runs it with every text, as plain sentence-transformers does.
    prompt_reuse: bool = True

    def __init__(self, *args: Any, backend: str = "torch", **kwargs: Any) -> None:
        if backend == "fast" and not hasattr(sentence_transformers.SentenceTransformer, "_inference"):
            raise ImportError(
                f'backend="fast" needs sentence-transformers >= 6.2 (its inference loop is what we replace); '
                f"found {sentence_transformers.__version__}."
            )
        asked = kwargs
        if backend == "fast":
            _refuse_missing_folder(args[0] if args else kwargs.get("model_name_or_path"))
            kwargs = _load_on_device(kwargs)
            # module_classes, which sentence-transformers reads for every modules.json type (a Router's too)
            self._module_classes = _FastClasses(self.fast_modules)
        try:
            super().__init__(*args, backend=backend, **kwargs)
        except json.JSONDecodeError as error:  # says where in a document, not which file
            named = unreadable_json(str(args[0] if args else kwargs.get("model_name_or_path")))
            if backend != "fast" or named is None:
                raise
            raise named from error
        if backend == "fast":
            self._check_fast_pipeline(list(self._modules.values()))
            self.loaded_with = (args, asked)  # what check() loads plain sentence-transformers with

    def check(self, texts: list | None = None):
        """This model against plain sentence-transformers on probe texts (or `texts`): a CheckReport
        (models/check.py) whose str() is the table `st-fastbackend check` prints."""
        from st_fastbackend.models.check import check

        return check(self, texts)

    def _check_fast_pipeline(self, modules: list) -> None:
        """The packed engine must be the first module; a class adds what may follow it."""
        if not modules or not isinstance(modules[0], PackedTransformer):
            first = type(modules[0]).__name__ if modules else "nothing"
            raise UnsupportedModelError(f"A pipeline starting with {first} (the fast backend replaces Transformer)")

    @property
    def packed_input(self) -> PackedTransformer:
        """The module that tokenizes and packs: the first (a class with routes picks its own)."""
        return self[0]

    def prompt_prefix(self, prompt: str | None) -> Prefix | None:
        return self.packed_input.prefix_for(prompt) if self.prompt_reuse else None

    # -- loading and saving: sentence-transformers' module types outside, the packed ones inside --------

    @fast_method
    def _load_default_modules(
        self, model_name_or_path: str, token, cache_folder, revision=None, trust_remote_code=False,
        local_files_only=False, model_kwargs=None, processor_kwargs=None, config_kwargs=None,
    ) -> tuple[list, dict]:  # fmt: skip
        """A bare Hugging Face checkpoint (no modules.json): the class's default_modules, with each module's kwargs
        as sentence-transformers' _load_default_modules builds them (the Hub's arguments in each)."""
        shared = {"token": token, "trust_remote_code": trust_remote_code, "revision": revision,
                  "local_files_only": local_files_only, "cache_dir": cache_folder}  # fmt: skip
        kwargs = {"model_kwargs": {**shared, **(model_kwargs or {})},
                  "processor_kwargs": {**shared, **(processor_kwargs or {})},
                  "config_kwargs": {**shared, **(config_kwargs or {})}}  # fmt: skip
        return self.default_modules(model_name_or_path, kwargs)

    def default_modules(self, model_name_or_path: str, kwargs: dict[str, dict]) -> tuple[list, dict]:
        """A bare checkpoint's modules as plain sentence-transformers builds them for this class; `kwargs`: each
        module's model_kwargs, processor_kwargs and config_kwargs."""
        raise UnsupportedModelError(f"A bare checkpoint as a {type(self).__name__}")

    def saved_types(self) -> dict[type, type]:
        """Our module class -> the sentence-transformers class modules.json names for it."""
        return {ours: base for base, ours in self.fast_modules.items()}

    @fast_method
    def save(self, path: str, *args, **kwargs) -> None:
        super().save(path, *args, **kwargs)
        _rewrite_module_types(path, self.saved_types())

    # -- inference ------------------------------------------------------------------------------

    @fast_method
    def _inference(self, inputs: list, **kwargs):
        """The packed loop in place of sentence-transformers' inference loop."""
        return self._packed_inference(inputs, **kwargs)

    @torch.inference_mode()
    def _packed_inference(
        self, inputs: list, *, prompt: str | None, batch_size: int, show_progress_bar: bool,
        device: str | torch.device | None = None, max_tokens_per_batch: int | None = None,
        processing_kwargs: dict | None = None, **options,
    ):  # fmt: skip
        """The inner loop of every class's encode() or predict() on packed batches (packed_runs): the class's row rule
        (pack_rows, which takes the options it knows and checks them before the inputs are) makes each pack's
        outputs rows, in the caller's order; what it leaves of `options` (a task) goes to the modules."""
        self.refuse_processing_kwargs(processing_kwargs)
        rule = self.pack_rows(prompt, options)
        device, max_tokens = self._inference_start(inputs, device, max_tokens_per_batch)
        results: list = [None] * len(inputs)
        landing = HostRows(results, copied_from=device if rule.copied_to_host and device.type == "cuda" else None)
        runs = self.packed_runs(inputs, rule.tokenize, prompt=prompt, device=device, batch_size=batch_size,
                                max_tokens=max_tokens, show_progress_bar=show_progress_bar,
                                shared_prefix=rule.shared_prefix, module_kwargs=options)  # fmt: skip
        for positions, out in runs:
            landing.add(positions, *rule.rows(out))
        landing.finish()
        return rule.finish(results, device)

    def refuse_processing_kwargs(self, processing_kwargs: dict | None) -> None:
        """The packed path tokenizes with the model's tokenizer as loaded: processing_kwargs would be ignored."""
        if processing_kwargs:
            raise UnsupportedModelError(f"processing_kwargs in {self.inference_call}()")

    def pack_rows(self, prompt: str | None, options: dict) -> PackRows:
        """The class's row rule for a call with these options (it pops those it takes)."""
        raise NotImplementedError

    def served_options(self, output: str) -> dict[str, Any]:
        """encode()'s options (as pack_rows takes them) under which the row rule gives the server's rows of `output`:
        raw (each route finishes them: truncation, normalisation, activation), left on the device."""
        raise NotImplementedError

    def served_rows(self, output: str, out: dict) -> list[torch.Tensor]:
        """A pack's rows for the server: the class's one row rule (pack_rows) under served_options, a float32 tensor
        per text, on the host."""
        rows, counts = self.pack_rows(None, self.served_options(output)).rows(out)
        return host_rows(rows, counts)

    def served_kwargs(self) -> dict[str, Any]:
        """What the server's forward passes take besides the pack, as encode() gives the modules by default."""
        return {}

    def check_inputs(self, inputs: list) -> None:
        """Each input one this class takes (texts; a CrossEncoder: pairs of texts), else an error naming its index."""
        check_texts(inputs)

    def _inference_start(self, inputs: list, device, max_tokens_per_batch: int | None) -> tuple[torch.device, int]:
        """What every packed call checks and settles first, in this order: each input (an error names the caller's
        index, before anything is sorted), the budget asked (before the device is resolved, which may move the
        model), then the device and the budget there."""
        self.check_inputs(inputs)
        check_budget(max_tokens_per_batch)
        device = self._resolve_inference_device(device)
        return device, self._max_tokens_for(device, max_tokens_per_batch)

    @fast_method
    def _resolve_inference_device(self, device) -> torch.device:
        """sentence-transformers looks at every parameter and buffer at every call (about 1 ms, a sixth of a short
        call's time): the fast backend keeps where the last call found them all, until the model moves (_apply)."""
        if self._placement_is_delegated:
            return super()._resolve_inference_device(device)
        if self._placed is None or self._placed[0] != str(device):
            self._placed = (str(device), super()._resolve_inference_device(device))
        return self._placed[1]

    def _apply(self, *args, **kwargs):
        """Every move of the whole model (to, cuda, cpu, half) passes here."""
        self._placed = None
        return super()._apply(*args, **kwargs)

    @fast_method
    def _multi_process(self, inputs, *args, **kwargs):
        """A multi-process pool: bad input is named by the caller's index, before the inputs are split into chunks."""
        self.check_inputs(inputs)
        return super()._multi_process(inputs, *args, **kwargs)

    def packed_runs(
        self, inputs: list, tokenize: Tokenize, *, prompt: str | None, device: torch.device, batch_size: int,
        max_tokens: int, show_progress_bar: bool, shared_prefix: SharedPrefix | None = None,
        module_kwargs: Mapping[str, Any] | None = None,
    ) -> Iterator[tuple[list[int], dict]]:  # fmt: skip
        """The one loop of every class: inputs tokenized a chunk at a time in a background thread, sorted by token
        length within the chunk, packed into batches of at most `batch_size` inputs (on a CPU: as many as the token
        budget takes, engine/schedule.py texts_per_pack) and `max_tokens` tokens (one
        schedule for the call: it keeps a budget learned from running out of memory); yields (the inputs'
        positions in `inputs`, the modules' outputs for them). `shared_prefix`: the tokens a chunk's sequences
        share at their start, to compute once (engine/prefix.py), in place of the prompt's. In inference mode,
        whoever calls it. `module_kwargs`: what the modules take besides the features (a task)."""
        self.eval()
        schedule = Schedule(self, prompt, device, texts_per_pack(batch_size, device), max_tokens, module_kwargs)
        with torch.inference_mode(), tqdm(total=len(inputs), desc="Texts", disable=not show_progress_bar) as progress:
            for chunk, sequences in _tokenized_chunks(tokenize, inputs):
                if shared_prefix is not None:
                    schedule.prefix = shared_prefix(sequences)
                for picked, out in schedule.run(sequences):
                    yield [chunk[i] for i in picked], out
                    progress.update(len(picked))

    def forward_sequences(
        self,
        sequences: Sequence[Tokens | Sequence[int]],
        prompt: str | None = None,
        device: torch.device | None = None,
        prefix: Prefix | None = None,
        module_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One packed forward pass over token sequences (already tokenized with `prompt`, if any): every module's
        outputs. With a computed `prefix`, the sequences are what follows it (engine/prefix.py). `module_kwargs`:
        what the modules take besides the features, as encode() passes them (a task)."""
        features = self.packed_input.pack([Tokens.of(s) for s in sequences], prompt, prefix)
        features["packed"] = features["packed"].to(device or self.device, non_blocking=True)
        return self(features, **(module_kwargs or {}))

    # -- the token budget -----------------------------------------------------------------------

    @property
    def max_tokens_per_batch(self) -> int:
        """Tokens per packed batch: bounds peak memory whatever the input lengths."""
        return self._max_tokens_for(self.device)

    @max_tokens_per_batch.setter
    def max_tokens_per_batch(self, value: int | None) -> None:
        self._max_tokens_per_batch = check_budget(value)

    def _max_tokens_for(self, device: torch.device, asked: int | None = None) -> int:
        """The budget asked for this call (best checked before the device is resolved, too), else the one set
        by the user, else a default for the device: fixed on CPUs, from free memory on GPUs."""
        if check_budget(asked) or self._max_tokens_per_batch is not None:
            return asked or self._max_tokens_per_batch
        packed = self.packed_input
        return default_max_tokens(packed.config, next(packed.parameters()).dtype, device)

    @fast_method
    def get_model_kwargs(self) -> list[str]:
        return [*super().get_model_kwargs(), "max_tokens_per_batch"]


def host_rows(rows: Any, counts: list[int] | None) -> list:
    """A row rule's rows of one pack, one per text on the host, floats as float32: a tensor's rows (split by `counts`
    where a text has several), a sparse tensor's rows as (active dimensions, their values), a list's items as they
    are (a tuple's parts each)."""
    if isinstance(rows, list):
        return [_on_host(row) for row in rows]
    if rows.is_sparse:
        found = rows.coalesce().cpu()  # indices sorted by (row, dimension)
        text_of, dimensions = found.indices()
        starts = torch.searchsorted(text_of, torch.arange(found.shape[0] + 1)).tolist()
        values = found.values().float()
        return [(dimensions[a:b], values[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    rows = rows.float().cpu()
    return list(rows) if counts is None else list(rows.split(counts))


def _on_host(row: Any) -> Any:
    if isinstance(row, tuple):
        return tuple(_on_host(part) for part in row)
    if row is None:
        return None
    return row.float().cpu() if row.is_floating_point() else row.cpu()


def text_tokens(texts: TextTokenizer, prompt: str | None) -> Tokenize:
    """packed_runs' tokenize for texts: prompt + text as encode() tokenizes them. The prompt is measured (and
    cached) now, on the caller's thread: the tokenizer must not run in two threads at once."""
    if prompt:
        texts.prompt_length(prompt)
    return lambda chunk, positions: texts.encode(chunk, prompt, first_index=positions.start)


def check_budget(tokens: int | None) -> int | None:
    if tokens is not None and tokens < 1:
        raise ValueError(f"max_tokens_per_batch must be positive, got {tokens}.")
    return tokens


def _tokenized_chunks(tokenize: Tokenize, inputs: list) -> Iterator[tuple[range, list]]:
    """(positions in `inputs`, their token ids) chunk by chunk; the next chunk is tokenized in a background
    thread while the caller runs the current one (one thread: a tokenizer must not run in two at once)."""
    chunks = [range(s, min(s + TOKENIZE_CHUNK, len(inputs))) for s in range(0, len(inputs), TOKENIZE_CHUNK)]
    if len(chunks) <= 1:  # nothing to overlap: starting the thread would cost a short call ~1 ms
        yield from ((chunk, tokenize(list(inputs), chunk)) for chunk in chunks)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize") as background:
        pending = background.submit(tokenize, [inputs[i] for i in chunks[0]], chunks[0])
        for position, chunk in enumerate(chunks):
            sequences = pending.result()
            if position + 1 < len(chunks):
                following = chunks[position + 1]
                pending = background.submit(tokenize, [inputs[i] for i in following], following)
            yield chunk, sequences


def _load_on_device(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The fast backend reads the checkpoint tensor by tensor straight onto the model's device, in its
    dtype: `device_map` names that device, as sentence-transformers' own option to load a backbone
    directly on one device. Without it a 7B model would pass through host memory first."""
    model_kwargs = dict(kwargs.get("model_kwargs") or {})
    device = kwargs.get("device") or model_kwargs.get("device_map") or get_device_name()
    model_kwargs.setdefault("device_map", device)
    return {**kwargs, "device": device, "model_kwargs": model_kwargs}


def _rewrite_module_types(path: str, saved_types: dict[type, type]) -> None:
    """modules.json (and a Router's router_config.json) names sentence-transformers' own classes, and their
    folders are named as plain sentence-transformers names them ("1_Pooling", not "1_PackedPooling")."""
    canonical = {f"{ours.__module__}.{ours.__name__}": base for ours, base in saved_types.items()}
    modules_json = Path(path) / "modules.json"
    modules = json.loads(modules_json.read_text())
    for module in modules:
        if (router := Path(path) / module["path"] / Router.config_file_name).is_file():
            _rewrite_router_types(router, canonical)
        base = canonical.get(module["type"])
        if base is None:
            continue
        module["type"] = f"{base.__module__}.{base.__name__}"
        folder = f"{module['idx']}_{base.__name__}"
        if module["path"] and module["path"] != folder and not (Path(path) / folder).exists():
            (Path(path) / module["path"]).rename(Path(path) / folder)
            module["path"] = folder
    modules_json.write_text(json.dumps(modules, indent=2))


def _rewrite_router_types(router_json: Path, canonical: dict[str, type]) -> None:
    """A Router's routes keep their folder names (they are its own keys); only the types change."""
    config = json.loads(router_json.read_text())
    for key, type_name in config["types"].items():
        if (base := canonical.get(type_name)) is not None:
            config["types"][key] = f"{base.__module__}.{base.__name__}"
    router_json.write_text(json.dumps(config, indent=4))


def _refuse_missing_folder(name) -> None:
    """A path that names no folder, as the CLI says it: "./my-modle" would otherwise reach the Hub as a repo id
    and fail naming the characters a repo id may hold (sentence-transformers catches only "a/b/c")."""
    looks_local = isinstance(name, os.PathLike) or (isinstance(name, str) and name.startswith((".", "/", "~")))
    if looks_local and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"model folder {name} does not exist")


class _FastClasses(Mapping):
    """sentence-transformers' `module_classes` (class reference -> class; BaseModel reads it first for every module
    type, and a Router for its routes): a reference to a class the fast backend replaces gives ours."""

    def __init__(self, fast_modules: dict[type, type]) -> None:
        self.fast_modules = fast_modules

    def __getitem__(self, class_ref: str) -> type:
        if not class_ref.startswith("sentence_transformers."):  # nothing else is imported before its remote-code
            raise KeyError(class_ref)  # check (sentence-transformers' import_module_class)
        try:
            found = import_from_string(class_ref)
        except (ImportError, AttributeError, ValueError):  # not importable here: sentence-transformers says why
            raise KeyError(class_ref) from None
        if found not in self.fast_modules:
            raise KeyError(class_ref)
        return self.fast_modules[found]

    def __iter__(self) -> Iterator[str]:
        return (f"{base.__module__}.{base.__name__}" for base in self.fast_modules)

    def __len__(self) -> int:
        return len(self.fast_modules)
