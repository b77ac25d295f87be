"""Small random-weight models for the tests: a tokenizer trained on the fly, a transformers
config and model saved as safetensors, and a sentence-transformers folder around them."""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path

import torch
import transformers
from sentence_transformers import SentenceTransformer as PlainSentenceTransformer
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

_rng = random.Random(0)
WORDS = ["".join(_rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(_rng.randint(2, 9))) for _ in range(400)]

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

ENCODER_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
MODEL_CONFIGS = {
    "mistral": dict(TINY, model_type="mistral", sliding_window=None),
    "llama": dict(
        TINY,
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(TINY, model_type="qwen2"),
    "qwen3": dict(TINY, model_type="qwen3", head_dim=32),
    "bert": dict(ENCODER_SIZES, model_type="bert", type_vocab_size=2),
    "roberta": dict(ENCODER_SIZES, model_type="roberta", type_vocab_size=1),
    "xlm-roberta": dict(ENCODER_SIZES, model_type="xlm-roberta", type_vocab_size=1, hidden_act="gelu_new"),
    # DistilBertConfig's own names for the same widths; no token types.
    "distilbert": dict(model_type="distilbert", dim=64, hidden_dim=128, n_layers=2, n_heads=4),
    # EmbeddingGemma's shape in small: bidirectional, a sliding layer (|i - j| <= 8) then a full one, each with
    # its own rope θ; query_pre_attn_scalar unlike head_dim, so the softmax scale is not 1/sqrt(head_dim).
    "gemma3_text": dict(
        TINY, model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
        use_bidirectional_attention=True, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    ),
    # gte-modernbert-base's shape in small: global, local (|i - j| <= 8), local; global and local rope θ.
    "modernbert": dict(
        ENCODER_SIZES, model_type="modernbert", num_hidden_layers=3, local_attention=16,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 160000.0}},
        cls_token_id=1, sep_token_id=2,
    ),
}  # fmt: skip
# What the tokenizer's post-processor adds: decoders <s> only; BERT and DistilBERT [CLS] x [SEP]; RoBERTa <s> x </s>;
# EmbeddingGemma <bos> x <eos>; ModernBERT [CLS] x [SEP].
TEMPLATES = {
    family: "<s> $A </s>" for family in ("bert", "roberta", "xlm-roberta", "distilbert", "gemma3_text", "modernbert")
}


def make_texts(n: int, seed: int = 1, max_words: int = 300) -> list[str]:
    """Texts of very different lengths: empty (only the BOS token), one letter, up to several hundred tokens."""
    rng = random.Random(seed)
    lengths = [2, max_words] + [int(rng.paretovariate(1.0) * 3) % max_words + 1 for _ in range(n - 4)]
    return ["", "a"] + [" ".join(rng.choices(WORDS, k=k)) for k in lengths]


@functools.cache
def train_tokenizer(template: str = "<s> $A") -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    tokenizer.train_from_iterator(make_texts(2000, seed=2, max_words=30)[2:], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, pair=template + " $B", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def build_hf_model(
    folder: Path,
    family: str,
    seed: int = 0,
    causal_lm: bool = False,
    masked_lm: bool = False,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Save a random-weight Hugging Face checkpoint (config, safetensors, tokenizer) to ``folder``.

    `causal_lm` saves the *ForCausalLM class (tensor names with the `model.` prefix, plus lm_head), `masked_lm`
    the *ForMaskedLM class;
    `max_shard_size` writes a sharded checkpoint with model.safetensors.index.json.
    """
    spec = {"vocab_size": 600, "max_position_embeddings": 512, **MODEL_CONFIGS[family], **overrides}
    config = transformers.AutoConfig.for_model(bos_token_id=1, eos_token_id=2, pad_token_id=3, **spec)
    torch.manual_seed(seed)
    auto_class = transformers.AutoModelForCausalLM if causal_lm else transformers.AutoModel
    auto_class = transformers.AutoModelForMaskedLM if masked_lm else auto_class
    model = auto_class.from_config(config)
    with torch.no_grad():  # default init leaves biases and norms trivial; make every tensor matter
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    train_tokenizer(TEMPLATES.get(family, "<s> $A")).save_pretrained(folder)
    return folder


def build_distilbert_mlm(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random-weight DistilBertForMaskedLM checkpoint in ``folder``: `distilbert.`-prefixed body tensors and the
    head's vocab_transform, vocab_layer_norm and vocab_projector (its weight tied to the word embeddings, so not
    saved, unless `tie_word_embeddings=False`). `overrides`: DistilBertConfig fields (dim, n_layers, activation...)."""
    return build_hf_model(folder, "distilbert", seed=seed, masked_lm=True, **overrides)


def build_st_model(
    folder: Path,
    family: str,
    pooling_mode: str | tuple[str, ...] = "lasttoken",
    include_prompt: bool = True,
    max_seq_length: int = 128,
    prompts: dict[str, str] | None = None,
    do_lower_case: bool = False,
    dense: tuple[int, ...] = (),
    **overrides,
) -> Path:
    """A sentence-transformers folder (Transformer, Pooling, Normalize) saved by plain sentence-transformers;
    `dense`: the output sizes of Dense layers (no bias, no activation) between Pooling and Normalize, as
    EmbeddingGemma has them."""
    hf_folder = build_hf_model(folder / "hf", family, **overrides)
    transformer = Transformer(str(hf_folder), max_seq_length=max_seq_length, do_lower_case=do_lower_case)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode, include_prompt=include_prompt)
    denses, width = [], pooling.get_embedding_dimension()
    for size in dense:
        torch.manual_seed(size)
        denses.append(Dense(width, size, bias=False, activation_function=torch.nn.Identity()))
        width = size
    modules = [transformer, pooling, *denses, Normalize()]
    model = PlainSentenceTransformer(modules=modules, prompts=prompts, device="cpu")
    model.save(str(folder / "st"))
    shutil.rmtree(hf_folder)
    return folder / "st"


def with_pooling(st_folder: Path, target: Path, pooling_config: dict) -> Path:
    """A copy of an ST folder whose 1_Pooling/config.json is `pooling_config`, written as given."""
    shutil.copytree(st_folder, target)
    (target / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return target


def add_e5_tokenizer_contradiction(folder: Path) -> None:
    """Make ``folder`` look like e5-mistral: tokenizer_config.json asks for EOS, tokenizer.json adds only BOS."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(add_bos_token=True, add_eos_token=True, tokenizer_class="LlamaTokenizer")
    path.write_text(json.dumps(config, indent=2))


# Cross-encoder tokenizers: what each family's post-processor does with a pair. BERT's second text is segment 1.
PAIR_TEMPLATES = {
    "bert": ("<s> $A </s>", "<s> $A </s> $B:1 </s>:1"),
    "roberta": ("<s> $A </s>", "<s> $A </s> </s> $B </s>"),
    "xlm-roberta": ("<s> $A </s>", "<s> $A </s> </s> $B </s>"),
    "modernbert": ("<s> $A </s>", "<s> $A </s> $B </s>"),
    "distilbert": ("<s> $A </s>", "<s> $A </s> $B </s>"),  # no token types
}
DECODER_PAIR_TEMPLATE = ("<s> $A", "<s> $A $B")


@functools.cache
def train_pair_tokenizer(single: str, pair: str) -> PreTrainedTokenizerFast:
    """train_tokenizer's vocabulary with a pair template, and "yes"/"no" as tokens (LogitScore reads them);
    token type ids among its outputs where the template has a segment 1, as BERT's tokenizer has them."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", "<pad>", "yes", "no"])
    tokenizer.train_from_iterator(make_texts(2000, seed=2, max_words=30)[2:], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    names = ["input_ids", "token_type_ids", "attention_mask"] if ":1" in pair else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_input_names=names,
        model_max_length=512,  # as real cross-encoders' tokenizer_config.json
    )


def build_cross_encoder(
    folder: Path, family: str, num_labels: int = 1, causal_lm: bool = False, seed: int = 0, **overrides
) -> Path:
    """A random-weight Hugging Face cross-encoder checkpoint: *ForSequenceClassification with `num_labels`, or
    with `causal_lm` the *ForCausalLM class (which CrossEncoder reads with LogitScore("yes", "no"))."""
    spec = {"vocab_size": 600, "max_position_embeddings": 512, **MODEL_CONFIGS[family], **overrides}
    config = transformers.AutoConfig.for_model(
        bos_token_id=1, eos_token_id=2, pad_token_id=3, num_labels=num_labels, **spec
    )
    torch.manual_seed(seed)
    auto_class = transformers.AutoModelForCausalLM if causal_lm else transformers.AutoModelForSequenceClassification
    model = auto_class.from_config(config)
    with torch.no_grad():  # default init leaves biases and norms trivial; make every tensor matter
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(folder)
    train_pair_tokenizer(*PAIR_TEMPLATES.get(family, DECODER_PAIR_TEMPLATE)).save_pretrained(folder)
    return folder
