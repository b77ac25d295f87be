"""What the subcommands share: the program's name, option types and choices, loading the model in one line of
error, and the line that says what ran. Imports none of the subcommands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from st_fastbackend.cli.files import CliError

PROG = "st-fastbackend"
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16", "auto": "auto"}  # fmt: skip
MATMUL_PRECISIONS = ("highest", "high", "medium")
MATMUL_HELP = "torch.set_float32_matmul_precision; 'medium' lets an fp32 model multiply in bf16 on a CPU"


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, but not None or False (an option that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def add_prompt_options(command: argparse.ArgumentParser, prompt: str, name: str) -> None:
    """--prompt or --prompt-name (one at most), with an example of each in their help."""
    prompts = command.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default=None, help=f"text put before every input, e.g. '{prompt}'")
    prompts.add_argument("--prompt-name", default=None, help=f"a prompt from the model's config, e.g. {name}")


def dtype_name(value: str) -> str:
    if value.lower() not in DTYPES:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[value.lower()]


def positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


QUANTIZE_CHOICES = ["int8", "int8-static"]  # engine/quantize.QUANTIZE, without importing torch for --help
QUANTIZE_HELP = (
    "integer products in the Linear layers, on a CPU with AVX512-VNNI: int8 scales each token's input as it comes, "
    "int8-static uses scales calibrated at load on built-in texts (faster); error bounds: docs/cpu.md"
)


def model_kwargs(args: argparse.Namespace) -> dict:
    """SentenceTransformer's model_kwargs from --dtype and --quantize."""
    import torch

    kwargs = {"dtype": args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)} if args.dtype else {}
    if getattr(args, "quantize", None):
        kwargs["quantize"] = args.quantize
    return kwargs


# The model classes the embedding commands load (by the name config_sentence_transformers.json gives); a
# CrossEncoder is cli/rerank.py's.
EMBEDDING_KINDS = ("SentenceTransformer", "SparseEncoder", "MultiVectorEncoder", "HybridEncoder")
HYBRID_HEADS = ("sparse_linear.pt", "colbert_linear.pt")  # BGE-M3's heads beside a SentenceTransformer folder


def load_model(args: argparse.Namespace, backend: str = "fast", kinds: tuple[str, ...] = ("SentenceTransformer",)):
    """The model, or a one-line CliError: missing folder, a folder that is not a model, a model class the command
    does not take (`kinds`: the ones it does, by the name config_sentence_transformers.json gives), any load
    failure."""
    check_model(args.model)
    import torch

    import st_fastbackend

    kind = saved_model_type(args.model) or "SentenceTransformer"
    if kind == "SentenceTransformer" and "HybridEncoder" in kinds and has_hybrid_heads(args.model):
        kind = "HybridEncoder"
    if kind not in kinds:
        raise CliError(f"{args.model} is a {kind}; this command takes {' or '.join(kinds)} models")
    if args.matmul_precision:
        torch.set_float32_matmul_precision(args.matmul_precision)
    try:
        model = getattr(st_fastbackend, kind)(args.model, backend=backend, device=args.device,
                                              model_kwargs=model_kwargs(args))  # fmt: skip
    except Exception as error:  # whatever went wrong, one line; --debug shows where
        raise CliError(f"cannot load model {args.model}: {first_line(error)}") from error
    if args.max_seq_length:
        model.max_seq_length = args.max_seq_length
    return model


def saved_model_type(name: str) -> str | None:
    """The model class a folder was saved from (its config_sentence_transformers.json "model_type"), if it says."""
    path = model_file(name, "config_sentence_transformers.json")
    try:
        found = json.loads(path.read_text(encoding="utf8")).get("model_type") if path else None
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def has_hybrid_heads(name: str) -> bool:
    """A model that carries BGE-M3's lexical and ColBERT heads (models/hybrid.py)."""
    return all(model_file(name, head) is not None for head in HYBRID_HEADS)


def model_file(name: str, filename: str) -> Path | None:
    """A file of the model: in its local folder, or for a Hub id in the local Hugging Face cache (what is not
    downloaded yet is not known before the model loads), else None."""
    path = Path(name).expanduser()
    if path.is_dir() or name.startswith((".", "/", "~")):
        return path / filename if (path / filename).is_file() else None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, filename)
    except ValueError:  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def check_model(name: str) -> None:
    path = Path(name).expanduser()
    if path.is_dir():
        if not any((path / marker).is_file() for marker in ("modules.json", "config.json")):
            raise CliError(f"{name} is not a model folder: it has neither modules.json nor config.json")
    elif path.exists():
        raise CliError(f"{name} is a file, not a model folder")
    elif name.startswith((".", "/", "~")) or name.count("/") > 1:  # a Hub id is "name" or "org/name"
        raise CliError(f"model folder {name} does not exist")


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def describe(model) -> str:
    """What actually runs: the weights' dtype and, on the fast backend, the attention kernel and product dtype."""
    weight = next(model.parameters(), None)  # ONNX and OpenVINO models have none
    weights = str(getattr(weight, "dtype", "?")).removeprefix("torch.")
    if getattr(model, "backend", None) != "fast":
        return f"weights {weights}, backend {getattr(model, 'backend', 'torch')}"
    packed = model.packed_input
    products = str(packed.product_dtype).removeprefix("torch.")
    return f"weights {weights}, products {products}, attention {packed.attention_kernel}"
