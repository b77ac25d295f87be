"""What `check()` feeds a model, case by case, and how each model class runs a case and compares two runs.

A model class is checked through its `Probing` in PROBING (keyed by sentence-transformers' class, looked up
along the model's MRO): the cases made from the probe texts (or the user's), its outputs for one case with
either backend, and the errors of one run's outputs against another's, per input: max |diff|, and 1 - cosine
where the outputs are vectors. A class plugs in with an entry there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sentence_transformers

SHORT = ["Hello world.", "The quick brown fox jumps over the lazy dog.", "a"]
SCRIPTS = {
    "cjk": ["今日はいい天気ですね。東京タワーに行きましょう。", "我们明天去北京看长城。", "한국어 문장입니다."],
    "arabic": ["مرحبا بالعالم، هذه جملة باللغة العربية."],
    "devanagari": ["नमस्ते दुनिया, यह हिंदी में एक वाक्य है।"],
    "cyrillic": ["Привет, мир! Это предложение на русском языке."],
}
EMOJI = ["🙂🚀🎉", "launch day 👩‍💻 👨‍👩‍👧‍👦 🇯🇵 ❤️‍🔥"]
PUNCTUATION = ["!!! ??? ... --- *** ### @@@ <<< >>> [[ ]] {{ }} || \\\\ // ~~ ^^ %% $$ &&", "«»“”‘’—–…•§¶©®™°±×÷"]
WHITESPACE = ["  lots   of\t\tspaces \n\n and\r\n newlines   ", "\t a word \u00a0 after a no-break space \u2003 "]
PARAGRAPH = (
    "Packed inference runs every text of a batch without padding, one sequence after another, and the "
    "attention kernel is told where each one starts. "
)
QUESTION = "what is this text about?"  # a cross-encoder's first text beside each probe text


@dataclass(frozen=True)
class Case:
    name: str
    inputs: list
    options: dict[str, Any] = field(default_factory=dict)  # e.g. prompt_name, for encode() or predict()


def probe_texts(model) -> dict[str, list[str]]:
    """Case name -> texts: short, long past the window, non-Latin scripts, emoji, only punctuation, only the
    tokenizer's special tokens written out, whitespace-heavy."""
    tokenizer = model.tokenizer
    per_paragraph = max(1, len(tokenizer(PARAGRAPH, add_special_tokens=False)["input_ids"]))
    repeats = 2 * model.max_seq_length // per_paragraph + 1  # twice the window: truncated by both backends
    long = "".join(f"{i}. {PARAGRAPH}" for i in range(repeats))
    specials = " ".join(tokenizer.all_special_tokens)
    punctuation = PUNCTUATION + ([specials] if specials else [])
    return {"short": SHORT, "long": [long, long[: len(long) // 2]], **SCRIPTS, "emoji": EMOJI,
            "special characters": punctuation, "whitespace": WHITESPACE}  # fmt: skip


class Probing:
    """How a model class is checked; subclasses say what the inputs of a case are and what a run returns."""

    vectors = True  # outputs are vectors: 1 - cosine is reported beside max |diff|
    output = "unit-norm embeddings"

    def cases(self, model, texts: list[str] | None) -> list[Case]:
        """The probe cases, each prompt of the model applied to the short texts; or one case of `texts`."""
        if texts is not None:
            return [Case("your texts", self.inputs(texts))]
        found = [Case(name, self.inputs(case_texts)) for name, case_texts in probe_texts(model).items()]
        named = [name for name, prompt in model.prompts.items() if prompt]  # an empty one is the short case again
        prompts = [Case(f"prompt {name!r}", self.inputs(SHORT), {"prompt_name": name}) for name in named]
        return found[:2] + prompts + found[2:]

    def inputs(self, texts: list[str]) -> list:
        return list(texts)

    def outputs(self, model, case: Case) -> np.ndarray:
        """[inputs, D] float64 (for the default `errors`; a class with its own may return what that reads)."""
        raise NotImplementedError

    def errors(self, ours, reference) -> tuple[np.ndarray, np.ndarray | None]:
        """Per input: max |diff| (NaN counts as infinite), and 1 - cosine where the outputs are unit vectors."""
        diff = np.nan_to_num(np.abs(ours - reference), nan=np.inf).max(axis=1)
        if not self.vectors:
            return diff, None
        cosine = np.maximum(1 - (ours * reference).sum(axis=1), 0)  # not below 0 by rounding (-2e-16); NaN stays
        return diff, np.nan_to_num(cosine, nan=np.inf)

    def copy_settings(self, fast, plain) -> None:
        """What a user may have changed on the loaded model, onto the plain one loaded beside it."""
        plain.max_seq_length = fast.max_seq_length
        plain.prompts = dict(fast.prompts)
        plain.default_prompt_name = fast.default_prompt_name


class Embeddings(Probing):
    def outputs(self, model, case: Case) -> np.ndarray:
        rows = model.encode(case.inputs, batch_size=32, show_progress_bar=False, convert_to_numpy=True, **case.options)
        rows = np.asarray(rows, dtype=np.float64)
        return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)

    def copy_settings(self, fast, plain) -> None:
        super().copy_settings(fast, plain)
        plain.truncate_dim = fast.truncate_dim


class Scores(Probing):
    vectors = False
    output = "predict() scores"

    def inputs(self, texts: list[str]) -> list:
        """Each text as a document for a question, and as both texts of a pair."""
        return [pair for text in texts for pair in ((QUESTION, text), (text, text))]

    def cases(self, model, texts: list[str] | None) -> list[Case]:
        if texts is None:
            return super().cases(model, None)
        return [Case("your pairs", [_pair(line, i) for i, line in enumerate(texts)])]

    def outputs(self, model, case: Case) -> np.ndarray:
        scores = model.predict(case.inputs, batch_size=32, show_progress_bar=False, convert_to_numpy=True,
                               **case.options)  # fmt: skip
        return np.asarray(scores, dtype=np.float64).reshape(len(case.inputs), -1)


class TaskProbing(Probing):
    """A class with a query side (encode(task="query"): a ColBERT's query length and expansion, inference-free
    SPLADE's static route) gets a case of short queries too."""

    def cases(self, model, texts: list[str] | None) -> list[Case]:
        found = super().cases(model, texts)
        return found if texts is not None else [*found, Case("queries", self.inputs(SHORT), {"task": "query"})]


class SparseVectors(TaskProbing):
    """A SparseEncoder's rows as they are (not unit length: SPLADE's values are dot-product weights): per row the
    max |diff| over its largest value (at least 1), infinite where the active dimensions differ."""

    output = "sparse rows, relative to each row's largest value, with the same active dimensions"

    def outputs(self, model, case: Case) -> np.ndarray:
        rows = model.encode(case.inputs, batch_size=32, show_progress_bar=False, convert_to_tensor=True,
                            convert_to_sparse_tensor=False, **case.options)  # fmt: skip
        return rows.double().cpu().numpy()

    def errors(self, ours, reference) -> tuple[np.ndarray, np.ndarray | None]:
        scale = np.maximum(np.abs(reference).max(axis=1), 1.0)
        diff = np.nan_to_num(np.abs(ours - reference), nan=np.inf).max(axis=1) / scale
        diff[((ours != 0) != (reference != 0)).any(axis=1)] = np.inf
        unit = [rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12) for rows in (ours, reference)]
        return diff, np.nan_to_num(np.maximum(1 - (unit[0] * unit[1]).sum(axis=1), 0), nan=np.inf)


class TokenVectors(TaskProbing):
    """A MultiVectorEncoder's per-text [n_i, dim] vectors (as documents): per text the worst of its tokens; a text
    whose scored tokens differ in number fails outright."""

    output = "unit-norm token vectors"

    def outputs(self, model, case: Case) -> list[np.ndarray]:
        rows = model.encode(case.inputs, batch_size=32, show_progress_bar=False, convert_to_numpy=True,
                            **case.options)  # fmt: skip
        rows = [np.asarray(r, dtype=np.float64) for r in rows]
        return [r / np.maximum(np.linalg.norm(r, axis=1, keepdims=True), 1e-12) for r in rows]

    def errors(self, ours, reference) -> tuple[np.ndarray, np.ndarray | None]:
        diffs, cosines = [], []
        for mine, theirs in zip(ours, reference, strict=True):
            if mine.shape != theirs.shape or not len(mine):
                diffs.append(np.inf if mine.shape != theirs.shape else 0.0)
                cosines.append(np.inf if mine.shape != theirs.shape else 0.0)
                continue
            diffs.append(np.nan_to_num(np.abs(mine - theirs), nan=np.inf).max())
            cosines.append(np.nan_to_num(np.maximum(1 - (mine * theirs).sum(axis=1), 0), nan=np.inf).max())
        return np.array(diffs), np.array(cosines)


def _pair(line: str, index: int) -> tuple[str, str]:
    if "\t" not in line:
        raise ValueError(f"line {index + 1} of the texts has no tab: a cross-encoder is checked on query<TAB>document")
    query, document = line.split("\t", 1)
    return query, document


PROBING: dict[type, Probing] = {
    sentence_transformers.SentenceTransformer: Embeddings(),
    sentence_transformers.CrossEncoder: Scores(),
    sentence_transformers.SparseEncoder: SparseVectors(),
    sentence_transformers.MultiVectorEncoder: TokenVectors(),
}


def probing_for(model) -> Probing:
    for cls in type(model).__mro__:
        if cls in PROBING:
            return PROBING[cls]
    raise TypeError(f"check() does not know {type(model).__name__} yet (models/probes.py PROBING)")
