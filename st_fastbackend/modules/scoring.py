"""A cross-encoder's first module on the packed engine: pairs tokenized as sentence-transformers' Transformer
tokenizes them (one tokenizer call on [first, second] pairs, truncation="longest_first", the tokenizer's
max length), packed without padding, the engine, then the head: a sequence-classification head's logits
(`scores`), or for a causal LM only the LM-head rows LogitScore reads, at each pair's last token (`lm_rows`),
never logits over the vocabulary.

Stands in for sentence-transformers' Transformer with transformer_task "sequence-classification" or
"text-generation"; saves as it does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from sentence_transformers.base.modules import Transformer
from sentence_transformers.base.modules.transformer import TRANSFORMER_TASK_DEFAULTS, TRANSFORMER_TASK_TO_AUTO_MODEL
from sentence_transformers.cross_encoder.modules import LogitScore

from st_fastbackend.engine.batch import Tokens
from st_fastbackend.engine.prefix import Prefix
from st_fastbackend.engine.spec import UnsupportedModelError
from st_fastbackend.engine.weights import CheckpointError, checkpoint_files, load_weights
from st_fastbackend.modules.heads import build_head, last_tokens
from st_fastbackend.modules.inputs import naming_lone_surrogates
from st_fastbackend.modules.options import task_config
from st_fastbackend.modules.transformer import PackedTransformer

TASKS = ("sequence-classification", "text-generation")
MIN_SHARED = 8  # shared tokens worth a pass of their own


@dataclass(frozen=True)
class PairTemplate:
    """What the tokenizer puts around a pair's two texts: special tokens before, between and after them, and where it
    gives token types, those of each part (before, the first text's, between, the second text's, after)."""

    before: list[int]
    between: list[int]
    after: list[int]
    types: tuple[list[int], int, list[int], int, list[int]] | None


def longest_first(first: int, second: int, budget: int, first_longer: bool) -> tuple[int, int]:
    """The own tokens of each text a pair keeps under truncation="longest_first" at `budget` (max_length less the
    template's special tokens), as the Rust tokenizers cut it (tokenizers' utils/truncation.rs): a text under half
    the budget is kept whole and the other gets the rest, else each gets half and the longer the odd token. A count
    may be any number over `budget` where that is all that is known of it; `first_longer` (first > second) says
    which is longer where both are."""
    if first + second <= budget:
        return first, second
    short, long = (second, first) if first_longer else (first, second)
    long = short if short > budget else max(short, budget - short)
    if short + long > budget:
        short, long = budget // 2, budget // 2 + budget % 2
    kept = (long, short) if first_longer else (short, long)
    return min(first, kept[0]), min(second, kept[1])


class PackedScoringTransformer(PackedTransformer):
    def __init__(self, model_name_or_path: str, *, transformer_task: str = TASKS[0], **kwargs) -> None:
        if transformer_task not in TASKS:
            raise UnsupportedModelError(f"A cross-encoder Transformer with transformer_task={transformer_task!r}")
        self.transformer_task = transformer_task
        super().__init__(model_name_or_path, **kwargs)
        # With a chat template sentence-transformers renders a pair as query/document messages (and restores the
        # template's suffix after truncation): its own Transformer does that here, on a model of no weights.
        formatter = None
        if getattr(self.tokenizer, "chat_template", None) is not None:
            formatter = PairFormatter(str(self.folder), transformer_task=transformer_task)
            self.tokenizer.padding_side = formatter.processor.padding_side  # left for a causal LM (its check)
            formatter.processor = self.tokenizer  # one tokenizer: max_seq_length set here holds there
        object.__setattr__(self, "pair_formatter", formatter)  # not a submodule: its meta weights never move
        # transformers' forward takes token types only where the model has them (BERT, RoBERTa, XLM-R).
        self.token_types = self.family.token_types
        # [k, hidden], set by lm_rows_for (LogitScore's token ids); a buffer, so .to() moves it
        self.register_buffer("lm_rows", None, persistent=False)

    def load_checkpoint(self, device: torch.device, dtype: torch.dtype) -> None:
        """Body and head from one checkpoint, each strictly: the body skips what the head owns. A causal LM's
        head is read later, only the rows LogitScore needs (lm_rows_for)."""
        if self.transformer_task == "text-generation":
            architecture = (self.config.architectures or ["(none)"])[0]
            if not self.family.causal or not architecture.endswith("ForCausalLM"):
                raise UnsupportedModelError(f"A causal-LM reranker of architecture {self.config.architectures}")
            if getattr(self.config, "final_logit_softcapping", None) is not None:
                raise UnsupportedModelError("final_logit_softcapping in a causal-LM reranker")
            self.head = None
            load_weights(self.model, self.folder, device, dtype)
            return
        self.head = build_head(self.config, self.model.prefixes)
        load_weights(self.model, self.folder, device, dtype, skip=self.head.owns)
        load_weights(self.head, self.folder, device, dtype, only=self.head.owns)

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs) -> PackedScoringTransformer:
        """sentence_bert_config.json as plain sentence-transformers saves a cross-encoder's Transformer."""
        init_kwargs = Transformer._load_init_kwargs(model_name_or_path, subfolder=subfolder, **kwargs)
        return cls(model_name_or_path, **task_config(init_kwargs, "sequence-classification"))

    def lm_rows_for(self, token_ids: list[int]) -> None:
        """Keep only these rows of the LM head (tied: of the input embeddings), read from the checkpoint."""
        weight = self.model.embed_tokens.weight
        if getattr(self.config.get_text_config(), "tie_word_embeddings", False):
            self.lm_rows = weight[token_ids].clone()
            return
        for file in checkpoint_files(self.folder):
            with safe_open(file, framework="pt", device=str(weight.device)) as f:
                if "lm_head.weight" in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    rows = f.get_slice("lm_head.weight")
                    self.lm_rows = torch.cat([rows[i : i + 1] for i in token_ids]).to(weight.dtype)
                    return
        raise CheckpointError(f"Checkpoint in {self.folder} lacks lm_head.weight (and ties no embeddings)")

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), "transformer_task": self.transformer_task,
                "module_output_name": TRANSFORMER_TASK_DEFAULTS[self.transformer_task][1]}  # fmt: skip

    def encode_pairs(self, pairs: list, prompt: str | None, first_index: int = 0) -> list[Tokens]:
        """Token ids of each (first, second) pair as plain sentence-transformers tokenizes a batch of them:
        the prompt before the first text, truncation="longest_first" at the tokenizer's max length."""
        if self.pair_formatter is not None:
            return self._rendered_pairs(pairs, prompt, first_index)
        texts = [[prompt + first, second] if prompt else [first, second] for first, second in pairs]
        with naming_lone_surrogates(pairs, first_index, prompt):
            out = self.tokenizer(texts, truncation="longest_first", padding=False, verbose=False)
        sequences = []
        for index, ids in enumerate(out["input_ids"]):
            if not ids:
                raise ValueError(f"Input {first_index + index} has no tokens; there is nothing to score.")
            types = out["token_type_ids"][index] if self.token_types and "token_type_ids" in out else None
            sequences.append(Tokens(ids, types))
        return sequences

    @property
    def pair_budget(self) -> int:
        """The texts' own tokens a pair holds at most: max_length less the special tokens the template adds."""
        return self.tokenizer.model_max_length - self.tokenizer.num_special_tokens_to_add(pair=True)

    def join_pair(self, first: list[int], second: list[int]) -> Tokens:
        """A pair's token ids from its two texts' own ids, already cut (longest_first): what encode_pairs gives for
        them, the template's special tokens placed around them (without a chat template)."""
        template = self._pair_template
        ids, types = template.before + first + template.between + second + template.after, None
        if template.types is not None:
            before, one, between, two, after = template.types
            types = before + [one] * len(first) + between + [two] * len(second) + after
        return Tokens(ids, types)

    @functools.cached_property
    def _pair_template(self) -> PairTemplate:
        """Read from a pair of two one-token texts, as the tokenizer's post-processor lays out every pair."""
        probe = self.tokenizer([["a", "b"]], truncation=False, verbose=False)
        ids, parts = probe["input_ids"][0], probe.sequence_ids(0)
        first, second = parts.index(0), parts.index(1)  # each text's first token; one token each
        if parts.count(0) != 1 or parts.count(1) != 1:
            raise UnsupportedModelError(f"A tokenizer whose pair template splits 'a' or 'b' ({parts})")
        types = None
        if self.token_types and "token_type_ids" in probe:
            every = probe["token_type_ids"][0]
            types = (every[:first], every[first], every[first + 1 : second], every[second], every[second + 1 :])
        return PairTemplate(ids[:first], ids[first + 1 : second], ids[second + 1 :], types)

    def pair_lengths(self, pairs: list, prompt: str | None = None) -> list[int]:
        """Each pair's token count before truncation (through the chat template where the tokenizer has one)."""
        if self.pair_formatter is not None:  # the prompt as encode_pairs renders it
            whole = {"text": {"truncation": False}}
            features = self.pair_formatter.preprocess([list(p) for p in pairs], prompt=prompt, processing_kwargs=whole)
            return features["attention_mask"].sum(1).tolist()
        texts = [[prompt + first, second] if prompt else [first, second] for first, second in pairs]
        return [len(ids) for ids in self.tokenizer(texts, truncation=False, verbose=False)["input_ids"]]

    def _rendered_pairs(self, pairs: list, prompt: str | None, first_index: int) -> list[Tokens]:
        """Token ids of each pair through the chat template, as sentence-transformers' preprocess makes them (its
        padded batch, unpadded by its attention mask)."""
        with naming_lone_surrogates(pairs, first_index, prompt):
            features = self.pair_formatter.preprocess([list(pair) for pair in pairs], prompt=prompt)
        sequences = [ids[mask.bool()].tolist() for ids, mask in zip(features["input_ids"], features["attention_mask"],
                                                                     strict=True)]  # fmt: skip
        for index, ids in enumerate(sequences):
            if not ids:
                raise ValueError(f"Input {first_index + index} has no tokens; there is nothing to score.")
        return [Tokens(ids) for ids in sequences]

    def shared_prefix(self, sequences: list[Tokens]) -> Prefix | None:
        """The tokens every pair of a chunk begins with (a chat template's head and instruction; rank()'s query
        too), computed once on a causal-LM reranker: each pair keeps at least one token of its own, which the
        LM-head rows are read at. None where fewer than MIN_SHARED tokens are shared, or for any other model."""
        if self.transformer_task != "text-generation" or not self.reuses_prefix:
            return None
        first, length = sequences[0].ids, min(len(pair) for pair in sequences) - 1
        for ids in (pair.ids for pair in sequences[1:]):
            same = 0
            while same < length and ids[same] == first[same]:
                same += 1
            if (length := same) < MIN_SHARED:
                return None
        return Prefix(tuple(first[:length]), length) if length >= MIN_SHARED else None

    def pack(self, sequences: list[Tokens], prompt: str | None = None, prefix: Prefix | None = None) -> dict:
        """A pair's prompt is one of its texts' start: no prompt length to pool by."""
        return super().pack(sequences, None, prefix)

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        features = super().forward(features, **kwargs)
        h, packed = features["token_embeddings"], features["packed"]
        if self.head is not None:
            features["scores"] = self.head(h, packed)  # [B, num_labels]
        else:  # the LM head's kept rows at each pair's last token: [B, H] x [H, k]
            features["lm_rows"] = last_tokens(h, packed) @ self.lm_rows.T
        return features


class PairFormatter(Transformer):
    """sentence-transformers' Transformer for its preprocess() only: its model is built on the meta device."""

    def _load_model(self, model_name_or_path, transformer_task, config, *args, **kwargs):
        with torch.device("meta"):
            return TRANSFORMER_TASK_TO_AUTO_MODEL[transformer_task].from_config(config)


class PackedLogitScore(LogitScore):
    """LogitScore on the rows the transformer kept (its true token's, then its false token's)."""

    @property
    def token_ids(self) -> list[int]:
        return [self.true_token_id] + ([] if self.false_token_id is None else [self.false_token_id])

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        rows = features["lm_rows"]  # [B, 1 or 2]
        scores = rows[:, 0] if self.false_token_id is None else rows[:, 0] - rows[:, 1]
        features["scores"] = scores.unsqueeze(1)
        return features
