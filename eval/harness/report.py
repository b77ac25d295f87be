"""What a run writes: the machine it ran on, its results file under eval/results/, and the chart."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

# The CPU flags the products' kernels pick from (oneDNN: AVX-512 VNNI / BF16, AMX; else AVX2).
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def stamp(seconds: bool = False) -> str:
    """The time now, as results files name it: 2026-12-01-2339 (or 2026-12-01-233912)."""
    return datetime.datetime.now().strftime("%Y-%m-%d-%H%M" + ("%S" if seconds else ""))


def cpu() -> str:
    """The CPU's name and the product-relevant flags it has, from /proc/cpuinfo (else platform's words)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    first = info.split("\n\n")[0]  # the first processor's block
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
    flags = set(fields.get("flags", "").split())
    return f"{fields.get('model name', platform.machine())} ({' '.join(f for f in FLAGS if f in flags) or 'no AVX2'})"


def machine(device: str = "cpu") -> str:
    """One line: the CPU, its cores, torch's threads and version, the device and the load (a busy machine's
    ratios are distorted)."""
    import torch

    from st_fastbackend.models.check import machine_load

    where = torch.cuda.get_device_name() if device.startswith("cuda") else device
    threads = torch.get_num_threads()
    return f"{cpu()}, {os.cpu_count()} cores, {threads} threads, torch {torch.__version__}, {where}; {machine_load()}"


def write_json(path: Path, payload: dict) -> Path:
    """`payload` as indented JSON at `path` (its folder made; paths and other objects written as text)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def results_file(output_dir: Path, name: str, payload: dict, when: str | None = None) -> Path:
    """A new <output_dir>/<name>-<when>.json (`when`: a stamp(), by default now), so that a later run does not
    overwrite a results file already committed."""
    return write_json(Path(output_dir) / f"{name}-{when or stamp()}.json", payload)


def chart(rows: list[dict], labels: list[str], path: Path) -> None:
    """Bars of tokens/s, one group per row and one bar per system (the rows' dict-valued keys, plain and fast
    first), each bar but plain's marked with its ratio to plain."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = {k: None for r in rows for k in r if isinstance(r[k], dict) and k not in ("plain", "fast")}
    systems = ["plain", "fast", *others]
    names = {"plain": "plain sentence-transformers", "fast": "st_fastbackend"}
    x, width = np.arange(len(rows)), 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    for k, system in enumerate(systems):
        offset = (k - (len(systems) - 1) / 2) * width
        label = names.get(system, f"peer: {system}")
        ax.bar(x + offset, [r[system]["tokens_per_s"] if system in r else 0 for r in rows], width, label=label)
        for i, r in enumerate(rows):
            if system != "plain" and system in r:  # a workload's own systems: prompt every time, on "instructed"
                ratio = f"{r[system]['ratio_vs_plain']:.2f}x"
                ax.text(i + offset, r[system]["tokens_per_s"], ratio, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
