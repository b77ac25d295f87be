"""The code blocks of README.md and docs/, and what they need to run as written: small random-weight stand-ins in a
Hugging Face cache under the Hub ids they name, local folders and input files in the folder they run in.

A block's info string says what it is: `python` and `bash` run, `text` is output or a diagram. The line right
before a block may mark it: `<!-- snippet: skip (why) -->` is not run (the reason is required), `<!-- snippet:
server (...) -->` is the server command the test starts itself, once, before the blocks that talk to it, `<!--
snippet: int8 (why) -->` runs where int8 products do (AVX512-VNNI) and is skipped, naming why, elsewhere."""

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from builders import build_cross_encoder, build_st_model, make_texts
from hybrid_builders import build_colbert, build_splade

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash"}
MARK = re.compile(r"<!-- snippet: (skip|server|int8) \((.+)\) -->")
PORT = 8000  # the port the snippets name; the test's server listens elsewhere and the snippets are pointed at it
E5_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # the opening fence's line, from 1
    lang: str
    mark: str | None  # "skip", "server", "int8" or None
    why: str | None
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines, found, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            mark = MARK.fullmatch(lines[i - 1].strip()) if i else None
            found.append(Block(str(path.relative_to(ROOT)), i + 1, lines[i][3:].strip(), mark and mark[1],
                               mark and mark[2], "\n".join(lines[i + 1 : end]) + "\n"))  # fmt: skip
            i = end
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def _sentence_model(folder: Path, family: str = "bert", **kw) -> Path:
    return build_st_model(folder, family, pooling_mode="mean", max_seq_length=256, **kw)  # MiniLM's window


def _e5_mistral(folder: Path) -> Path:
    # Wide enough for the snippets' `dimensions: 256`; e5-mistral's own prompt name for web search queries.
    return build_st_model(folder, "mistral", pooling_mode="lasttoken", prompts={"web_search_query": E5_PROMPT},
                          hidden_size=256, intermediate_size=256)  # fmt: skip


# Hub id -> a builder of its stand-in (what it is shaped like: the architecture and class, never the size)
HUB = {
    "intfloat/e5-mistral-7b-instruct": _e5_mistral,
    "sentence-transformers/all-MiniLM-L6-v2": _sentence_model,
    "intfloat/e5-base-v2": _sentence_model,
    "BAAI/bge-small-en-v1.5": _sentence_model,
    "BAAI/bge-reranker-base": lambda folder: build_cross_encoder(folder / "st", "xlm-roberta"),
    "naver/splade-v3": lambda folder: build_splade(folder, "bert"),
    "lightonai/colbertv2.0": lambda folder: build_colbert(folder, "bert"),
    # the tiny bge-m3-shaped folder with both heads that tests/models/test_hybrid.py compares with FlagEmbedding
    "BAAI/bge-m3": lambda folder: shutil.copytree(ROOT / "tests" / "data" / "bge_m3" / "model", folder),
}
# Local folders the snippets name, as paths relative to where they run
LOCAL = {"e5-base-v2": "intfloat/e5-base-v2", "my-model": "sentence-transformers/all-MiniLM-L6-v2",
         "splade": "naver/splade-v3", "colbert": "lightonai/colbertv2.0"}  # fmt: skip


def build_hub_cache(cache: Path, scratch: Path) -> dict[str, Path]:
    """Each stand-in saved under its Hub id in HF_HUB_CACHE's layout (models--org--name/snapshots/<rev>/ and
    refs/main), so that from_pretrained and snapshot_download find it with HF_HUB_OFFLINE=1."""
    revision, folders = "0" * 40, {}
    for hub_id, build in HUB.items():
        built = build(scratch / hub_id.replace("/", "--"))
        repo = cache / f"models--{hub_id.replace('/', '--')}"
        shutil.copytree(built, repo / "snapshots" / revision)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
        folders[hub_id] = repo / "snapshots" / revision
    return folders


def fill_workdir(workdir: Path, folders: dict[str, Path]) -> None:
    """The inputs the snippets read: text files, corpora, local model folders."""
    texts = make_texts(24, seed=5, max_words=40)[2:]
    (workdir / "texts.txt").write_text("\n".join(texts) + "\n")
    (workdir / "docs.txt").write_text("\n".join(texts[:8]) + "\n")
    (workdir / "my_texts.txt").write_text("\n".join(texts[:4]) + "\n")
    (workdir / "docs.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    for name, rows in (("corpus", texts), ("corpus-2026-12-03", texts[:16]), ("corpus-2026-12-04", texts[4:])):
        (workdir / name).mkdir()
        table = pa.table({"id": [texts.index(t) for t in rows], "text": rows})
        pq.write_table(table, workdir / name / "part-0.parquet")
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), workdir / "docs.parquet")
    for name, hub_id in LOCAL.items():
        shutil.copytree(folders[hub_id], workdir / name)
