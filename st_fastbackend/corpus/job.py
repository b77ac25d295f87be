"""The corpus job on one machine: the rows still to embed, streamed from the input a shard at a time, run
through the one packing schedule (embedder.py, engine/schedule.py; a SparseEncoder's or MultiVectorEncoder's
encode_document runs it too), each shard written whole or not at all (output.py). The Ray job (on_ray.py) uses
the same pieces on its workers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from st_fastbackend.corpus.output import HybridRows, MultiVectorRows, OutputFolder, SparseRows, new_run_name
from st_fastbackend.corpus.read import (
    Columns,
    CorpusError,
    InputScan,
    ids_to_skip,
    in_shards,
    read_batches,
    still_to_embed,
)
from st_fastbackend.corpus.reuse import RowIndex, content_keys, numbers_identity, shard_table
from st_fastbackend.embedder import DOCUMENT_PROMPTS, Embedder
from st_fastbackend.engine.schedule import texts_per_pack
from st_fastbackend.models.chunked import aggregate, pipeline_normalizes
from st_fastbackend.models.chunking import Chunking
from st_fastbackend.modules.tokenizer import NoTokensError


class TextEmbedder:
    """Texts -> float32 embeddings [n, dim] as the model's encode() gives them (its prompt, its packing), and
    each text's tokens (its prompt's included). The token budget learned from running out of memory is kept
    from call to call. A text without any token raises NoTokensError (its position)."""

    def __init__(self, model, *, prompt: str | None = None, prompt_name: str | None = None, batch_size: int = 32,
                 max_tokens_per_batch: int | None = None, normalize_embeddings: bool = False,
                 chunking: Chunking | None = None) -> None:  # fmt: skip
        model.eval()
        self.model, self.chunking = model, chunking
        self.embedder = Embedder(model)
        self.prompt = self.embedder.resolve_prompt(prompt, prompt_name)  # ValueError for an unknown name
        self.dimension = self.embedder.dimension
        self.batch_size, self.normalize = batch_size, normalize_embeddings
        self.max_tokens = max_tokens_per_batch or model.max_tokens_per_batch

    @torch.inference_mode()
    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        sequences = self.embedder.tokenize(texts, self.prompt)
        rows = np.empty((len(texts), self.dimension), np.float32)
        options = {"output_value": "sentence_embedding", "save_to_cpu": False, "truncate_dim": None,
                   "normalize_embeddings": False}  # fmt: skip
        rule = self.model.pack_rows(self.prompt, options)  # the class's row rule, as encode() runs it
        schedule = self.embedder.schedule(
            self.prompt, texts_per_pack(self.batch_size, self.model.device), self.max_tokens
        )
        for picked, out in schedule.run(sequences):
            embeddings = rule.rows(out)[0].float()
            if self.normalize:  # in fp32, whatever the model's dtype
                embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=1)
            rows[picked] = embeddings.cpu().numpy()
        self.max_tokens = schedule.max_tokens
        return rows, np.array([len(ids) for ids in sequences], np.int64)

    def chunks(self, texts: list[str]) -> tuple[np.ndarray, int, dict[str, Any]]:
        """--chunk-tokens: (rows, tokens run, columns): one row per chunk (columns: `row`, the text's position,
        `chunk`, `char_start`, `char_end`), or per text with an aggregate (columns: only `row`)."""
        found = self.model.encode_chunks(texts, self.chunking, prompt=self.prompt, batch_size=self.batch_size,
                                         normalize_embeddings=self.normalize,
                                         max_tokens_per_batch=self.max_tokens)  # fmt: skip
        around = self.model[0].texts.document("", self.prompt)  # what every chunk runs besides its own tokens
        tokens = sum(e - s + len(around.head) + len(around.tail) for c in found for s, e in c.token_spans)
        how = self.chunking.aggregate
        if how is not None:
            normalizes = pipeline_normalizes(self.model, self.normalize)
            rows = [aggregate(torch.from_numpy(c.embeddings), c.token_spans, how, normalizes) for c in found]
            return torch.stack(rows).float().numpy(), tokens, {"row": list(range(len(texts)))}
        columns = {"row": [i for i, c in enumerate(found) for _ in c.token_spans],
                   "chunk": [k for c in found for k in range(len(c.token_spans))],
                   "char_start": [a for c in found for a, _ in c.char_spans],
                   "char_end": [b for c in found for _, b in c.char_spans]}  # fmt: skip
        return np.concatenate([c.embeddings for c in found]).astype(np.float32), tokens, columns


def sparse_rows(found: torch.Tensor) -> SparseRows:
    """encode_document's sparse [n, dim] tensor as each row's active dimensions, ascending."""
    found = found.coalesce().cpu()  # its indices sorted by (row, dimension)
    rows, dimensions = found.indices().numpy()
    offsets = np.searchsorted(rows, np.arange(found.shape[0] + 1))  # the first entry of each row
    return SparseRows(offsets, dimensions, found.values().float().numpy(), found.shape[1])


def multi_vector_rows(found: list[torch.Tensor]) -> MultiVectorRows:
    """encode_document's [n_i, dim] token vectors of each text, one after the other."""
    offsets = np.cumsum([0, *(len(vectors) for vectors in found)])
    return MultiVectorRows(offsets, torch.cat(found).float().cpu().numpy())


def document_rows(found: torch.Tensor | list[torch.Tensor]) -> SparseRows | MultiVectorRows:
    """encode_document's result as the rows output.py writes: a sparse [n, dim] tensor (a SparseEncoder's), or each
    text's [n_i, dim] token vectors (a MultiVectorEncoder's)."""
    return sparse_rows(found) if isinstance(found, torch.Tensor) else multi_vector_rows(found)


class DocumentEmbedder:
    """Texts -> the rows of a SparseEncoder or MultiVectorEncoder as its encode_document() gives them (task
    "document"; without a prompt or prompt name, the model's first of DOCUMENT_PROMPTS, else its default), and
    each text's tokens (as the class declares them: document_tokens). A text without any token raises
    NoTokensError (its position)."""

    chunking = None  # chunks are a SentenceTransformer's (the command refuses --chunk-tokens for these)

    def __init__(self, model, *, prompt: str | None = None, prompt_name: str | None = None, batch_size: int = 32,
                 max_tokens_per_batch: int | None = None) -> None:  # fmt: skip
        model.eval()
        self.model = model
        if prompt is None and prompt_name is None:
            prompt_name = next((name for name in DOCUMENT_PROMPTS if name in model.prompts), None)
        self.prompt = model._resolve_prompt(prompt, prompt_name) or None  # ValueError for an unknown name
        self.dimension = model.get_embedding_dimension()
        self.batch_size = batch_size
        self.max_tokens = max_tokens_per_batch or model.max_tokens_per_batch

    @torch.inference_mode()
    def __call__(self, texts: list[str]) -> tuple[Any, np.ndarray]:
        tokens = self.model.document_tokens(texts, self.prompt)  # first: a text without tokens
        found = self.model.encode_document(texts, prompt=self.prompt or "", batch_size=self.batch_size,
                                           show_progress_bar=False, max_tokens_per_batch=self.max_tokens)  # fmt: skip
        return document_rows(found), np.array([len(ids) for ids in tokens], np.int64)


class HybridEmbedder:
    """Texts -> a HybridEncoder's rows of the outputs asked for (encode_all, one pass), and each text's tokens."""

    chunking = None  # the command refuses --chunk-tokens for these
    prompt = None  # BGE-M3 embeds documents without one (the command refuses --prompt)

    def __init__(self, model, outputs: tuple[str, ...], *, batch_size: int = 32,
                 max_tokens_per_batch: int | None = None) -> None:  # fmt: skip
        model.eval()
        self.model, self.outputs, self.batch_size = model, outputs, batch_size
        self.dimension = model.get_embedding_dimension()
        self.max_tokens = max_tokens_per_batch or model.max_tokens_per_batch

    @torch.inference_mode()
    def __call__(self, texts: list[str]) -> tuple[HybridRows, np.ndarray]:
        tokens = self.model.packed_input.texts.encode(texts, None)  # first: a text without tokens
        asked = {name: name in self.outputs for name in ("dense", "sparse", "multi_vector")}
        found = self.model.encode_all(texts, **asked, batch_size=self.batch_size, max_tokens_per_batch=self.max_tokens)
        sparse = None if found.sparse is None else sparse_rows(found.sparse)
        vectors = found.multi_vector and multi_vector_rows([torch.from_numpy(v) for v in found.multi_vector])
        return HybridRows(found.dense, sparse, vectors), np.array([len(ids) for ids in tokens], np.int64)


def embedder_for(model, *, chunking: Chunking | None = None, outputs: tuple[str, ...] = ("dense",),
                 **options) -> TextEmbedder | DocumentEmbedder | HybridEmbedder:  # fmt: skip
    """The embedder of the model's class (options: prompt, prompt_name, batch_size, max_tokens_per_batch); a
    HybridEncoder's for `outputs` other than the dense vector alone (which any SentenceTransformer gives)."""
    if outputs != ("dense",):
        options = {k: v for k, v in options.items() if k in ("batch_size", "max_tokens_per_batch")}
        return HybridEmbedder(model, outputs, **options)
    if callable(getattr(model, "document_tokens", None)):  # a document encoder: a SparseEncoder, a MultiVectorEncoder
        return DocumentEmbedder(model, **options)
    return TextEmbedder(model, chunking=chunking, **options)


def pending_rows(scan: InputScan, columns: Columns, done: pa.Array | None) -> Iterator[pa.RecordBatch]:
    """The input's rows that can be embedded and are not in a complete shard yet, in input order."""
    skip = ids_to_skip(scan, done)
    for path in scan.files:
        for batch in read_batches(path, columns, python_json=path in scan.python_json):
            batch = still_to_embed(batch, columns, skip)
            if len(batch):
                yield batch


@dataclass
class Progress:
    """Rows written by this run (texts copied, deduplicated, embedded) and tokens run, for the bar and the summary
    line."""

    done_before: int
    rows: int = 0
    reused: int = 0
    deduplicated: int = 0
    tokens: int = 0
    shards: int = 0
    started: float = 0.0

    def tokens_per_second(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)


def run_local(scan: InputScan, folder: OutputFolder, done: pa.Array | None, embed: TextEmbedder | DocumentEmbedder,
              shard_rows: int, index: RowIndex) -> Progress:  # fmt: skip
    """Write every pending row a shard at a time (`done`: from folder.prepare(); `index`: the rows already
    embedded, reuse.py), embedding the texts `index` does not hold; the manifest is written once all are done."""
    columns = Columns(folder.spec.id_column, folder.spec.text_column)
    rejected = 0 if scan.rejects is None else scan.rejects.num_rows
    progress = Progress(done_before=0 if done is None else len(done), started=time.perf_counter())
    run, identity = new_run_name(), numbers_identity(folder.spec)
    bar = tqdm(total=scan.rows - rejected, initial=progress.done_before, unit="rows", desc="Embedding",
               mininterval=1.0, dynamic_ncols=True)  # fmt: skip
    with bar:
        for shard in in_shards(pending_rows(scan, columns, done), shard_rows):
            texts = shard.column(columns.text).to_pylist()
            try:
                table, counts, tokens = shard_table(columns.id, shard.column(columns.id), texts,
                                                    content_keys(texts, identity), index,
                                                    lambda new: new_rows(embed, folder, new))  # fmt: skip
            except NoTokensError as error:
                row = f"the row with {columns.id} {shard.column(columns.id)[error.index].as_py()!r}"
                raise CorpusError(f"{error.about(row)}; this shard was not written") from error
            name = f"part-{run}-00000-{progress.shards:05d}.parquet"
            folder.write_table(name, table, embed.dimension, asdict(counts))
            index.add_shard(folder.path / name)
            progress.rows += len(texts)
            progress.reused += counts.reused
            progress.deduplicated += counts.deduplicated
            progress.tokens += tokens
            progress.shards += 1
            bar.update(len(texts))
            bar.set_postfix_str(f"{progress.tokens_per_second():,.0f} tokens/s", refresh=False)
    folder.finish(scan, embed.dimension, embed.prompt)
    return progress


def new_rows(embed: TextEmbedder | DocumentEmbedder, folder: OutputFolder,
             texts: list[str]) -> tuple[pa.Table, np.ndarray, int]:  # fmt: skip
    """The texts' rows as a table (a chunk's index and span before them), each row's text number, tokens run."""
    rows, tokens, extra = embed.chunks(texts) if embed.chunking else (*embed(texts), {})
    text_of_row = np.asarray(extra.pop("row", range(len(texts))), np.int64)
    return folder.rows_table(rows, extra)[0], text_of_row, int(np.sum(tokens))
