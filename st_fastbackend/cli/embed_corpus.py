"""`st-fastbackend embed-corpus INPUT OUTPUT_DIR --model MODEL`: a whole corpus into parquet shards, resumably,
on this machine or (--ray) on Ray Data. The input is scanned and the output folder checked before the model
loads, so a bad row or another job's folder costs no waiting."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

from st_fastbackend.cli.files import CliError
from st_fastbackend.cli.options import (
    MATMUL_HELP,
    MATMUL_PRECISIONS,
    QUANTIZE_CHOICES,
    QUANTIZE_HELP,
    add_prompt_options,
    check_model,
    describe,
    dtype_name,
    first_line,
    has_hybrid_heads,
    load_model,
    model_kwargs,
    positive,
    saved_model_type,
)
from st_fastbackend.integrations.ray_pool import STALL_TIMEOUT, PoolError, worker_gpus

HELP = "embed a corpus (parquet, JSON Lines, CSV) into parquet shards, resumably; --ray runs it on Ray Data"


def add_embed_corpus(commands, formatter_class) -> None:
    corpus = commands.add_parser("embed-corpus", formatter_class=formatter_class, help=HELP, description=HELP)
    corpus.add_argument("input", help="a parquet file, a folder of parquet files, or a .jsonl / .csv file")
    corpus.add_argument("output_dir", help="where the shards, rejects.parquet and manifest.json go")
    corpus.add_argument("--model", required=True, help="a sentence-transformers folder or Hub id")
    corpus.add_argument("--text-column", default="text", help="the column to embed")
    corpus.add_argument("--id-column", default="id", help="the column written beside each embedding")
    add_prompt_options(corpus, "passage: ", "document")
    corpus.add_argument(
        "--batch-size",
        type=positive,
        default=32,
        help="texts per packed batch at most (a GPU; a CPU: the token budget)",
    )
    corpus.add_argument("--max-tokens-per-batch", type=positive, default=None,
                        help="tokens per packed batch; default: the model's, by device")  # fmt: skip
    corpus.add_argument("--dtype", type=dtype_name, default=None, metavar="{float32,bfloat16,float16,auto}",
                        help="model dtype (also fp32, bf16, fp16, half); default: the model's own")  # fmt: skip
    corpus.add_argument("--device", default=None, help="e.g. cpu, cuda (default: as sentence-transformers)")
    corpus.add_argument("--max-seq-length", type=positive, default=None, help="truncate inputs to this many tokens")
    corpus.add_argument("--matmul-precision", default=None, choices=MATMUL_PRECISIONS, help=MATMUL_HELP)
    corpus.add_argument("--shard-rows", type=positive, default=10_000, help="rows per output shard")
    corpus.add_argument("--quantize", default=None, choices=QUANTIZE_CHOICES, help=QUANTIZE_HELP)
    corpus.add_argument("--output-dtype", default="float32", choices=("float32", "float16"),
                        help="of the embeddings (a sparse model's values, a multi-vector one's vectors)")  # fmt: skip
    corpus.add_argument("--reuse", action="append", default=[], metavar="PREVIOUS_OUT",
                        help="an earlier output of the same model and options: its rows of texts in INPUT are copied, "
                             "not embedded again (repeatable)")  # fmt: skip
    corpus.add_argument("--skip-invalid", action="store_true",
                        help="list rows whose id or text is null, or whose text is not a string, in rejects.parquet, "
                             "not stop")  # fmt: skip
    corpus.add_argument("--skip-duplicate-ids", action="store_true",
                        help="list every row whose id other rows have too in rejects.parquet (none of them embedded), "
                             "not stop")  # fmt: skip
    corpus.add_argument("--outputs", type=_outputs, default=("dense",), metavar="dense,sparse,multi_vector",
                        help="a BGE-M3 folder's outputs (sparse_linear.pt and colbert_linear.pt beside it), one pass: "
                             "embedding, indices/values, multi_vector columns (default: dense)")  # fmt: skip
    chunks = corpus.add_argument_group("long documents: chunks instead of truncation (docs/long-documents.md)")
    chunks.add_argument(
        "--chunk-tokens",
        type=positive,
        default=None,
        help="text tokens per chunk; one row per chunk (id, chunk, char_start, char_end, embedding)",
    )
    chunks.add_argument("--chunk-overlap", type=int, default=None, help="tokens neighbouring chunks share (0)")
    chunks.add_argument(
        "--late", action="store_true", help="late chunking: each chunk pooled in its document's window"
    )
    chunks.add_argument("--aggregate", default=None, choices=("mean", "max", "first"),
                        help="one row per document: its chunks' mean (token-weighted), max or first")  # fmt: skip
    ray = corpus.add_argument_group("Ray Data (pip install st_fastbackend[ray])")
    ray.add_argument("--ray", action="store_true", help="run the job as a Ray Data pipeline")
    ray.add_argument("--ray-address", default=None, help="a running cluster; default: start Ray on this machine")
    ray.add_argument("--num-workers", type=positive, default=None,
                     help="actors, each with its own model; default: on this machine's CPUs one per --cpus-per-worker "
                          "(1) as memory allows, else 1")  # fmt: skip
    ray.add_argument("--gpus-per-worker", type=float, default=None,
                     help="GPUs per actor (a fraction shares one); default: 1 where --device, else this machine's "
                          "device, is CUDA, else 0")  # fmt: skip
    ray.add_argument("--cpus-per-worker", type=float, default=None,
                     help="CPUs (torch threads) per actor; default: this host's split, 1 on a cluster")  # fmt: skip
    ray.add_argument("--stall-timeout", type=float, default=None,
                     help="seconds without output while tasks wait for resources before the job fails naming them "
                          f"(default {STALL_TIMEOUT:g})")  # fmt: skip
    corpus.add_argument("--debug", action="store_true", help="show the traceback behind an error")


def embed_corpus(args: argparse.Namespace) -> None:
    from st_fastbackend.corpus import CorpusError
    from st_fastbackend.corpus.guard import folder_lock
    from st_fastbackend.corpus.identity import output_width
    from st_fastbackend.corpus.read import Columns, input_files, scan_input

    if importlib.util.find_spec("pyarrow") is None:
        raise CliError("embed-corpus reads and writes through pyarrow: pip install pyarrow")
    kind = _output_kind(args)
    _check_ray_options(args)
    args.chunking = _chunking(args)
    check_model(args.model)
    try:
        scan = scan_input(input_files(args.input), Columns(args.id_column, args.text_column), not args.skip_invalid,
                          not args.skip_duplicate_ids)  # fmt: skip
        folder = _output_folder(args, scan, kind)
        with folder_lock(folder.path):  # held until the job ends: one job per folder
            rejected = 0 if scan.rejects is None else scan.rejects.num_rows
            done = folder.prepare(scan.rows - rejected, output_width(args.model))
            for line in folder.untrusted:
                print(f"st-fastbackend: warning: {line}", file=sys.stderr)
            (_run_ray if args.ray else _run_local)(args, scan, folder, done, _row_index(args, folder))
    except CorpusError as error:
        raise CliError(str(error)) from error


def _output_folder(args: argparse.Namespace, scan, kind):
    """The folder with the identity of this job: everything its rows depend on (the model's files say its kind)."""
    from st_fastbackend.corpus.identity import model_identity
    from st_fastbackend.corpus.output import JobSpec, OutputFolder, model_name

    spec = JobSpec(model_name(args.model), model_identity(args.model), scan.fingerprint, args.id_column,
                   args.text_column, args.prompt, args.prompt_name, args.output_dtype, args.max_seq_length, args.dtype,
                   args.matmul_precision, args.chunking, args.quantize)  # fmt: skip
    return OutputFolder(args.output_dir, spec, kind)


def _row_index(args: argparse.Namespace, folder):
    """Where the rows already embedded are: the --reuse outputs (checked now, before the model loads) and this
    folder's complete shards."""
    from pathlib import Path

    from st_fastbackend.corpus.reuse import RowIndex, row_columns

    index = RowIndex(row_columns(folder))
    for path in args.reuse:
        index.add_output(Path(path), folder)
    for shard in folder.shards():  # those prepare() trusts
        index.add_shard(shard)
    return index


def _outputs(value: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(","))
    if not names or not set(names) <= {"dense", "sparse", "multi_vector"} or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"{value!r}: a comma-separated subset of dense, sparse, multi_vector")
    return tuple(name for name in ("dense", "sparse", "multi_vector") if name in names)


def _output_kind(args: argparse.Namespace):
    """The rows the model's class gives (output.py's OUTPUT_KINDS), read from its folder before it loads; what the
    job cannot do with a sparse or multi-vector model is refused now."""
    from st_fastbackend.corpus.output import DENSE, OUTPUT_KINDS, hybrid_kind

    model_class = saved_model_type(args.model) or "SentenceTransformer"
    if model_class not in OUTPUT_KINDS:
        raise CliError(f"{args.model} is a {model_class}; embed-corpus takes {', '.join(OUTPUT_KINDS)} models")
    kind = OUTPUT_KINDS[model_class]
    if args.outputs != ("dense",):
        if model_class != "SentenceTransformer" or not has_hybrid_heads(args.model):
            raise CliError(f"--outputs {','.join(args.outputs)} needs a BGE-M3 folder (sparse_linear.pt and "
                           f"colbert_linear.pt beside a SentenceTransformer); {args.model} is not one")  # fmt: skip
        if args.prompt is not None or args.prompt_name is not None:
            raise CliError("--outputs other than dense embeds documents as BGE-M3 does, without a prompt")
        model_class, kind = "HybridEncoder", hybrid_kind(args.outputs)
    if kind == DENSE:
        return kind
    if args.ray:
        raise CliError(f"--ray embeds with SentenceTransformer models only; {args.model} is a {model_class}: "
                       f"run the job on this machine (without --ray), which writes its {' and '.join(kind.columns)} "
                       "columns")  # fmt: skip
    if args.chunk_tokens is not None:  # its other options need it (_chunking)
        raise CliError(f"--chunk-tokens cuts a SentenceTransformer's documents into chunks; {args.model} is a "
                       f"{model_class}: embed each document whole (--max-seq-length truncates it)")  # fmt: skip
    return kind


def _chunking(args: argparse.Namespace) -> dict | None:
    """The job's Chunking as a dict (recorded in the folder's identity), checked before the model loads."""
    from st_fastbackend.models.chunking import Chunking

    given = [f"--{name}" for name, value in (("chunk-overlap", args.chunk_overlap), ("late", args.late or None),
                                             ("aggregate", args.aggregate)) if value is not None]  # fmt: skip
    if args.chunk_tokens is None:
        if given:
            raise CliError(f"{', '.join(given)} need --chunk-tokens")
        return None
    if args.ray:
        raise CliError("--chunk-tokens runs on this machine only, not with --ray")
    options = {"tokens": args.chunk_tokens, "overlap": args.chunk_overlap or 0, "aggregate": args.aggregate,
               "late": args.late}  # fmt: skip
    try:
        Chunking(**options)
    except ValueError as error:
        raise CliError(str(error).replace("Chunking.overlap", "--chunk-overlap")) from error
    return options


def _check_ray_options(args: argparse.Namespace) -> None:
    names = ("ray_address", "num_workers", "cpus_per_worker", "gpus_per_worker", "stall_timeout")
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) is not None]
    if given and not args.ray:
        raise CliError(f"{', '.join(given)} need --ray")
    if args.ray and importlib.util.find_spec("ray") is None:
        raise CliError("--ray needs Ray Data: pip install 'st_fastbackend[ray]'")
    if args.stall_timeout is not None and not args.stall_timeout > 0:
        raise CliError(f"--stall-timeout must be positive seconds, got {args.stall_timeout:g}")
    if args.ray:  # before the model loads: a CUDA device with no GPU per actor cannot load in any of them
        try:
            worker_gpus(args.gpus_per_worker, args.device)
        except PoolError as error:
            raise CliError(str(error)) from error


def _run_local(args, scan, folder, done, index) -> None:
    from st_fastbackend.corpus.job import embedder_for, run_local
    from st_fastbackend.corpus.output import OUTPUT_KINDS
    from st_fastbackend.models.chunking import Chunking

    model = load_model(args, kinds=(*OUTPUT_KINDS, *(["HybridEncoder"] if args.outputs != ("dense",) else [])))
    try:
        embed = embedder_for(model, prompt=args.prompt, prompt_name=args.prompt_name, batch_size=args.batch_size,
                             outputs=args.outputs,
                             max_tokens_per_batch=args.max_tokens_per_batch,
                             chunking=Chunking(**args.chunking) if args.chunking else None)  # fmt: skip
    except ValueError as error:  # an unknown prompt name
        raise CliError(first_line(error)) from error
    progress = run_local(scan, folder, done, embed, args.shard_rows, index)
    seconds = time.perf_counter() - progress.started
    print(f"{_written(progress.rows, progress.reused, progress.deduplicated, _length(done), scan)}, "
          f"{progress.shards} new shards; {progress.tokens} tokens "
          f"in {seconds:.2f}s ({progress.tokens_per_second():.0f} tokens/s); {describe(model)} -> {args.output_dir}",
          file=sys.stderr)  # fmt: skip


def _run_ray(args, scan, folder, done, index) -> None:
    import ray
    import ray.data
    from sentence_transformers.util import get_device_name

    from st_fastbackend.corpus.job import run_local
    from st_fastbackend.corpus.on_ray import (
        NothingToEmbed,
        copy_plan,
        layout_here,
        run_ray,
        shard_dimension,
        start_ray,
        written_ids,
    )

    workers, cpus = args.num_workers or 1, args.cpus_per_worker or 1
    if not (args.ray_address or ray.is_initialized() or args.gpus_per_worker):  # Ray on this machine
        on_cpu = (args.device or get_device_name()).startswith("cpu")  # a copy per CPU would not fit a GPU
        workers, cpus = layout_here(args.model, on_cpu, args.num_workers, args.cpus_per_worker)
    start_ray(args.ray_address, cpus * workers)
    gpus = worker_gpus(args.gpus_per_worker, args.device)  # checked in _check_ray_options
    options = dict(num_workers=workers, gpus_per_worker=gpus, cpus_per_worker=cpus,
                   stall_timeout=args.stall_timeout or STALL_TIMEOUT,
                   load_kwargs=_load_kwargs(args), matmul_precision=args.matmul_precision, prompt=args.prompt,
                   prompt_name=args.prompt_name, batch_size=args.batch_size,
                   max_tokens_per_batch=args.max_tokens_per_batch)  # fmt: skip
    context = ray.data.DataContext.get_current()
    wrapped = context.raise_original_map_exception
    context.raise_original_map_exception = True  # a worker's error arrives as it raised it, under Ray's `cause`
    copied, left = copy_plan(scan, folder, done, index)
    rows, tokens, seconds = 0, 0, 0.0
    try:
        if left:
            rows, tokens, seconds = run_ray(scan, folder, copied, args.model, options, args.shard_rows)
    except PoolError as error:  # a pool this cluster cannot run, refused before any task
        raise CliError(str(error)) from error
    except Exception as error:  # one line (the worker's own error where there is one); --debug shows it whole
        if args.debug:
            raise
        raise CliError(f"the Ray job failed: {first_line(getattr(error, 'cause', None) or error)}") from error
    finally:
        context.raise_original_map_exception = wrapped
    for shard in folder.shards():  # the Ray job's (this folder's others are in the index already)
        index.add_shard(shard)
    dimension = shard_dimension(folder.shards() or sorted({place.shard for place in index.places.values()}))
    copy = run_local(scan, folder, written_ids(folder), NothingToEmbed(dimension, args.prompt), args.shard_rows, index)
    seconds += time.perf_counter() - copy.started
    print(f"{_written(rows + copy.rows, copy.reused, copy.deduplicated, _length(done), scan)}; {tokens} tokens in "
          f"{seconds:.2f}s ({tokens / max(seconds, 1e-9):.0f} tokens/s) on Ray Data ({workers} workers) -> "
          f"{args.output_dir}", file=sys.stderr)  # fmt: skip


def _load_kwargs(args) -> dict:
    """SentenceTransformer(...)'s keywords for the workers, as load_model() gives them here."""
    kwargs: dict = {"max_seq_length": args.max_seq_length} if args.max_seq_length else {}
    if args.device:
        kwargs["device"] = args.device
    if loading := model_kwargs(args):
        kwargs["model_kwargs"] = loading
    return kwargs


def _written(rows: int, reused: int, deduplicated: int, done_before: int, scan) -> str:
    rejected = 0 if scan.rejects is None else scan.rejects.num_rows
    return (f"{rows} rows written: {reused} reused, {deduplicated} deduplicated, {rows - reused - deduplicated} "
            f"embedded ({done_before} done before, {rejected} rejected, {scan.rows} in the input)")  # fmt: skip


def _length(done) -> int:
    return 0 if done is None else len(done)
