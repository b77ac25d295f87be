"""The tiny BGE-M3-shaped folder and FlagEmbedding's outputs on it, which tests/models/test_hybrid.py compares with.

Two steps, two environments (FlagEmbedding 1.4.2 does not import under transformers 5):

    # 1. build model/ (this project's environment: transformers 5, sentence-transformers 6)
    PYTHONPATH=. python tests/data/bge_m3/make_reference.py build
    # 2. FlagEmbedding's outputs (a peer environment: torch==2.13.0, transformers<5, flagembedding==1.4.2)
    /work/venv-flag/bin/python tests/data/bge_m3/make_reference.py reference

Both are committed (model/ is ~0.6 MB): rebuilding the folder under another transformers version may not give the
same bytes, and the references belong to these bytes. Step 2 alone re-checks them against a newer FlagEmbedding.
The folder is what bge-m3 ships, small: an XLM-RoBERTa checkpoint at the root inside a sentence-transformers folder
(Transformer, CLS Pooling, Normalize), sparse_linear.pt (Linear hidden->1) and colbert_linear.pt (hidden->hidden).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
MODEL, REFERENCE, TEXTS = HERE / "model", HERE / "reference.npz", HERE / "texts.json"
MAX_LENGTH = 64  # the folder's max_seq_length, passed to FlagEmbedding (its default, 512, ignores the folder's)

# Mixed lengths and scripts; repeated words (a token id's weight is its max over occurrences); characters the
# tokenizer has not seen (<unk>, whose weight is dropped); one text cut at MAX_LENGTH; the empty text.
TEXTS_LIST = [
    "",
    "a",
    "the cat sat on the mat, the cat sat again",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le renard brun rapide saute par-dessus le chien paresseux. Où est la bibliothèque ?",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "敏捷的棕色狐狸跳过了懒狗。狐狸很快。",
    "素早い茶色の狐がのろまな犬を飛び越える。",
    "الثعلب البني السريع يقفز فوق الكلب الكسول",
    "emoji 🦊🐕 and symbols ∑∫√ unseen ✓",
    "retrieval with dense, lexical and multi-vector scores fused at query time " * 8,
    "short query about hybrid search",
]


def build() -> None:
    import shutil

    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    # XLM-RoBERTa's special ids: <s> 0, <pad> 1, </s> 2, <unk> 3, <mask> last.
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    corpus = [t for t in TEXTS_LIST if "emoji" not in t] * 3  # the emoji text's symbols stay unseen
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    tokenizer.add_special_tokens(["<mask>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", cls_token="<s>", eos_token="</s>", sep_token="</s>",
        unk_token="<unk>", pad_token="<pad>", mask_token="<mask>", model_max_length=MAX_LENGTH,
    )  # fmt: skip
    config = transformers.XLMRobertaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_LENGTH + 2, type_vocab_size=1, bos_token_id=0,
        pad_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.XLMRobertaModel(config, add_pooling_layer=False)
    with torch.no_grad():  # default init leaves biases and norms trivial; make every tensor matter
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    shutil.rmtree(MODEL, ignore_errors=True)
    hf.save_pretrained(HERE / "hf")
    fast.save_pretrained(HERE / "hf")
    transformer = Transformer(str(HERE / "hf"), max_seq_length=MAX_LENGTH)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="cls")
    SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(str(MODEL))
    shutil.rmtree(HERE / "hf")
    (MODEL / "README.md").unlink()  # sentence-transformers' generated model card: nothing the tests read
    _portable_tokenizer_config(MODEL / "tokenizer_config.json")
    sparse, colbert = torch.nn.Linear(64, 1), torch.nn.Linear(64, 64)
    with torch.no_grad():
        sparse.bias.fill_(0.05)  # some tokens' relu above zero, some at zero: both cases of the rule occur
    torch.save(sparse.state_dict(), MODEL / "sparse_linear.pt")
    torch.save(colbert.state_dict(), MODEL / "colbert_linear.pt")
    TEXTS.write_text(json.dumps(TEXTS_LIST, ensure_ascii=False, indent=1) + "\n")


def _portable_tokenizer_config(path: Path) -> None:
    """transformers 5 names its own tokenizer class, which 4.x (FlagEmbedding's) cannot load: name the generic one."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def reference() -> None:
    """FlagEmbedding's outputs, in fp32 (its default use_fp16=True loads fp16 weights even on the CPU), all texts in
    one padded batch, and its two scores between every pair of texts."""
    import numpy as np
    from FlagEmbedding import BGEM3FlagModel

    texts = json.loads(TEXTS.read_text())
    model = BGEM3FlagModel(str(MODEL), use_fp16=False, devices="cpu", passage_max_length=MAX_LENGTH)
    out = model.encode(texts, batch_size=len(texts), return_dense=True, return_sparse=True, return_colbert_vecs=True)
    lexical, colbert = out["lexical_weights"], out["colbert_vecs"]
    lexical_scores = model.compute_lexical_matching_score(lexical, lexical)
    colbert_scores = [[float(model.colbert_score(q, p)) for p in colbert] for q in colbert]
    np.savez_compressed(
        REFERENCE,
        dense=out["dense_vecs"].astype(np.float32),
        sparse_ids=np.array([int(k) for row in lexical for k in row], dtype=np.int64),
        sparse_values=np.array([float(v) for row in lexical for v in row.values()], dtype=np.float32),
        sparse_counts=np.array([len(row) for row in lexical], dtype=np.int64),
        colbert=np.concatenate(colbert).astype(np.float32),
        colbert_counts=np.array([len(v) for v in colbert], dtype=np.int64),
        lexical_scores=np.asarray(lexical_scores, dtype=np.float64),
        colbert_scores=np.asarray(colbert_scores, dtype=np.float64),
    )


if __name__ == "__main__":
    {"build": build, "reference": reference}[sys.argv[1]]()
