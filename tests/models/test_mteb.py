"""mteb.evaluate() on the fast backend: the same main scores as plain sentence-transformers, on real data.

The tasks are built in memory from ../shared/data (no downloads). cache=None always: mteb's default
cache keys local models by name only and would return one model's results for another.
"""

import csv
import json
import random

import pytest
from helpers import DATA_DIR, load_both, minilm_path, needs_data

mteb = pytest.importorskip("mteb")
from datasets import Dataset, DatasetDict  # noqa: E402
from mteb.abstasks.retrieval import AbsTaskRetrieval  # noqa: E402
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData  # noqa: E402
from mteb.abstasks.sts import AbsTaskSTS  # noqa: E402
from mteb.abstasks.task_metadata import TaskMetadata  # noqa: E402

METADATA = dict(
    description="Built in memory from ../shared/data for the st_fastbackend tests.",
    reference="https://github.com/embeddings-benchmark/mteb",
    dataset={"path": "NA", "revision": "NA"},
    category="t2t",
    eval_splits=["test"],
    eval_langs=["eng-Latn"],
    date=("2012-01-01", "2017-12-31"),
    dialect=["Written"],
    domains=[],
    task_subtypes=[],
    license="cc-by-sa-4.0",
    annotations_creators="human-annotated",
    modalities=["text"],
    sample_creation="found",
    bibtex_citation="",
)


class STSBenchmark(AbsTaskSTS):
    metadata = TaskMetadata(type="STS", name="STSBenchmark", main_score="cosine_spearman", **METADATA)
    min_score, max_score = 0, 5
    pairs: int | None = None

    def load_data(self, **kwargs) -> None:
        with open(DATA_DIR / "stsb" / "stsb-test.tsv", encoding="utf8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[: self.pairs]
        columns = {"sentence1": [r["sentence1"] for r in rows], "sentence2": [r["sentence2"] for r in rows]}
        self.dataset = DatasetDict(
            {"test": Dataset.from_dict({**columns, "score": [float(r["score"]) for r in rows]})}
        )
        self.data_loaded = True


class SciFactSubset(AbsTaskRetrieval):
    """All 300 test queries, their relevant documents, and 300 other documents."""

    metadata = TaskMetadata(type="Retrieval", name="SciFactSubset", main_score="ndcg_at_10", **METADATA)

    def load_data(self, **kwargs) -> None:
        folder = DATA_DIR / "scifact"
        with open(folder / "qrels" / "test.tsv", encoding="utf8") as f:
            qrels = {}
            for r in csv.DictReader(f, delimiter="\t"):
                qrels.setdefault(r["query-id"], {})[r["corpus-id"]] = int(r["score"])
        relevant = {doc for docs in qrels.values() for doc in docs}
        with open(folder / "corpus.jsonl", encoding="utf8") as f:
            corpus = [json.loads(line) for line in f]
        others = random.Random(0).sample([d for d in corpus if d["_id"] not in relevant], 300)
        docs = [d for d in corpus if d["_id"] in relevant] + others
        with open(folder / "queries.jsonl", encoding="utf8") as f:
            queries = [q for q in map(json.loads, f) if q["_id"] in qrels]
        split = RetrievalSplitData(
            corpus=Dataset.from_list([{"id": d["_id"], "title": d["title"], "text": d["text"]} for d in docs]),
            queries=Dataset.from_list([{"id": q["_id"], "text": q["text"]} for q in queries]),
            relevant_docs=qrels,
            top_ranked=None,
        )
        self.dataset = {"default": {"test": split}}
        self.data_loaded = True


def main_score(model, task) -> float:
    result = mteb.evaluate(model, task, cache=None, show_progress_bar=False)
    return result.task_results[0].get_score()


@pytest.mark.slow
@pytest.mark.real_model
@needs_data
def test_stsb_and_scifact_main_scores_match_plain():
    plain, fast = load_both(minilm_path())
    for task, published in ((STSBenchmark(), 0.8203), (SciFactSubset(), None)):
        ours, theirs = main_score(fast, task), main_score(plain, task)
        assert ours == pytest.approx(theirs, abs=1e-4, nan_ok=True)
        if published is not None:
            assert ours == pytest.approx(published, abs=1e-4)


@needs_data
def test_mteb_prompt_selection_reaches_the_fast_backend(st_model):
    """e5-mistral style: a prompt keyed by the task name in config_sentence_transformers.json."""
    prompt = "Instruct: Retrieve semantically similar text.\nQuery: "
    folder = st_model("mistral", pooling_mode="lasttoken", prompts={"STSBenchmark": prompt})
    plain, fast = load_both(folder)
    seen = []
    original = fast.encode

    def spy(*args, **kwargs):
        seen.append(kwargs.get("prompt_name") or kwargs.get("prompt"))
        return original(*args, **kwargs)

    fast.encode = spy
    task = STSBenchmark()
    task.pairs = 200
    ours, theirs = main_score(fast, task), main_score(plain, task)
    assert ours == pytest.approx(theirs, abs=1e-4)
    assert seen and all(value in ("STSBenchmark", prompt) for value in seen)
