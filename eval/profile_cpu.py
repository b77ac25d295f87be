"""Where the CPU time goes: plain sentence-transformers and the fast backend (its CPU default, eager layer seams;
and with compiled seams) on the same texts under torch.profiler, each operator's own time put in one of five groups.

    python eval/profile_cpu.py                                   # small Mistral and MiniLM, 256 paragraphs
    python eval/profile_cpu.py --models minilm --workload sts --texts 1024

Groups: matrix products (PyTorch's and oneDNN's), attention (SDPA and its softmax), compiled seams (the
code torch.compile generated), other operators (elementwise, casts, copies, indexing), and the rest of the
wall time outside any operator (tokenizing, packing, Python). The fast backend can beat plain only by what
it removes from the last four groups and by faster products; the table says how much each group is.
"""

from __future__ import annotations

import statistics
import time

import torch
from harness import data, measure, models, options
from torch.profiler import ProfilerActivity, profile

GROUPS = ("matrix products", "attention", "compiled seams", "other operators", "outside operators")
PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise", "aten::_mkldnn")
ATTENTION = ("scaled_dot_product", "aten::_softmax", "aten::softmax", "flash_attention")
COMPILED = ("CompiledFxGraph", "cpp_fused", "Torch-Compiled Region", "CompiledFunction")  # inductor's kernels run
# inside "## Call CompiledFxGraph ... ##" (their own events only with TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1)


def group(name: str) -> str:
    if any(part in name for part in COMPILED):
        return "compiled seams"
    if name.startswith(PRODUCTS):
        return "matrix products"
    if any(part in name for part in ATTENTION):
        return "attention"
    return "other operators"


def profiled(model, texts: list[str], batch_size: int) -> dict[str, float]:
    """Seconds per group for one encode() of `texts` (after an untimed one)."""
    model.encode(texts[:batch_size], batch_size=batch_size)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        model.encode(texts, batch_size=batch_size)
        wall = time.perf_counter() - start
    seconds = dict.fromkeys(GROUPS, 0.0)
    for event in prof.key_averages():
        seconds[group(event.key)] += event.self_cpu_time_total / 1e6
    seconds["outside operators"] = max(wall - sum(seconds.values()), 0.0)
    seconds["wall"] = wall
    return seconds


def main() -> None:
    parser = options.parser(__doc__, "data_dir", "batch_size")
    parser.add_argument("--models", nargs="+", default=["mistral", "minilm"], choices=["mistral", "minilm"])
    parser.add_argument("--workload", default="paragraphs", choices=["paragraphs", "sts"])
    parser.add_argument("--texts", type=int, default=256)
    args = parser.parse_args()
    texts = {"paragraphs": data.paragraphs, "sts": data.sts_sentences}[args.workload](args.data_dir)[: args.texts]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(texts)} {args.workload}, fp32")
    for name in args.models:
        systems = models.seam_systems(name)
        table = {system: profiled(model, texts, args.batch_size) for system, model in systems.items()}
        print(f"\n{name}: seconds (share of wall) per group, one encode() under the profiler")
        print(f"{'group':<20}" + "".join(f"{system:>24}" for system in systems))
        for row in (*GROUPS, "wall"):
            cells = [f"{table[s][row]:8.2f} ({table[s][row] / table[s]['wall']:4.0%})" for s in systems]
            print(f"{row:<20}" + "".join(f"{cell:>24}" for cell in cells))
        rounds = measure.encode_rounds(systems, texts, args.batch_size, 3, "cpu")
        unprofiled = {system: statistics.median(result["times"]) for system, result in rounds.items()}
        print("without the profiler (median of 3, alternating): " + ", ".join(
            f"{system} {seconds:.2f} s ({unprofiled['plain'] / seconds:.2f}x plain)"
            for system, seconds in unprofiled.items()))  # fmt: skip


if __name__ == "__main__":
    main()
