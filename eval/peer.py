"""One peer system for eval/bench.py --peers, run in the peer's own environment (its own venv), so that
the peer's dependencies (vLLM for CPU, optimum-intel for OpenVINO) never meet this project's.

    /path/to/vllm-venv/bin/python eval/peer.py --system vllm --model FOLDER --dtype fp32 \
        --texts texts.json --batch-size 32 --rounds 3 --out result.npz

Writes the embeddings of the first (untimed) call and the timed rounds' seconds to --out. Systems:
"vllm" (`LLM(runner="pooling")`, prefix cache off; threads from VLLM_CPU_OMP_THREADS_BIND),
"openvino" and "onnx" (sentence-transformers' own backends), "torch" (plain sentence-transformers: a
check of this protocol against the in-process plain run), and sentence-transformers' own int8 exports of the
model: "onnx-int8" (export_dynamic_quantized_onnx_model, "avx512_vnni") and "openvino-int8"
(export_static_quantized_openvino_model, default OVQuantizationConfig; calibrated on 300 STS-B dev sentences
from --data-dir, in place of its default download of GLUE SST-2, which these machines cannot reach). Each export
is written once into a copy of the model folder under --work-dir and reused.

The peer venv these results used (a CPU torch, so pip fetches no CUDA build; the static int8 export needs datasets):

    python3 -m venv /tmp/stpeer && /tmp/stpeer/bin/pip install torch==2.13.0 \
        "sentence-transformers[onnx,openvino]==5.7.0" transformers==4.57.6 datasets==4.8.5
"""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from harness import data, measure, options  # standard library only: this runs under the peer's Python

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
SYSTEMS = ["vllm", "openvino", "onnx", "torch", "onnx-int8", "openvino-int8", "flagembedding-m3"]
# The file each int8 export writes, as sentence-transformers names it.
INT8_FILES = {
    "onnx-int8": "onnx/model_qint8_avx512_vnni.onnx",
    "openvino-int8": "openvino/openvino_model_qint8_quantized.xml",
}


def load(
    system: str, model: str, dtype: str, work_dir: Path | None = None, calibration: list[str] | None = None
) -> Callable[[list[str], int], np.ndarray]:
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
    elif system in INT8_FILES:
        model = int8_export(system, model, work_dir, calibration)
        kwargs = {"backend": system.removesuffix("-int8"), "model_kwargs": {"file_name": INT8_FILES[system]}}
    else:
        raise ValueError(f"Unknown peer system {system!r}")
    st_model = SentenceTransformer(model, device="cpu", **kwargs)
    return lambda texts, batch_size: st_model.encode(texts, batch_size=batch_size).astype(np.float32)


def int8_export(system: str, model: str, work_dir: Path, calibration: list[str]) -> str:
    """sentence-transformers' own int8 export of `model` in a copy of its folder (made once): the folder."""
    from sentence_transformers import (
        SentenceTransformer,
        export_dynamic_quantized_onnx_model,
        export_static_quantized_openvino_model,
    )

    folder = work_dir / f"{Path(model).name}-{system}"
    if (folder / INT8_FILES[system]).is_file():
        return str(folder)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(model, folder)
    readable_by_older_versions(folder)
    backend = system.removesuffix("-int8")
    exported = SentenceTransformer(str(folder), backend=backend, device="cpu")
    if system == "onnx-int8":
        export_dynamic_quantized_onnx_model(exported, "avx512_vnni", str(folder))
        return str(folder)
    dataset = work_dir / "calibration"  # a local dataset folder: datasets.load_dataset reads its train.csv
    dataset.mkdir(parents=True, exist_ok=True)
    with open(dataset / "train.csv", "w", encoding="utf8", newline="") as f:
        csv.writer(f).writerows([["sentence"], *([text] for text in calibration)])
    export_static_quantized_openvino_model(exported, None, str(folder), dataset_name=str(dataset),
                                           dataset_config_name="default", dataset_split="train",
                                           column_name="sentence")  # fmt: skip
    return str(folder)


def readable_copy(model: str, work_dir: Path) -> str:
    """A copy of `model` (made once, under work_dir) that the peer's older versions read."""
    folder = work_dir / f"{Path(model).name}-readable"
    if not folder.is_dir():
        part = folder.with_name(folder.name + ".part")  # renamed when whole: an interrupted copy is made again
        shutil.rmtree(part, ignore_errors=True)
        shutil.copytree(model, part)
        readable_by_older_versions(part)
        part.rename(folder)
    return str(folder)


def readable_by_older_versions(folder: Path) -> None:
    """A folder this project's versions wrote (eval/harness's small models), in the names the peers' older ones
    know: modules.json's classes under sentence-transformers' long-standing `sentence_transformers.models` names
    (sentence-transformers 6 writes new module paths), and a tokenizer.json-only tokenizer as transformers 4's
    PreTrainedTokenizerFast (transformers 5 calls it TokenizersBackend). The same modules and tokenizer."""
    modules = folder / "modules.json"
    if modules.is_file():  # a bare checkpoint has none
        entries = json.loads(modules.read_text())
        for entry in entries:  # sentence-transformers' own modules only
            if entry["type"].startswith("sentence_transformers."):
                entry["type"] = "sentence_transformers.models." + entry["type"].rsplit(".", 1)[1]
        modules.write_text(json.dumps(entries, indent=2))
    path = folder / "tokenizer_config.json"
    if path.is_file() and (config := json.loads(path.read_text())).get("tokenizer_class") == "TokenizersBackend":
        path.write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))


def flag_m3(model: str, texts: list[str], batch_size: int, rounds: int, max_length: int) -> dict:
    """BGEM3FlagModel.encode with all three outputs: the arrays of an untimed call and its peak memory, then the
    timed rounds. Lexical weights as concatenated ids and values with per-text counts; ColBERT vectors likewise."""
    from FlagEmbedding import BGEM3FlagModel

    m3 = BGEM3FlagModel(model, use_fp16=False, devices="cpu", passage_max_length=max_length)

    def embed(batch: list[str]) -> dict:
        return m3.encode(batch, batch_size=batch_size, return_dense=True, return_sparse=True,
                         return_colbert_vecs=True)  # fmt: skip

    embed(texts[:batch_size])  # warm-up
    loaded = measure.rss_bytes()
    with measure.PeakMemory("cpu") as memory:
        out = embed(texts)
    forwards = timed_forwards(m3.model)
    seconds = measure.alternate({"peer": lambda: embed(texts)}, rounds).seconds["peer"]
    # each encode() first runs its first (longest) batch once to find a batch size that fits, then every batch: the
    # first forward of each call is that probe
    probes = forwards[:: len(forwards) // rounds]
    lexical, colbert = out["lexical_weights"], out["colbert_vecs"]
    return dict(
        embeddings=out["dense_vecs"].astype(np.float32),
        sparse_ids=np.array([int(k) for row in lexical for k in row], dtype=np.int64),
        sparse_values=np.array([float(v) for row in lexical for v in row.values()], dtype=np.float32),
        sparse_counts=np.array([len(row) for row in lexical], dtype=np.int64),
        colbert=np.concatenate(colbert).astype(np.float32),
        colbert_counts=np.array([len(v) for v in colbert], dtype=np.int64),
        seconds=np.array(seconds), probe_seconds=np.array(probes), peak_extra_bytes=memory.extra,
        loaded_bytes=loaded, peak_rss_bytes=measure.peak_rss_bytes(),
    )  # fmt: skip


def timed_forwards(module) -> list[float]:
    """The seconds of each forward of `module` from now on (a pre-hook and a hook)."""
    import time

    seconds: list[float] = []
    module.register_forward_pre_hook(lambda *_: seconds.append(-time.perf_counter()))
    module.register_forward_hook(lambda *_: seconds.append(seconds.pop() + time.perf_counter()))
    return seconds


def main() -> None:
    parser = options.parser(__doc__, "batch_size", "rounds", "data_dir")
    parser.add_argument("--system", required=True, choices=SYSTEMS)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--texts", required=True, help="a JSON list of strings")
    parser.add_argument("--out", required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/st_fastbackend_peers"), help="int8 exports")
    parser.add_argument("--max-length", type=int, default=512, help="flagembedding-m3's passage_max_length")
    args = parser.parse_args()
    with open(args.texts, encoding="utf8") as f:
        texts = json.load(f)
    if args.system == "flagembedding-m3":
        folder = readable_copy(args.model, args.work_dir)
        np.savez(args.out, **flag_m3(folder, texts, args.batch_size, args.rounds, args.max_length))
        return
    dev = data.sts_sentences(args.data_dir, "dev", columns=("sentence1",))[:300]
    calibration = dev if args.system == "openvino-int8" else None
    embed = load(args.system, args.model, args.dtype, args.work_dir, calibration)
    embed(texts[: args.batch_size], args.batch_size)  # warm-up
    embeddings = embed(texts, args.batch_size)
    seconds = measure.alternate({"peer": lambda: embed(texts, args.batch_size)}, args.rounds).seconds["peer"]
    np.savez(args.out, embeddings=embeddings, seconds=np.array(seconds))


if __name__ == "__main__":
    main()
