"""The texts under ../shared/data, read as each folder's SOURCE.md describes them."""

from __future__ import annotations

import csv
import json
from pathlib import Path

WHERE = "the data folder is --data-dir, else $ST_FASTBACKEND_DATA_DIR, else ../shared/data beside the repository"


def present(path: Path) -> Path:
    """`path`, or the script stops in one line naming it and where the data folder is looked for."""
    if not path.is_file():
        raise SystemExit(f"eval: error: no {path} ({WHERE})")
    return path


def jsonl(path: Path) -> list[dict]:
    with open(present(path), encoding="utf8") as f:
        return [json.loads(line) for line in f]


def texts(path: Path) -> list[str]:
    """The "text" field of each line of a JSON-lines file."""
    return [row["text"] for row in jsonl(path)]


def read_tsv(path: Path) -> list[dict[str, str]]:
    """Tab separated with a header; csv.QUOTE_NONE, since sentences hold `"` but never a tab or newline."""
    with open(present(path), encoding="utf8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def paragraphs(data_dir: Path) -> list[str]:
    """WikiText-2's 2,185 test paragraphs."""
    return texts(data_dir / "wikitext2" / "wikitext2_test_paragraphs.jsonl")


def articles(data_dir: Path) -> list[str]:
    """WikiText-2's test articles, whole."""
    return texts(data_dir / "wikitext2" / "wikitext2_test_articles.jsonl")


def sts_sentences(data_dir: Path, split: str = "test", columns: tuple[str, ...] = ("sentence1", "sentence2")):
    """STS-B's sentences, pair by pair: row 1's sentence1, row 1's sentence2, row 2's ..."""
    return [row[column] for row in read_tsv(data_dir / "stsb" / f"stsb-{split}.tsv") for column in columns]


def scifact_queries(data_dir: Path) -> list[dict]:
    """All 1,109 SciFact queries (claims): {"_id", "text", "metadata"}."""
    return jsonl(data_dir / "scifact" / "queries.jsonl")


def scifact_corpus(data_dir: Path) -> list[dict]:
    """SciFact's 5,183 documents: {"_id", "title", "text"}, in corpus order."""
    return jsonl(data_dir / "scifact" / "corpus.jsonl")


def document(row: dict) -> str:
    """A BEIR document as MTEB embeds it: title + " " + text."""
    return f"{row['title']} {row['text']}".strip()


def beir(folder: Path, split: str = "test") -> tuple[dict[str, dict[str, int]], list[dict], list[dict]]:
    """A BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv; SciFact's): qrels {query id: {document id:
    score}} in the file's order, the queries judged in `split`, and the corpus."""
    qrels: dict[str, dict[str, int]] = {}
    for row in read_tsv(folder / "qrels" / f"{split}.tsv"):
        qrels.setdefault(row["query-id"], {})[row["corpus-id"]] = int(row["score"])
    queries = [query for query in jsonl(folder / "queries.jsonl") if query["_id"] in qrels]
    return qrels, queries, jsonl(folder / "corpus.jsonl")
