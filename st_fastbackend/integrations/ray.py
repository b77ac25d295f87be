"""Ray Data: add an `embedding` column to a dataset, on a pool of actors that each load the fast model once.

    import ray
    from st_fastbackend.integrations.ray import embed_dataset

    ds = embed_dataset(ray.data.read_parquet("corpus/"), "intfloat/e5-base-v2", prompt="passage: ", num_workers=2)
    ds.write_parquet("embeddings/")

The pool always leaves a CPU of the cluster to Ray Data's read and write tasks (a pool that took them all would
wait for ever); where the driver's device is CUDA each actor holds a GPU by default.

Needs the `ray` extra (pip install st_fastbackend[ray]); `import st_fastbackend` never imports ray.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from st_fastbackend.integrations.ray_pool import STALL_TIMEOUT

# encode() options the actors apply: the prompt, the packing budgets, unit length.
ENCODE_OPTIONS = ("prompt", "prompt_name", "batch_size", "max_tokens_per_batch", "normalize_embeddings")
# Rows an actor receives at once, sorted by length and packed together: few enough that a pool of actors ends
# together (a call is ~25 s for MiniLM on one CPU core), where blocks are no larger (see embed_dataset).
ROWS_PER_CALL = 512


class EmbedBatches:
    """The Ray Data actor: loads the model once, then embeds one batch (a pyarrow Table) per call."""

    def __init__(self, model: str, load_kwargs: dict[str, Any], text_column: str, threads: int | None,
                 matmul_precision: str | None, token_column: str | None, id_column: str | None,
                 encode_kwargs: dict[str, Any], gpu_share: float = 0) -> None:  # fmt: skip
        import torch

        from st_fastbackend import SentenceTransformer
        from st_fastbackend.corpus.job import TextEmbedder

        if threads:  # Ray sets OMP_NUM_THREADS from the actor's CPUs; said here, not left to the environment
            torch.set_num_threads(threads)
        if matmul_precision:  # a process-wide setting: each worker process sets its own
            torch.set_float32_matmul_precision(matmul_precision)
        load_kwargs = dict(load_kwargs)
        max_seq_length = load_kwargs.pop("max_seq_length", None)  # an attribute, not a constructor argument
        loaded = SentenceTransformer(model, backend="fast", **load_kwargs)
        if max_seq_length:
            loaded.max_seq_length = max_seq_length
        layer = loaded[0]
        budget = share_budget(layer.config, next(layer.parameters()).dtype, loaded.device, gpu_share)
        if budget:
            loaded.max_tokens_per_batch = budget
        self.embed = TextEmbedder(loaded, **encode_kwargs)
        self.text_column, self.token_column, self.id_column = text_column, token_column, id_column

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow.compute as pc

        from st_fastbackend.corpus.read import invalid_rows
        from st_fastbackend.modules.tokenizer import NoTokensError

        if self.id_column and self.id_column not in batch.column_names:
            raise ValueError(f"embed_dataset(id_column={self.id_column!r}): the dataset has no such column")
        for added in ("embedding", self.token_column):
            if added and added in batch.column_names:
                other = " (or pass another token_column)" if added == self.token_column else ""
                raise ValueError(f"the dataset already has a column {added!r}, which embed_dataset adds: rename "
                                 f"or drop it first{other}")  # fmt: skip
        invalid, reason = invalid_rows(batch, self.text_column)
        if pc.any(invalid).as_py():
            raise ValueError(f"{self._row(batch, pc.index(invalid, True).as_py())} cannot be embedded: {reason}")
        try:
            rows, tokens = self.embed(batch.column(self.text_column).to_pylist())
        except NoTokensError as error:
            raise ValueError(error.about(self._row(batch, error.index))) from error
        embedding = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])
        batch = batch.append_column("embedding", embedding)
        return batch.append_column(self.token_column, pa.array(tokens)) if self.token_column else batch

    def _row(self, batch: pa.Table, index: int) -> str:
        """The row an error is about: by its id where the id column is known, else by its place in the batch."""
        if self.id_column:
            return f"the row with {self.id_column} {batch.column(self.id_column)[index].as_py()!r}"
        return f"row {index} of a batch of {len(batch)}"


def share_budget(config, dtype, device, share: float) -> int | None:
    """Tokens per pack for an actor that holds `share` (< 1) of a GPU: sized on that part of it, as the others on
    the GPU see the same free memory; None (the model's own budget) on a whole GPU or none."""
    from st_fastbackend.engine.schedule import cuda_max_tokens

    if device.type != "cuda" or not 0 < share < 1:
        return None
    return cuda_max_tokens(config, dtype, device, share=share)


def embed_dataset(
    ds,
    model: str,
    *,
    text_column: str = "text",
    num_workers: int | None = None,
    gpus_per_worker: float | None = None,
    cpus_per_worker: float = 1,
    load_kwargs: dict[str, Any] | None = None,
    matmul_precision: str | None = None,
    token_column: str | None = None,
    id_column: str | None = None,
    rows_per_call: int = ROWS_PER_CALL,
    stall_timeout: float | None = STALL_TIMEOUT,
    **encode_kwargs,
):
    """`ds` with an `embedding` column (fixed-size lists of float32), as `model.encode` gives it.

    model: a folder every worker can read, or a Hub id. num_workers: a fixed pool of that many actors; None, a
    pool Ray grows from one as resources allow. Each actor holds `gpus_per_worker` GPUs (the model then loads on
    CUDA; default: one where load_kwargs' device, else the driver's, is CUDA, else none; a fraction sizes the
    token budget on that part of the GPU) and `cpus_per_worker` CPUs (PyTorch's thread count). The pool leaves
    one of the cluster's CPUs to Ray Data's read and write tasks: fewer actors where num_workers is None, a part
    of a CPU each where the named workers would take them all (logged); more workers than the CPUs hold is
    refused. stall_timeout: seconds without output while tasks wait for resources before the job fails naming
    them (None: wait). load_kwargs: for SentenceTransformer(...),
    e.g. {"model_kwargs": {"dtype": torch.bfloat16}}, and max_seq_length. matmul_precision: each worker's
    torch.set_float32_matmul_precision. token_column: also a column of each row's token count (prompt
    included). id_column: errors name a row by its id (else by its place in a batch). encode_kwargs: prompt,
    prompt_name, batch_size, max_tokens_per_batch, normalize_embeddings. A null or non-string text, a text
    without any token, or a dataset that already has the `embedding` or token column fails the job.

    A block goes to one actor whole: split a dataset of few large blocks first, e.g.
    ds.repartition(target_num_rows_per_block=ROWS_PER_CALL), as embed-corpus --ray does."""
    from st_fastbackend.integrations.ray_pool import cluster_resources, fit_pool, worker_gpus
    from st_fastbackend.integrations.ray_stall import guard_stalls

    unknown = sorted(set(encode_kwargs) - set(ENCODE_OPTIONS))
    if unknown:
        raise TypeError(f"embed_dataset() does not take {', '.join(unknown)}; encode options: {ENCODE_OPTIONS}")
    if not isinstance(model, str):
        raise TypeError("embed_dataset() takes the model's folder or Hub id: each worker loads its own copy")
    load_kwargs = dict(load_kwargs or {})
    gpus = worker_gpus(gpus_per_worker, load_kwargs.get("device"))
    if gpus:
        load_kwargs.setdefault("device", "cuda")
    pool = fit_pool(num_workers, cpus_per_worker, gpus, *cluster_resources())
    threads = max(1, int(cpus_per_worker)) if not gpus else None  # as asked, whatever part of a CPU Ray reserves
    actor = dict(model=model, load_kwargs=load_kwargs, text_column=text_column, threads=threads,
                 matmul_precision=matmul_precision, token_column=token_column,
                 id_column=id_column, encode_kwargs=encode_kwargs, gpu_share=gpus)  # fmt: skip
    out = ds.map_batches(
        EmbedBatches,
        batch_format="pyarrow",
        batch_size=rows_per_call,
        compute=pool.strategy(),
        num_cpus=pool.cpus,
        num_gpus=pool.gpus or None,
        fn_constructor_kwargs=actor,
    )
    if stall_timeout is not None:
        guard_stalls(out.context, stall_timeout)
    return out
