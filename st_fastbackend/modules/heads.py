"""What a cross-encoder puts on top of its packed hidden states [T, hidden]: the sequence-classification heads
of transformers' *ForSequenceClassification classes, one per family, as data (architecture -> head).

Each head reads the checkpoint tensors it `owns` (the body skips them; engine/weights.py) and turns a pack's
hidden states into logits [B, num_labels], picking the tokens its transformers class picks: the first token
(BERT, RoBERTa, DistilBERT, ModernBERT "cls"), the mean of each sequence (ModernBERT "mean"), the last token that
is not padding (the decoders' GenericForSequenceClassification).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.engine.spec import UnsupportedModelError


def first_tokens(h: Tensor, packed: PackedBatch) -> Tensor:
    return h[packed.cu_seqlens[:-1].long()]  # [T, H] -> [B, H]


def last_tokens(h: Tensor, packed: PackedBatch) -> Tensor:
    return h[packed.cu_seqlens[1:].long() - 1]  # [T, H] -> [B, H]


def mean_tokens(h: Tensor, packed: PackedBatch) -> Tensor:
    """As ModernBertForSequenceClassification: `.sum(dim=1)` accumulates in fp32 and rounds the sum to h's dtype,
    which the lengths divide. (index_add_ into a bf16 buffer would round after every token: a sum stalls at 256
    when adding ones, and on CUDA each token is an atomic add, in no fixed order.)"""
    sums = torch.zeros(packed.num_sequences, h.shape[1], dtype=torch.float32, device=h.device)
    sums.index_add_(0, packed.sequence_ids(), h.float())  # [B, H]
    lengths = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).to(h.dtype)
    return sums.to(h.dtype) / lengths[:, None]


class Head(nn.Module):
    owns: tuple[str, ...] = ()  # checkpoint tensor names (after the body's prefix) this head reads
    fused: dict = {}  # engine/weights.py reads a head as it reads an engine
    ignored: tuple[str, ...] = ()

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes  # the body's: "bert.pooler.dense.weight" is the head's "pooler.dense.weight"


class BertHead(Head):
    """BertForSequenceClassification: the pooler (dense + tanh on [CLS]), then the classifier."""

    owns = ("pooler.", "classifier.")

    def __init__(self, config: PretrainedConfig, prefixes: tuple[str, ...]) -> None:
        super().__init__(prefixes)
        self.pooler = nn.ModuleDict({"dense": nn.Linear(config.hidden_size, config.hidden_size)})
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, h: Tensor, packed: PackedBatch) -> Tensor:
        return self.classifier(torch.tanh(self.pooler["dense"](first_tokens(h, packed))))


class RobertaHead(Head):
    """RobertaClassificationHead (RoBERTa, XLM-R: bge-reranker): dense + tanh + out_proj on <s>."""

    owns = ("classifier.",)

    def __init__(self, config: PretrainedConfig, prefixes: tuple[str, ...]) -> None:
        super().__init__(prefixes)
        width = config.hidden_size
        self.classifier = nn.ModuleDict(
            {"dense": nn.Linear(width, width), "out_proj": nn.Linear(width, config.num_labels)}
        )

    def forward(self, h: Tensor, packed: PackedBatch) -> Tensor:
        x = torch.tanh(self.classifier["dense"](first_tokens(h, packed)))
        return self.classifier["out_proj"](x)


class DistilBertHead(Head):
    """DistilBertForSequenceClassification: pre_classifier + ReLU on [CLS], then the classifier."""

    owns = ("pre_classifier.", "classifier.")

    def __init__(self, config: PretrainedConfig, prefixes: tuple[str, ...]) -> None:
        super().__init__(prefixes)
        self.pre_classifier = nn.Linear(config.dim, config.dim)
        self.classifier = nn.Linear(config.dim, config.num_labels)

    def forward(self, h: Tensor, packed: PackedBatch) -> Tensor:
        return self.classifier(torch.relu(self.pre_classifier(first_tokens(h, packed))))


class ModernBertHead(Head):
    """ModernBertForSequenceClassification: pool (classifier_pooling cls or mean), dense, act, norm, classifier."""

    owns = ("head.", "classifier.")
    poolings = {"cls": first_tokens, "mean": mean_tokens}

    def __init__(self, config: PretrainedConfig, prefixes: tuple[str, ...]) -> None:
        super().__init__(prefixes)
        if config.classifier_pooling not in self.poolings:
            raise UnsupportedModelError(f"ModernBERT classifier_pooling={config.classifier_pooling!r}")
        self.pool = self.poolings[config.classifier_pooling]
        width = config.hidden_size
        self.head = nn.ModuleDict({
            "dense": nn.Linear(width, width, bias=config.classifier_bias),
            "norm": nn.LayerNorm(width, eps=config.norm_eps, bias=config.norm_bias),
        })  # fmt: skip
        self.act = ACT2FN[config.classifier_activation]
        self.classifier = nn.Linear(width, config.num_labels)

    def forward(self, h: Tensor, packed: PackedBatch) -> Tensor:
        x = self.head["norm"](self.act(self.head["dense"](self.pool(h, packed))))
        return self.classifier(x)


class ScoreHead(Head):
    """The decoders' GenericForSequenceClassification: `score` on each sequence's rightmost token that is not
    the pad token (a sequence ending in pad tokens, e.g. pad = EOS, is read before them, as transformers
    does), its first token when every token is padding; the last token when the config has no pad token."""

    owns = ("score.",)

    def __init__(self, config: PretrainedConfig, prefixes: tuple[str, ...]) -> None:
        super().__init__(prefixes)
        self.pad_token_id = config.pad_token_id
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def forward(self, h: Tensor, packed: PackedBatch) -> Tensor:
        return self.score(h[self.read_positions(packed)])  # [B, H] -> [B, num_labels]

    def read_positions(self, packed: PackedBatch) -> Tensor:
        ends = packed.cu_seqlens[1:].long() - 1
        if self.pad_token_id is None:
            return ends
        index = torch.arange(packed.num_tokens, device=ends.device)
        real = torch.where(packed.input_ids != self.pad_token_id, index, -1)  # [T]
        last = torch.full_like(ends, -1).scatter_reduce(0, packed.sequence_ids(), real, "amax")
        return torch.where(last >= 0, last, packed.cu_seqlens[:-1].long())


HEADS: dict[str, type[Head]] = {
    "BertForSequenceClassification": BertHead,
    "RobertaForSequenceClassification": RobertaHead,
    "XLMRobertaForSequenceClassification": RobertaHead,
    "DistilBertForSequenceClassification": DistilBertHead,
    "ModernBertForSequenceClassification": ModernBertHead,
    "LlamaForSequenceClassification": ScoreHead,
    "MistralForSequenceClassification": ScoreHead,
    "Qwen2ForSequenceClassification": ScoreHead,
    "Qwen3ForSequenceClassification": ScoreHead,
}


def build_head(config: PretrainedConfig, prefixes: tuple[str, ...]) -> Head:
    """The head of the checkpoint's architecture, on the meta device (its tensors are assigned at load)."""
    architecture = (config.architectures or ["(none)"])[0]
    if architecture not in HEADS:
        raise UnsupportedModelError(
            f"A cross-encoder of architecture {architecture} (the fast backend reads the heads of "
            f"{', '.join(sorted(HEADS))}, and *ForCausalLM with LogitScore)"
        )
    with torch.device("meta"):
        return HEADS[architecture](config, prefixes)
