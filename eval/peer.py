"""One peer system for eval/bench.py --peers, run in the peer's own environment (its own venv), so that
the peer's dependencies (vLLM for CPU, optimum-intel for OpenVINO) never meet this project's.

    /path/to/vllm-venv/bin/python eval/peer.py --system vllm --model FOLDER --dtype fp32 \
        --texts texts.json --batch-size 32 --rounds 3 --out result.npz

Writes the embeddings of the first (untimed) call and the timed rounds' seconds to --out. Systems:
"vllm" (`LLM(runner="pooling")`, prefix cache off; threads from VLLM_CPU_OMP_THREADS_BIND),
"openvino" and "onnx" (sentence-transformers' own backends), "torch" (plain sentence-transformers: a
check of this protocol against the in-process plain run).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def load(system: str, model: str, dtype: str) -> Callable[[list[str], int], np.ndarray]:
    if system == "vllm":
        from vllm import LLM

        llm = LLM(model=model, runner="pooling", dtype=DTYPES[dtype], enable_prefix_caching=False)

        def embed(texts: list[str], batch_size: int) -> np.ndarray:  # vLLM schedules by tokens itself
            return np.array([out.outputs.embedding for out in llm.embed(texts, use_tqdm=False)], dtype=np.float32)

        return embed
    from sentence_transformers import SentenceTransformer

    if system == "torch":
        import torch

        kwargs = {"model_kwargs": {"dtype": getattr(torch, DTYPES[dtype])}}
    elif system in ("openvino", "onnx"):
        kwargs = {"backend": system}  # these backends choose their own precision
    else:
        raise ValueError(f"Unknown peer system {system!r}")
    st_model = SentenceTransformer(model, device="cpu", **kwargs)
    return lambda texts, batch_size: st_model.encode(texts, batch_size=batch_size).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", required=True, choices=["vllm", "openvino", "onnx", "torch"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--texts", required=True, help="a JSON list of strings")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.texts, encoding="utf8") as f:
        texts = json.load(f)
    embed = load(args.system, args.model, args.dtype)
    embed(texts[: args.batch_size], args.batch_size)  # warm-up
    embeddings = embed(texts, args.batch_size)
    seconds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        embed(texts, args.batch_size)
        seconds.append(time.perf_counter() - start)
    np.savez(args.out, embeddings=embeddings, seconds=np.array(seconds))


if __name__ == "__main__":
    main()
