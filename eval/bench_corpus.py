"""A whole corpus embedded three ways, each a fresh process timed from start to finish (imports, model load,
reading, embedding, writing parquet): a plain loop over `model.encode` (what users write today, with the fast
backend), `st-fastbackend embed-corpus`, and `embed-corpus --ray` (Ray Data on this machine). Prints seconds,
rows/s, the ratios to the plain loop, Ray's overhead over embed-corpus (goal: at most 15%), and max |diff|
between the loop's and the job's embeddings, id by id.

    python eval/bench_corpus.py                           # 20,000 Wikipedia paragraphs and the SciFact corpus
    python eval/bench_corpus.py --wiki-rows 4000 --scifact-rows 1000   # a busy 2-core machine
    python eval/bench_corpus.py --no-loop                 # embed-corpus and --ray only: Ray's overhead
    python eval/bench_corpus.py --reindex                 # SciFact edited, re-embedded with --reuse (issue 49)
    python eval/bench_corpus.py --reindex --model bge-small   # the same at bge-small-en-v1.5's shape (random weights)

WikiText-2's test split has 2,185 paragraphs (../shared/data/wikitext2/SOURCE.md): the Wikipedia corpus cycles
through them to --wiki-rows rows, each with its own id. SciFact's 5,183 documents are embedded as MTEB
embeds them, title + " " + text. The inputs are written to a temporary folder, never into the repository.

--reindex: the SciFact corpus embedded whole, then a nightly edit of it (EDITED of the documents changed, DELETED
removed, ADDED new ones from Wikipedia appended) embedded twice: with --reuse of the first output, and whole. Prints
both times, their ratio (goal: at most 10%), the counts the --reuse run gives, and checks every row against the
whole run: the same ids and content keys, embeddings within max |diff|.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from harness import data, models, options

SHARD_ROWS = 10_000
BATCH_SIZE = 32
METHODS = {"encode loop": "loop", "embed-corpus": "job", "embed-corpus --ray": "ray"}  # -> output folder suffix


def wiki_corpus(data_dir: Path, rows: int, path: Path) -> Path:
    paragraphs = data.paragraphs(data_dir)
    texts = [paragraphs[i % len(paragraphs)] for i in range(rows)]
    pq.write_table(pa.table({"id": [f"wiki-{i}" for i in range(rows)], "text": texts}), path)
    return path


def scifact_corpus(data_dir: Path, rows: int | None, path: Path) -> Path:
    docs = data.scifact_corpus(data_dir)[:rows]
    pq.write_table(pa.table({"id": [doc["_id"] for doc in docs], "text": list(map(data.document, docs))}), path)
    return path


EDITED, DELETED, ADDED = 0.05, 0.01, 0.02


def nightly_edit(data_dir: Path, corpus: Path, path: Path) -> Path:
    """`corpus` with every 20th document's text changed, every 100th removed and 2% more appended, in its order."""
    table = pq.read_table(corpus)
    ids, texts = table.column("id").to_pylist(), table.column("text").to_pylist()
    edited = [(i, f"{text} (revised)" if k % round(1 / EDITED) == 7 else text)
              for k, (i, text) in enumerate(zip(ids, texts, strict=True)) if k % round(1 / DELETED) != 3]  # fmt: skip
    paragraphs = data.paragraphs(data_dir)
    edited += [(f"added-{k}", paragraphs[k % len(paragraphs)]) for k in range(round(ADDED * len(ids)))]
    pq.write_table(pa.table({"id": [i for i, _ in edited], "text": [text for _, text in edited]}), path)
    return path


def run_reindex(data_dir: Path, corpus: Path, work: Path, model: str) -> None:
    cli = [sys.executable, "-m", "st_fastbackend.cli", "embed-corpus"]
    common = ["--model", model, "--batch-size", str(BATCH_SIZE), "--shard-rows", str(SHARD_ROWS), "--device", "cpu"]
    edited = nightly_edit(data_dir, corpus, work / "scifact-edited.parquet")
    seconds, _ = timed([*cli, str(corpus), str(work / "first"), *common])
    print(f"  first full run {seconds:.1f}s", flush=True)
    reuse, summary = timed([*cli, str(edited), str(work / "reused"), *common, "--reuse", str(work / "first")])
    print(f"  edited, --reuse: {reuse:.1f}s ({summary})", flush=True)
    full, _ = timed([*cli, str(edited), str(work / "full"), *common])
    print(f"  edited, full run: {full:.1f}s", flush=True)
    got, clean = (shards(work / name).sort_by("id").select(["id", "content_key"]) for name in ("reused", "full"))
    assert got.equals(clean), "the outputs hold other ids or content keys"
    reused, whole = embeddings(work / "reused"), embeddings(work / "full")
    diff = max(np.abs(reused[k] - whole[k]).max() for k in whole)
    print(f"\nscifact re-index: {len(got)} rows ({EDITED:.0%} edited, {DELETED:.0%} deleted, {ADDED:.0%} added)")
    print(f"--reuse {reuse:.1f}s, full run {full:.1f}s: {reuse / full:.1%} of the full run (goal: at most 10%); "
          f"every row's id and key equal, max |diff| {diff:.1e}")  # fmt: skip


def encode_loop(corpus: str, output: str, model_name: str) -> None:
    """What a user writes today: read a chunk, encode it, write it."""
    from st_fastbackend import SentenceTransformer

    model = SentenceTransformer(model_name, backend="fast", device="cpu")
    Path(output).mkdir(parents=True)
    for index, batch in enumerate(pq.ParquetFile(corpus).iter_batches(batch_size=SHARD_ROWS)):
        rows = model.encode(batch.column("text").to_pylist(), batch_size=BATCH_SIZE)
        embedding = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])
        table = pa.table({"id": batch.column("id"), "embedding": embedding})
        pq.write_table(table, f"{output}/part-{index:05d}.parquet")


def timed(command: list[str]) -> tuple[float, str]:
    """Seconds, and the command's last line on stderr (embed-corpus's summary: its layout on Ray)."""
    start = time.perf_counter()
    run = subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=3 * 3600)
    return time.perf_counter() - start, (run.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]


def shards(folder: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(shard) for shard in sorted(folder.glob("part-*.parquet")))


def embeddings(folder: Path) -> dict:
    table = shards(folder)
    values = table.column("embedding").combine_chunks()
    rows = np.asarray(values.flatten()).reshape(len(table), values.type.list_size)
    return dict(zip(table.column("id").to_pylist(), rows, strict=True))


def run_corpus(name: str, corpus: Path, work: Path, model: str, ray_workers: int | None, loop: bool) -> dict:
    cli = [sys.executable, "-m", "st_fastbackend.cli", "embed-corpus", str(corpus)]
    common = ["--model", model, "--batch-size", str(BATCH_SIZE), "--shard-rows", str(SHARD_ROWS), "--device", "cpu"]
    workers = ["--num-workers", str(ray_workers)] if ray_workers else []  # else the CLI's: one per CPU
    out = {method: work / f"{name}-{suffix}" for method, suffix in METHODS.items()}
    commands = {
        "encode loop": [sys.executable, __file__, "--loop", str(corpus), str(out["encode loop"]), model],
        "embed-corpus": [*cli, str(out["embed-corpus"]), *common],
        "embed-corpus --ray": [*cli, str(out["embed-corpus --ray"]), *common, "--ray", *workers],
    }
    if not loop:
        del out["encode loop"]
    seconds = {}
    for method in out:
        seconds[method], summary = timed(commands[method])
        print(f"  {name}: {method} {seconds[method]:.1f}s ({summary})", flush=True)
    first, *others = (embeddings(folder) for folder in out.values())
    assert all(first.keys() == other.keys() for other in others), "the outputs hold different ids"
    diff = max(np.abs(first[k] - other[k]).max() for other in others for k in first)
    return {"corpus": name, "rows": len(first), "seconds": seconds, "max_diff": float(diff)}


def report(result: dict) -> None:
    seconds, rows = result["seconds"], result["rows"]
    base_method = next(iter(seconds))
    base = seconds[base_method]
    print(f"\n{result['corpus']}: {rows} rows, max |diff| against {base_method} {result['max_diff']:.1e}")
    print(f"{'method':<20}{'seconds':>10}{'rows/s':>10}{'vs ' + base_method:>20}")
    for method, value in seconds.items():
        print(f"{method:<20}{value:>10.1f}{rows / value:>10.1f}{base / value:>19.2f}x")
    overhead = seconds["embed-corpus --ray"] / seconds["embed-corpus"] - 1
    print(f"Ray's overhead over embed-corpus: {overhead:+.1%} (goal: at most +15%)")


def main() -> None:
    if sys.argv[1:2] == ["--loop"]:
        encode_loop(*sys.argv[2:5])
        return
    parser = options.parser(__doc__, "data_dir", "model")
    parser.add_argument("--wiki-rows", type=int, default=20_000, help="Wikipedia paragraphs (cycled) to embed")
    parser.add_argument("--scifact-rows", type=int, default=None, help="the first N documents (default: all 5,183)")
    parser.add_argument("--corpora", nargs="+", default=["wiki", "scifact"], choices=["wiki", "scifact"])
    parser.add_argument("--ray-workers", type=int, default=None, help="actors; default: embed-corpus's layout")
    parser.add_argument("--no-loop", action="store_true", help="only embed-corpus and --ray (Ray's overhead)")
    parser.add_argument("--reindex", action="store_true", help="SciFact edited, re-embedded with --reuse")
    args = parser.parse_args()
    if not Path(args.model).is_dir():  # a name of harness.models.model_path: built once, in this process
        args.model = models.model_path(args.model)
    if args.reindex:
        with tempfile.TemporaryDirectory(prefix="bench_corpus_") as tmp:
            work = Path(tmp)
            run_reindex(args.data_dir, scifact_corpus(args.data_dir, args.scifact_rows, work / "scifact.parquet"),
                        work, args.model)  # fmt: skip
        return
    print(f"model {args.model}, {os.cpu_count()} CPUs, batch size {BATCH_SIZE}, shards of {SHARD_ROWS} rows")
    with tempfile.TemporaryDirectory(prefix="bench_corpus_") as tmp:
        work = Path(tmp)
        inputs = {}
        if "wiki" in args.corpora:
            inputs["wiki"] = wiki_corpus(args.data_dir, args.wiki_rows, work / "wiki.parquet")
        if "scifact" in args.corpora:
            inputs["scifact"] = scifact_corpus(args.data_dir, args.scifact_rows, work / "scifact.parquet")
        results = [run_corpus(name, corpus, work, args.model, args.ray_workers, not args.no_loop)
                   for name, corpus in inputs.items()]  # fmt: skip
    for result in results:
        report(result)


if __name__ == "__main__":
    main()
