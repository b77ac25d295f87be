"""`HybridEncoder`: dense, lexical (sparse) and ColBERT (multi-vector) outputs from one packed pass, as BGE-M3 ships
them: a sentence-transformers folder (Transformer, CLS Pooling, Normalize) with `sparse_linear.pt` (Linear hidden->1)
and `colbert_linear.pt` (Linear hidden->dim) beside it.

The rules are FlagEmbedding 1.4.2's (inference/embedder/encoder_only/m3.py, finetune/.../m3/modeling.py):
- dense: the pipeline's sentence embedding (CLS, normalised), which encode() gives as plain sentence-transformers;
- lexical: relu(w·h_t + b) per token, the max over a token id's occurrences, weights > 0 kept, the ids of the
  tokenizer's cls, eos, pad and unk tokens dropped;
- ColBERT: the head on every token after the first (CLS), normalised per vector; the last (EOS) token is *kept*
  (m3.py keeps `tokens_num - 1` rows of the vectors of tokens 1.., i.e. up to and including EOS).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.models.fast import FastModel, PackRows, text_tokens
from st_fastbackend.models.sentence_transformer import SentenceTransformer

HEAD_FILES = {"sparse": "sparse_linear.pt", "multi_vector": "colbert_linear.pt"}
OUTPUTS = ("dense", "sparse", "multi_vector")


@dataclass(frozen=True)
class Heads:
    """The two linear heads as tensors (not modules: a module attribute would join the pipeline's forward)."""

    sparse_weight: Tensor  # [1, H]
    sparse_bias: Tensor  # [1]
    colbert_weight: Tensor  # [D, H]
    colbert_bias: Tensor  # [D]

    def to(self, device: torch.device, dtype: torch.dtype) -> Heads:
        return Heads(*(t.to(device, dtype) for t in (self.sparse_weight, self.sparse_bias, self.colbert_weight,
                                                     self.colbert_bias)))  # fmt: skip


@dataclass
class HybridOutput:
    """encode_all()'s result, in the caller's order; an output not asked for is None. `sparse` is the lexical weights
    as SparseEncoder returns them: a sparse COO tensor [N, vocab]."""

    dense: np.ndarray | None  # [N, dim]
    lexical_weights: list[dict[int, float]] | None
    sparse: Tensor | None
    multi_vector: list[np.ndarray] | None  # N x [n_i, D]


def head_file(folder: Path, name: str, hub_id: str | None) -> Path:
    """A head file of the folder; from the Hub where the model is a Hub id (the engine's snapshot holds only the files
    modules/files.py's ENGINE_FILES names)."""
    if not (folder / name).is_file() and hub_id is not None:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return Path(hf_hub_download(hub_id, name))
        except EntryNotFoundError:
            pass
    if not (folder / name).is_file():
        raise UnsupportedModelError(f"A HybridEncoder folder without {name} ({hub_id or folder})")
    return folder / name


def load_heads(folder: Path, hidden: int, hub_id: str | None = None) -> Heads:
    """Both head files, strictly: a Linear's weight and bias each, of the shapes FlagEmbedding builds."""
    found = {}
    for kind, name in HEAD_FILES.items():
        state = torch.load(head_file(folder, name, hub_id), map_location="cpu", weights_only=True)
        weight, bias = state.get("weight"), state.get("bias")
        if set(state) != {"weight", "bias"} or weight.shape[1:] != (hidden,) or bias.shape != weight.shape[:1]:
            shapes = {k: tuple(v.shape) for k, v in state.items()}
            raise UnsupportedModelError(f"{name} holding {shapes} (expected a Linear from hidden size {hidden})")
        found[kind] = state
    if found["sparse"]["weight"].shape[0] != 1:
        raise UnsupportedModelError(f"{HEAD_FILES['sparse']} with {found['sparse']['weight'].shape[0]} outputs (1)")
    sparse, colbert = found["sparse"], found["multi_vector"]
    return Heads(sparse["weight"], sparse["bias"], colbert["weight"], colbert["bias"])


class HybridEncoder(SentenceTransformer):
    """A SentenceTransformer (encode() is the plain dense output) with encode_all(): the three outputs of one pass."""

    output_kind = "hybrid"
    plain_class = SentenceTransformer  # what check() compares encode() with, loaded with backend="torch"
    # /v1/embeddings and /embed the dense vector, /embed_all the token embeddings, /embed_sparse the lexical weights,
    # /embed_hybrid all three (serve/sparse.py): each through pack_rows (served_options).
    served_outputs = (*SentenceTransformer.served_outputs, "sparse", "multi_vector", "hybrid")
    prompt_reuse = False  # the prompt's tokens are among the lexical weights and the vectors
    _on_device: tuple | None = None  # ((device, dtype), the heads there, the dropped ids there), until a move

    def __init__(self, *args, backend: str = "fast", **kwargs) -> None:
        if backend != "fast":
            raise ValueError(f'HybridEncoder is backend="fast" only, got backend={backend!r}: for the Hugging Face '
                             "implementation, use FlagEmbedding's BGEM3FlagModel.")  # fmt: skip
        super().__init__(*args, backend=backend, **kwargs)
        name = str(args[0] if args else kwargs.get("model_name_or_path"))
        hub_id = None if Path(name).is_dir() else name
        self.heads = load_heads(Path(self.packed_input.folder), self.packed_input.get_embedding_dimension(), hub_id)
        tokenizer = self.tokenizer
        special = (tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id)
        self.unused_ids = sorted({i for i in special if i is not None})

    def save(self, path: str, *args, **kwargs) -> None:
        """The sentence-transformers folder, and both heads beside it as bge-m3 ships them."""
        super().save(path, *args, **kwargs)
        heads = self.heads
        saved = {"sparse": (heads.sparse_weight, heads.sparse_bias), "multi_vector": (heads.colbert_weight,
                 heads.colbert_bias)}  # fmt: skip
        for kind, (weight, bias) in saved.items():
            torch.save({"weight": weight.cpu(), "bias": bias.cpu()}, Path(path) / HEAD_FILES[kind])

    def encode_all(
        self, texts: list[str], dense: bool = True, sparse: bool = True, multi_vector: bool = True, *,
        batch_size: int = 32, show_progress_bar: bool = False, device: str | None = None,
        max_tokens_per_batch: int | None = None,
    ) -> HybridOutput:  # fmt: skip
        """Every text's dense vector, lexical weights and ColBERT vectors (those asked for) from one packed pass."""
        asked = tuple(name for name, on in zip(OUTPUTS, (dense, sparse, multi_vector), strict=True) if on)
        if not asked:
            raise ValueError("encode_all() with none of dense, sparse, multi_vector asked for.")
        # FastModel's loop with this class's row rule (the parent's _packed_inference is for encode()'s options)
        rows = FastModel._packed_inference(self, list(texts), prompt=None, batch_size=batch_size, device=device,
                                           show_progress_bar=show_progress_bar, hybrid=asked,
                                           max_tokens_per_batch=max_tokens_per_batch)  # fmt: skip
        return _collect(rows, asked, len(self.tokenizer))

    def served_options(self, output: str) -> dict:
        """The dense vector and token embeddings as a SentenceTransformer serves them; "sparse" and "multi_vector"
        one output of the heads alone, "hybrid" all three per text."""
        if output in SentenceTransformer.served_outputs:
            return super().served_options(output)
        return {"hybrid": OUTPUTS if output == "hybrid" else output}

    def pack_rows(self, prompt: str | None, options: dict) -> PackRows:
        """encode_all's rule (option "hybrid": the outputs asked, a tuple per text; one output's name: its row
        alone), else encode()'s."""
        asked = options.pop("hybrid", None)
        if asked is None:
            return super().pack_rows(prompt, options)

        def rows(out: dict) -> tuple[list, None]:
            tokens = out["token_embeddings"]  # [T, H]
            heads, unused = self._heads_on(tokens.device, tokens.dtype)
            if isinstance(asked, str):  # the server's one output
                found = _pack_rows(out, tokens, heads, unused, (asked,))
                return [row[OUTPUTS.index(asked)] for row in found], None
            return _pack_rows(out, tokens, heads, unused, asked), None

        return PackRows(text_tokens(self[0].texts, prompt), rows, lambda results, device: results)

    def _heads_on(self, device: torch.device, dtype: torch.dtype) -> tuple[Heads, Tensor]:
        """The heads and the dropped ids on the device, in the dtype: copied once, not at every pack (the server
        asks for a row rule per pack), until the model moves (_apply)."""
        key = (device, dtype)
        if self._on_device is None or self._on_device[0] != key:
            self._on_device = (key, self.heads.to(device, dtype), torch.tensor(self.unused_ids, device=device))
        return self._on_device[1], self._on_device[2]

    def _apply(self, *args, **kwargs):
        self._on_device = None
        return super()._apply(*args, **kwargs)

    def __getstate__(self) -> dict:
        """Pickled (multi-process pools) without the device copies: a worker may not have that device."""
        return {k: v for k, v in self.__dict__.items() if k != "_on_device"}


def _pack_rows(out: dict, tokens: Tensor, heads: Heads, unused: Tensor, asked: tuple[str, ...]) -> list[tuple]:
    """Per text of the pack its (dense [dim], (ids, weights), vectors [n_i - 1, D]), None where not asked."""
    packed, count = out["packed"], len(out["packed"].lengths)
    dense = out["sentence_embedding"].float().cpu() if "dense" in asked else [None] * count
    lexical = [None] * count
    if "sparse" in asked:
        weights = torch.relu(tokens @ heads.sparse_weight.T + heads.sparse_bias).squeeze(1).float()  # [T]
        pairs = zip(packed.input_ids.split(packed.lengths), weights.split(packed.lengths), strict=True)
        lexical = [_max_per_id(ids, w, unused) for ids, w in pairs]
    vectors = [None] * count
    if "multi_vector" in asked:
        colbert = torch.nn.functional.normalize((tokens @ heads.colbert_weight.T + heads.colbert_bias).float(), dim=-1)
        vectors = [v[1:].cpu() for v in colbert.split(packed.lengths)]  # CLS dropped, EOS kept (as m3.py)
    return list(zip(dense, lexical, vectors, strict=True))


def _max_per_id(ids: Tensor, weights: Tensor, unused: Tensor) -> tuple[Tensor, Tensor]:
    """One text's lexical weights: the max over each token id's occurrences, zero weights and special ids dropped."""
    keep = (weights > 0) & ~torch.isin(ids, unused)
    found, where = torch.unique(ids[keep], return_inverse=True)
    top = torch.zeros(len(found), device=weights.device).scatter_reduce(0, where, weights[keep], "amax")
    return found.cpu(), top.cpu()


def _collect(rows: list[tuple], asked: tuple[str, ...], vocab_size: int) -> HybridOutput:
    dense = np.stack([r[0].numpy() for r in rows]) if "dense" in asked and rows else None
    lexical = sparse = multi_vector = None
    if "sparse" in asked:
        lexical = [dict(zip(ids.tolist(), w.tolist(), strict=True)) for _, (ids, w), _ in rows]
        sparse = _sparse_tensor([r[1] for r in rows], vocab_size)
    if "multi_vector" in asked:
        multi_vector = [r[2].numpy() for r in rows]
    return HybridOutput(dense, lexical, sparse, multi_vector)


def _sparse_tensor(lexical: list[tuple[Tensor, Tensor]], vocab_size: int) -> Tensor:
    """Every text's (ids, weights) as one sparse COO tensor [N, vocab], as SparseEncoder returns its rows."""
    rows = [torch.full_like(ids, i) for i, (ids, _) in enumerate(lexical)]
    indices = torch.stack([torch.cat([torch.zeros(0, dtype=torch.long), *rows]),
                           torch.cat([torch.zeros(0, dtype=torch.long), *(ids for ids, _ in lexical)])])  # fmt: skip
    values = torch.cat([torch.zeros(0), *(w for _, w in lexical)])
    return torch.sparse_coo_tensor(indices, values, (len(lexical), vocab_size), check_invariants=True).coalesce()
