"""Attention alone on the CPU: our kernel (engine/cpu_kernel.py) against PyTorch's SDPA loop (one call per run of
equal lengths, what runs without the kernel) on the same packed q, k, v, in the same process, calls alternating:
milliseconds per layer (best of --rounds), the ratio, and each one's largest |out - float64 attention|.

    python eval/bench_attention.py                          # MiniLM, BERT-base, small Mistral, Gemma 3 shapes
    python eval/bench_attention.py --dtype bf16 --contention 2

Lengths: --texts random lengths in [--shortest, --longest] (seeded), or --lengths 256 256 17 ... as given.
"""

from __future__ import annotations

import math

import torch
from harness import measure, options, report

from st_fastbackend.engine import attention, cpu_kernel
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.runtime import Runtime

# (query heads, key heads, head size, causal)
SHAPES = {
    "minilm": (12, 12, 32, False), "bert-base": (12, 12, 64, False), "mistral-small": (8, 2, 64, True),
    "gemma3": (3, 1, 256, False),
}  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def exact(q, k, v, lengths, causal) -> torch.Tensor:
    """float64 attention, one sequence at a time."""
    out, start, group = [], 0, q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (t[start : start + n].double().transpose(0, 1) for t in (q, k, v))
        scores = qs @ ks.repeat_interleave(group, 0).transpose(1, 2) / math.sqrt(q.shape[-1])
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        out.append((scores.softmax(-1) @ vs.repeat_interleave(group, 0)).transpose(0, 1))
        start += n
    return torch.cat(out)


def call(kernel, q, k, v, batch, causal):
    runtime = Runtime(kernel, grouped_heads=True, window=True, is_causal=True, dtype=q.dtype)
    return lambda: attention.sdpa_attention(q, k, v, batch, causal=causal, window=None, runtime=runtime)


def main() -> None:
    parser = options.parser(__doc__)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--shortest", type=int, default=20)
    parser.add_argument("--longest", type=int, default=256)
    parser.add_argument("--lengths", nargs="+", type=int, help="these sequence lengths instead of random ones")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--contention", type=int, default=0, metavar="N", help="N busy processes beside the run")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    if dtype not in cpu_kernel.dtypes():
        parser.error(f"our kernel does not run {args.dtype} on this CPU (cpu_kernel.dtypes(): {cpu_kernel.dtypes()})")
    generator = torch.Generator().manual_seed(0)
    drawn = torch.randint(args.shortest, args.longest + 1, (args.texts,), generator=generator).tolist()
    lengths = args.lengths or drawn
    batch = PackedBatch.from_sequences([[0] * n for n in sorted(lengths, reverse=True)])  # packs come sorted
    print(report.machine(), f"\n{len(lengths)} sequences, {sum(lengths)} tokens, {args.dtype}, {args.contention} busy")
    for name in args.shapes:
        heads, kv_heads, head_dim, causal = SHAPES[name]
        q = torch.randn(sum(lengths), heads, head_dim, generator=generator).to(dtype)
        k, v = torch.randn(2, sum(lengths), kv_heads, head_dim, generator=generator).to(dtype)
        calls = {kernel: call(kernel, q, k, v, batch, causal) for kernel in ("cpu_kernel", "sdpa_loop")}
        with measure.contention(args.contention):
            rounds = measure.alternate(calls, args.rounds)
        reference = exact(q, k, v, list(batch.lengths), causal)
        best = {kernel: min(seconds) * 1e3 for kernel, seconds in rounds.seconds.items()}
        error = {kernel: (out.double() - reference).abs().max().item() for kernel, out in rounds.last.items()}
        print(f"{name:14} {heads}/{kv_heads} x {head_dim} {'causal' if causal else 'full  '}  "
              f"ours {best['cpu_kernel']:7.2f} ms  SDPA loop {best['sdpa_loop']:7.2f} ms  "
              f"{best['sdpa_loop'] / best['cpu_kernel']:.2f}x  max error {error['cpu_kernel']:.1e} / "
              f"{error['sdpa_loop']:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
