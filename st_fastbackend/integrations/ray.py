"""Ray Data: add an `embedding` column to a dataset, on a pool of actors that each load the fast model once.

    import ray
    from st_fastbackend.integrations.ray import embed_dataset

    ds = embed_dataset(ray.data.read_parquet("corpus/"), "intfloat/e5-base-v2", prompt="passage: ", num_workers=4)
    ds.write_parquet("embeddings/")

Needs the `ray` extra (pip install st_fastbackend[ray]); `import st_fastbackend` never imports ray.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

# encode() options the actors apply: the prompt, the packing budgets, unit length.
ENCODE_OPTIONS = ("prompt", "prompt_name", "batch_size", "max_tokens_per_batch", "normalize_embeddings")
# Rows an actor receives at once, sorted by length and packed together: few enough that a pool of actors ends
# together (a call is ~25 s for MiniLM on one CPU core), where blocks are no larger (see embed_dataset).
ROWS_PER_CALL = 512


class EmbedBatches:
    """The Ray Data actor: loads the model once, then embeds one batch (a pyarrow Table) per call."""

    def __init__(self, model: str, load_kwargs: dict[str, Any], text_column: str, threads: int | None,
                 matmul_precision: str | None, token_column: str | None, id_column: str | None,
                 encode_kwargs: dict[str, Any]) -> None:  # fmt: skip
        import torch

        from st_fastbackend import SentenceTransformer
        from st_fastbackend.corpus import TextEmbedder

        if threads:  # Ray sets OMP_NUM_THREADS from the actor's CPUs; said here, not left to the environment
            torch.set_num_threads(threads)
        if matmul_precision:  # a process-wide setting: each worker process sets its own
            torch.set_float32_matmul_precision(matmul_precision)
        load_kwargs = dict(load_kwargs)
        max_seq_length = load_kwargs.pop("max_seq_length", None)  # an attribute, not a constructor argument
        loaded = SentenceTransformer(model, backend="fast", **load_kwargs)
        if max_seq_length:
            loaded.max_seq_length = max_seq_length
        self.embed = TextEmbedder(loaded, **encode_kwargs)
        self.text_column, self.token_column, self.id_column = text_column, token_column, id_column

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow.compute as pc

        from st_fastbackend.corpus_io import invalid_rows
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


def embed_dataset(
    ds,
    model: str,
    *,
    text_column: str = "text",
    num_workers: int | None = None,
    gpus_per_worker: float = 0,
    cpus_per_worker: float = 1,
    load_kwargs: dict[str, Any] | None = None,
    matmul_precision: str | None = None,
    token_column: str | None = None,
    id_column: str | None = None,
    rows_per_call: int = ROWS_PER_CALL,
    **encode_kwargs,
):
    """`ds` with an `embedding` column (fixed-size lists of float32), as `model.encode` gives it.

    model: a folder every worker can read, or a Hub id. num_workers: a fixed pool of that many actors; None, a
    pool Ray grows from one as resources allow. Each actor holds `gpus_per_worker` GPUs (the model then loads
    on CUDA) and `cpus_per_worker` CPUs (PyTorch's thread count). load_kwargs: for SentenceTransformer(...),
    e.g. {"model_kwargs": {"dtype": torch.bfloat16}}, and max_seq_length. matmul_precision: each worker's
    torch.set_float32_matmul_precision. token_column: also a column of each row's token count (prompt
    included). id_column: errors name a row by its id (else by its place in a batch). encode_kwargs: prompt,
    prompt_name, batch_size, max_tokens_per_batch, normalize_embeddings. A null or non-string text, a text
    without any token, or a dataset that already has the `embedding` or token column fails the job.

    A block goes to one actor whole: split a dataset of few large blocks first, leaving a CPU beside the actors
    for that task, e.g. ds.repartition(target_num_rows_per_block=ROWS_PER_CALL), as embed-corpus --ray does."""
    import ray.data

    unknown = sorted(set(encode_kwargs) - set(ENCODE_OPTIONS))
    if unknown:
        raise TypeError(f"embed_dataset() does not take {', '.join(unknown)}; encode options: {ENCODE_OPTIONS}")
    if not isinstance(model, str):
        raise TypeError("embed_dataset() takes the model's folder or Hub id: each worker loads its own copy")
    load_kwargs = dict(load_kwargs or {})
    if gpus_per_worker:
        load_kwargs.setdefault("device", "cuda")
    pool = ray.data.ActorPoolStrategy(size=num_workers) if num_workers else ray.data.ActorPoolStrategy(min_size=1)
    threads = max(1, int(cpus_per_worker)) if not gpus_per_worker else None
    actor = dict(model=model, load_kwargs=load_kwargs, text_column=text_column, threads=threads,
                 matmul_precision=matmul_precision, token_column=token_column,
                 id_column=id_column, encode_kwargs=encode_kwargs)  # fmt: skip
    return ds.map_batches(
        EmbedBatches,
        batch_format="pyarrow",
        batch_size=rows_per_call,
        compute=pool,
        num_cpus=cpus_per_worker,
        num_gpus=gpus_per_worker or None,
        fn_constructor_kwargs=actor,
    )
