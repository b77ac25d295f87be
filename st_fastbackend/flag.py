"""FlagEmbedding's `BGEM3FlagModel`, on the fast backend: `from st_fastbackend.flag import BGEM3FlagModel` in place of
`from FlagEmbedding import BGEM3FlagModel`. Its encode() and scores return what FlagEmbedding 1.4.2's do (m3.py):
numpy dense vectors, lexical weights keyed by str(token id), one numpy array of ColBERT vectors per text."""

from __future__ import annotations

import numpy as np
import torch

from st_fastbackend.models.hybrid import HybridEncoder


class BGEM3FlagModel:
    def __init__(
        self, model_name_or_path: str, normalize_embeddings: bool = True, use_fp16: bool = False,
        devices: str | None = None, batch_size: int = 256, passage_max_length: int = 512,
    ) -> None:  # fmt: skip
        """FlagEmbedding's arguments; use_fp16 is False by default here (fp32 is the exact path) and, as in
        FlagEmbedding, ignored on a CPU."""
        if not normalize_embeddings:
            raise ValueError(
                "BGEM3FlagModel(normalize_embeddings=False): the fast face normalises, as the folder does"
            )
        dtype = {"dtype": torch.float16} if use_fp16 and devices not in (None, "cpu") else {}
        self.model = HybridEncoder(model_name_or_path, device=devices, model_kwargs=dtype)
        self.batch_size, self.passage_max_length = batch_size, passage_max_length

    def encode(
        self, sentences: list[str] | str, batch_size: int | None = None, max_length: int | None = None,
        return_dense: bool = True, return_sparse: bool = False, return_colbert_vecs: bool = False,
    ) -> dict:  # fmt: skip
        single = isinstance(sentences, str)
        texts = [sentences] if single else list(sentences)
        transformer, kept = self.model.packed_input, self.model.max_seq_length
        transformer.max_seq_length = max_length or self.passage_max_length  # FlagEmbedding's, not the folder's
        try:
            out = self.model.encode_all(texts, return_dense, return_sparse, return_colbert_vecs,
                                        batch_size=batch_size or self.batch_size)  # fmt: skip
        finally:
            transformer.max_seq_length = kept
        lexical = out.lexical_weights
        if lexical is not None:  # FlagEmbedding's keys and value type
            lexical = [{str(k): np.float32(w) for k, w in row.items()} for row in lexical]
        found = {"dense_vecs": out.dense, "lexical_weights": lexical, "colbert_vecs": out.multi_vector}
        return {k: (v[0] if single and v is not None else v) for k, v in found.items()}

    def compute_lexical_matching_score(self, lexical_weights_1, lexical_weights_2):
        """Sum over the ids both share of the product of their weights; a matrix for two lists."""
        if isinstance(lexical_weights_1, dict) and isinstance(lexical_weights_2, dict):
            return sum(w * lexical_weights_2[k] for k, w in lexical_weights_1.items() if k in lexical_weights_2)
        if isinstance(lexical_weights_1, list) and isinstance(lexical_weights_2, list):
            return np.array([[self.compute_lexical_matching_score(a, b) for b in lexical_weights_2]
                             for a in lexical_weights_1])  # fmt: skip
        raise ValueError("compute_lexical_matching_score takes two dicts or two lists of dicts.")

    def colbert_score(self, q_reps: np.ndarray, p_reps: np.ndarray) -> torch.Tensor:
        """MaxSim: each query vector's best dot product among the passage's, averaged over the query's vectors."""
        scores = torch.from_numpy(q_reps) @ torch.from_numpy(p_reps).T  # [n_q, n_p]
        return scores.max(-1).values.sum() / len(q_reps)
