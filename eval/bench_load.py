"""Loading, side by side: time to the first embedding and peak extra host memory while loading, plain
sentence-transformers against the fast backend, on a ~1.07B-parameter model of Mistral's shape (hidden
2048, 16 layers, 16/8 heads, MLP 8192, vocabulary 32,000; random bf16 weights in two safetensors shards).

Each load runs in a fresh process; "peak extra host MiB" is the process's peak resident memory minus its
resident memory just before the load (after imports and, on a GPU, after CUDA's own start-up). Rounds
alternate between the backends; the median of each is reported with the ratio fast / plain.

    .venv/bin/python eval/bench_load.py                      # CPU, bf16, 3 rounds
    python3 eval/bench_load.py --device cuda --rounds 2      # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import measure, options, report

SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=8192, vocab_size=32000, max_position_embeddings=4096)  # fmt: skip


def build(folder: Path, tokenizer: str | None) -> Path:
    """An ST folder (Transformer, last-token Pooling, Normalize) around random bf16 weights, built once."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, MistralConfig, MistralModel

    if (folder / "modules.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = MistralConfig(**SHAPE, sliding_window=None, dtype="bfloat16", architectures=["MistralModel"])
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in MistralModel(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    names = sorted(shapes)
    shards = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=generator) * 0.02).bfloat16() for n in shard}
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    AutoTokenizer.from_pretrained(tokenizer or options.minilm_path()).save_pretrained(folder)  # ids under 32,000
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": SHAPE["hidden_size"], "pooling_mode_lasttoken": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    return folder


def child(backend: str, folder: str, device: str, dtype: str) -> None:
    """One load and one embedding in this process; prints a JSON line."""
    import torch

    import st_fastbackend

    if device.startswith("cuda"):
        torch.empty(1, device=device)  # CUDA's own start-up stays out of the figure
    before = measure.rss_mib()
    start = time.perf_counter()
    model = st_fastbackend.SentenceTransformer(
        folder, backend=backend, device=device, model_kwargs={"dtype": getattr(torch, dtype)}
    )
    model.encode(["the first embedding"])
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    gpu = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else 0.0
    print(json.dumps({"seconds": seconds, "extra_host_mib": peak - before, "gpu_peak_mib": gpu}))


def main() -> None:
    parser = options.parser(__doc__, "device", "rounds", device="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--folder", default="/tmp/st_fastbackend_bench_load_mistral_1b")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: all-MiniLM-L6-v2's)")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--child", choices=["torch", "fast"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.folder, args.device, args.dtype)
    folder = build(Path(args.folder), args.tokenizer)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def load(backend: str) -> dict:
        command = [sys.executable, __file__, "--child", backend, "--folder", str(folder),
                   "--device", args.device, "--dtype", args.dtype]  # fmt: skip
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
        return json.loads(out.splitlines()[-1])

    results: dict[str, list[dict]] = {"torch": [], "fast": []}
    calls = {backend: lambda b=backend: results[b].append(load(b)) for backend in ("fast", "torch")}
    measure.alternate(calls, args.rounds)  # what is reported is each child's own time, not this
    print(f"1.07B Mistral shape, {args.dtype}, device {args.device}, median of {args.rounds} fresh processes")
    print("| | plain sentence-transformers | fast | fast / plain |")
    print("|---|---|---|---|")
    for key, label in [("seconds", "time to first embedding, s"), ("extra_host_mib", "peak extra host memory, MiB"),
                       ("gpu_peak_mib", "peak GPU memory, MiB")]:  # fmt: skip
        plain, fast = (statistics.median(r[key] for r in results[b]) for b in ("torch", "fast"))
        ratio = f"{fast / plain:.2f}x" if plain else "–"
        print(f"| {label} | {plain:,.1f} | {fast:,.1f} | {ratio} |")
    if args.out:
        report.write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
