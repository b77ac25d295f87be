"""Models to measure: random weights in published shapes (all-MiniLM-L6-v2's tokenizer, for realistic English
token counts) or the real all-MiniLM-L6-v2, and the systems compared on them: plain sentence-transformers, the
fast backend, and the fast backend with one of its switches set for a call."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from harness.options import minilm_path

CACHE = Path(tempfile.gettempdir()) / "st_fastbackend_bench"  # built once, reused by later runs
# A small Mistral: hidden 512, 4 layers, 8 heads / 2 key-value heads, intermediate 1408.
SMALL_MISTRAL = dict(
    model_type="mistral", hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=1408, max_position_embeddings=4096, sliding_window=None,
)  # fmt: skip
# EmbeddingGemma-300m's and gte-modernbert-base's widths (their config.json), 6 of their 24 / 22 layers in their
# pattern (5 sliding + 1 full; global, local, local): the per-layer work and so the speed ratio are the real
# models'; the full depth only multiplies both sides' time on these 2-core machines.
EMBEDDING_GEMMA_SHAPED = dict(
    model_type="gemma3_text", hidden_size=768, intermediate_size=1152, num_hidden_layers=6, num_attention_heads=3,
    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
    use_bidirectional_attention=True, max_position_embeddings=2048, hidden_activation="gelu_pytorch_tanh",
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
)  # fmt: skip
MODERNBERT_SHAPED = dict(
    model_type="modernbert", hidden_size=768, intermediate_size=1152, num_hidden_layers=6, num_attention_heads=12,
    local_attention=128, max_position_embeddings=8192,
)  # fmt: skip

# bert-base-uncased's widths (its config.json), 4 of its 12 layers: the body of SPLADE (naver/splade-v3, a
# BertForMaskedLM) and of ColBERT (colbert-ir/colbertv2.0, with its 768 -> 128 token projection); all-MiniLM-L6-v2's
# tokenizer is the same 30,522-token uncased WordPiece vocabulary. SPLADE's masked-LM head (2 x 768 x (768 +
# 30,522) FLOPs a token) is ~46% of the FLOPs at 4 layers, ~22% at 12: its share, unlike a layer's, depends on
# the depth (RESULTS.md puts the two apart).
BERT_BASE_SHAPED = dict(
    model_type="bert", hidden_size=768, num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072,
    max_position_embeddings=512,
)  # fmt: skip
# BAAI/bge-small-en-v1.5's shape (its config.json; e5-small-v2 and all-MiniLM-L12-v2 have the same widths): 12 layers
# of hidden 384, bert-base-uncased's vocabulary (all-MiniLM-L6-v2's tokenizer), CLS pooling, 512 tokens.
BGE_SMALL_SHAPED = dict(
    model_type="bert", hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536,
    max_position_embeddings=512,
)  # fmt: skip
# BAAI/bge-m3's body, XLM-RoBERTa-large's widths (its config.json): 24 layers, hidden 1024, 16 heads.
XLM_ROBERTA_LARGE_SHAPED = dict(
    model_type="xlm-roberta", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
    type_vocab_size=1, layer_norm_eps=1e-5, bos_token_id=0, pad_token_id=1, eos_token_id=2,
)  # fmt: skip
# The sentence-transformers class of each model that is not a SentenceTransformer.
KINDS = {"splade": "SparseEncoder", "colbert": "MultiVectorEncoder"}


def model_path(name: str) -> str:
    """A sentence-transformers folder by name: "minilm" (real), "mistral", "embeddinggemma", "modernbert",
    "bge-small", "splade", "colbert" (random weights; KINDS names their classes)."""
    if name == "minilm":
        return minilm_path()
    if name == "mistral":
        return str(shaped(CACHE / "small-mistral", SMALL_MISTRAL, "lasttoken", max_seq_length=2048))
    if name == "embeddinggemma":  # EmbeddingGemma's Dense layers: 768 -> 3072 -> 768
        return str(shaped(CACHE / "embeddinggemma-shaped", EMBEDDING_GEMMA_SHAPED, "mean", dense=(3072, 768)))
    if name == "modernbert":
        return str(shaped(CACHE / "modernbert-shaped", MODERNBERT_SHAPED, "cls"))
    if name == "bge-small":
        return str(shaped(CACHE / "bge-small-shaped", BGE_SMALL_SHAPED, "cls"))
    if name == "splade":
        return str(splade_shaped(CACHE / "splade-bert-base-4l", BERT_BASE_SHAPED))
    if name == "colbert":
        return str(colbert_shaped(CACHE / "colbert-bert-base-4l", BERT_BASE_SHAPED))
    raise ValueError(f"Unknown model {name!r}")


def random_weights(folder: Path, shape: dict, auto: str = "AutoModel", tokenizer=None, **config) -> Path:
    """A Hugging Face folder: random weights (seed 0) of `shape` for transformers' `auto` class, and `tokenizer`
    (default: all-MiniLM-L6-v2's); `config` adds to the config (num_labels=1, ...)."""
    import torch
    import transformers

    tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(minilm_path())
    config = transformers.AutoConfig.for_model(vocab_size=tokenizer.vocab_size, pad_token_id=0, **shape, **config)
    torch.manual_seed(0)
    getattr(transformers, auto).from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def shaped(folder: Path, shape: dict, pooling: str, dense: tuple[int, ...] = (), max_seq_length: int | None = None):
    """A sentence-transformers folder around random weights of `shape`: Transformer, Pooling, Dense layers (no
    bias, no activation), Normalize. Built once."""
    import torch
    from sentence_transformers import SentenceTransformer as PlainSentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling

    if (folder / "modules.json").is_file():
        return folder
    hf = random_weights(folder / "hf", shape)
    transformer = Transformer(str(hf), max_seq_length=max_seq_length or shape["max_position_embeddings"])
    modules, width = [transformer, Pooling(shape["hidden_size"], pooling)], shape["hidden_size"]
    for size in dense:
        modules.append(Dense(width, size, bias=False, activation_function=torch.nn.Identity()))
        width = size
    PlainSentenceTransformer(modules=[*modules, Normalize()], device="cpu").save(str(folder))
    shutil.rmtree(hf)
    return folder


def splade_shaped(folder: Path, shape: dict, max_seq_length: int = 512, tokenizer=None) -> Path:
    """A SPLADE folder around random *ForMaskedLM weights of `shape` (`tokenizer`: random_weights'): a fill-mask
    Transformer, then max SpladePooling (relu, log1p). Built once."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    if (folder / "modules.json").is_file():
        return folder
    hf = random_weights(folder / "hf", shape, "AutoModelForMaskedLM", tokenizer)
    transformer = Transformer(str(hf), transformer_task="fill-mask", max_seq_length=max_seq_length)
    SparseEncoder(modules=[transformer, SpladePooling(pooling_strategy="max")], device="cpu").save(str(folder))
    shutil.rmtree(hf)
    return folder


def colbert_shaped(folder: Path, shape: dict, dim: int = 128, max_seq_length: int = 512, tokenizer=None) -> Path:
    """A ColBERT folder around random weights of `shape` (`tokenizer`: random_weights'): Transformer, a token-level
    Dense to `dim` (no bias, no activation, seed 0), MultiVectorMask with ColBERT's punctuation skiplist,
    Normalize. Built once."""
    import string

    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    if (folder / "modules.json").is_file():
        return folder
    hf = random_weights(folder / "hf", shape, tokenizer=tokenizer)
    transformer = Transformer(str(hf), max_seq_length=max_seq_length)
    torch.manual_seed(0)
    dense = Dense(shape["hidden_size"], dim, bias=False, activation_function=torch.nn.Identity(),
                  module_input_name="token_embeddings")  # fmt: skip
    mask = MultiVectorMask(skiplist_words=list(string.punctuation))
    modules = [transformer, dense, mask, Normalize(module_input_name="token_embeddings")]
    MultiVectorEncoder(modules=modules, device="cpu").save(str(folder))
    shutil.rmtree(hf)
    return folder


def bge_m3_shaped(folder: Path, shape: dict, corpus: list[str], max_seq_length: int = 512) -> Path:
    """A folder as BAAI/bge-m3 ships it, random weights of `shape` (seed 0): an XLM-RoBERTa checkpoint inside a
    sentence-transformers folder (Transformer, CLS Pooling, Normalize), sparse_linear.pt (Linear hidden -> 1) and
    colbert_linear.pt (hidden -> hidden). bge-m3's 250,002-piece tokenizer is not here: a 30,000-piece BPE with
    XLM-RoBERTa's special tokens and template, trained on `corpus`, gives English token counts near the real one's
    (the vocabulary only sizes the embedding table, which no token multiplies). Built once."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer as PlainSentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if (folder / "modules.json").is_file():
        return folder
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizers.NFKC(), pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    specials = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-RoBERTa's ids 0-3
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=30_000, special_tokens=specials))
    tokenizer.add_special_tokens(["<mask>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", cls_token="<s>", eos_token="</s>", sep_token="</s>",
        unk_token="<unk>", pad_token="<pad>", mask_token="<mask>", model_max_length=max_seq_length,
    )  # fmt: skip
    config = transformers.AutoConfig.for_model(
        vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=max_seq_length + 2, **shape
    )
    torch.manual_seed(0)
    hf = folder / "hf"
    transformers.AutoModel.from_config(config, add_pooling_layer=False).save_pretrained(hf)
    fast.save_pretrained(hf)
    transformer = Transformer(str(hf), max_seq_length=max_seq_length)
    pooling = Pooling(shape["hidden_size"], pooling_mode="cls")
    PlainSentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(str(folder))
    shutil.rmtree(hf)
    torch.save(torch.nn.Linear(shape["hidden_size"], 1).state_dict(), folder / "sparse_linear.pt")
    torch.save(torch.nn.Linear(shape["hidden_size"], shape["hidden_size"]).state_dict(), folder / "colbert_linear.pt")
    return folder


def plain_and_fast(path: str, kind: str = "SentenceTransformer", dtype=None, **kwargs) -> dict:
    """{"plain": sentence-transformers' `kind`, "fast": st_fastbackend's with backend="fast"} on one folder, with
    the same arguments (and model_kwargs={"dtype": dtype} where given)."""
    import sentence_transformers

    import st_fastbackend

    if dtype is not None:
        kwargs["model_kwargs"] = {"dtype": dtype}
    return {"plain": getattr(sentence_transformers, kind)(path, **kwargs),
            "fast": getattr(st_fastbackend, kind)(path, backend="fast", **kwargs)}  # fmt: skip


class Around:
    """A model whose encode() runs inside `context()`: a switch set for the call and put back after it."""

    def __init__(self, model, context) -> None:
        self.model, self.context = model, context

    def encode(self, *args, **kwargs):
        with self.context():
            return self.model.encode(*args, **kwargs)


@contextlib.contextmanager
def attribute(owner, name: str, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def switched(model, switch: str, value: bool = False) -> Around:
    """The fast backend with one of its switches set for its calls (default: off): what that part saves.
    "prompt_reuse" (on the model): the prompt run again for every text; "compiled_seams" (on its first
    module): the layer seams eager, or with value=True compiled (engine/fused.py)."""
    owner = model if switch == "prompt_reuse" else model[0]
    return Around(model, lambda: attribute(owner, switch, value))


def bf16_products(model) -> Around:
    """Calls with PyTorch's setting for fp32 products in bf16 (torch.set_float32_matmul_precision("medium")):
    beside fp32 systems in one run."""
    import torch

    return Around(model, lambda: attribute(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"))


def int8_systems(path: str, device: str) -> dict:
    """The fast backend's other CPU precision levels of an fp32 model, for the fp32 rows: bf16 products, int8
    (per-token scales) and int8-static (calibrated scales)."""
    from st_fastbackend import SentenceTransformer

    def fast(**model_kwargs):
        return SentenceTransformer(path, backend="fast", device=device, model_kwargs=model_kwargs)

    return {
        "fast_bf16_products": bf16_products(fast()),
        "fast_int8": fast(quantize="int8"),
        "fast_int8_static": fast(quantize="int8-static"),
    }


def seam_systems(name: str) -> dict:
    """The small Mistral (random weights) or MiniLM, by name, on the CPU in fp32: plain sentence-transformers,
    the fast backend as it loads, and the fast backend with its layer seams compiled."""
    systems = plain_and_fast(model_path(name), device="cpu")
    return {**systems, "fast, compiled seams": switched(systems["fast"], "compiled_seams", True)}


def run_peer(
    system: str, python: str, model: str, dtype: str, texts: list[str], batch_size: int, rounds: int,
    data_dir: Path | None = None,
) -> dict:  # fmt: skip
    """eval/peer.py under the peer's own Python: its embeddings and the seconds of its timed rounds."""
    import json
    import subprocess

    import numpy as np

    from harness.options import DATA_DIR, REPO

    with tempfile.TemporaryDirectory() as work:
        texts_file, out = Path(work) / "texts.json", Path(work) / "out.npz"
        texts_file.write_text(json.dumps(texts))
        command = [python, str(REPO / "eval" / "peer.py"), "--system", system, "--model", model, "--dtype", dtype,
                   "--texts", str(texts_file), "--batch-size", str(batch_size), "--rounds", str(rounds),
                   "--out", str(out), "--data-dir", str(data_dir or DATA_DIR)]  # fmt: skip
        subprocess.run(command, check=True)
        result = np.load(out)
        return {"embeddings": result["embeddings"], "times": result["seconds"].tolist(), "peak_extra_bytes": None}
