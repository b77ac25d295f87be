"""The server's app on a cross-encoder (POST /v1/rerank, POST /rerank; in process, through the same guard,
worker, limits and errors as /v1/embeddings), `serve`'s detection of a cross-encoder folder, and
`st-fastbackend rerank`, against plain sentence_transformers.CrossEncoder on the same folder."""

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import sentence_transformers
import torch
from builders import build_cross_encoder, make_texts
from fastapi.testclient import TestClient
from serving import HEADERS, KEY

from st_fastbackend import CrossEncoder
from st_fastbackend.cli.rerank import serves_rerank
from st_fastbackend.serve.app import create_app

DOCUMENTS = [t for t in make_texts(30, seed=4, max_words=120) if t]
QUERY = "ovxvvhi xheysj crnif"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp("rerank") / "bert", "bert")


@pytest.fixture(scope="module")
def plain(folder):
    return sentence_transformers.CrossEncoder(str(folder), device="cpu")


@pytest.fixture(scope="module")
def client(folder):
    model = CrossEncoder(str(folder), backend="fast", device="cpu")
    app = create_app(model, "tiny", max_tokens_per_batch=4096, max_batch_size=64, max_input_tokens=512, api_key=KEY)
    with TestClient(app) as client:  # the lifespan: worker started, warm-up request answered
        yield client


def test_v1_rerank_cohere_shape(client, plain):
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, *DOCUMENTS[2:]]
    body = {"model": "tiny", "query": QUERY, "documents": documents, "top_n": 5, "return_documents": True}
    reply = client.post("/v1/rerank", json=body, headers=HEADERS)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["model"] == "tiny" and data["id"] and data["usage"]["total_tokens"] > 0
    expected = plain.rank(QUERY, DOCUMENTS, top_k=5)
    assert [r["index"] for r in data["results"]] == [r["corpus_id"] for r in expected]
    scores = [r["relevance_score"] for r in data["results"]]
    np.testing.assert_allclose(scores, [r["score"] for r in expected], atol=1e-5, rtol=0)
    assert [r["document"]["text"] for r in data["results"]] == [DOCUMENTS[r["corpus_id"]] for r in expected]


def test_tei_rerank_shape_raw_scores(client, plain):
    body = {"query": QUERY, "texts": DOCUMENTS, "raw_scores": True, "return_text": True}
    reply = client.post("/rerank", json=body, headers=HEADERS)
    assert reply.status_code == 200, reply.text
    results = reply.json()
    expected = plain.predict([(QUERY, d) for d in DOCUMENTS], activation_fn=torch.nn.Identity())
    assert [r["index"] for r in results] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([r["score"] for r in results], expected[[r["index"] for r in results]], atol=1e-5)
    assert all(r["text"] == DOCUMENTS[r["index"]] for r in results)


def error_message(path: str, reply) -> str:
    """The message of an error in the shape of the path's dialect: TEI's {"error", "error_type"}, Cohere's
    {"id", "message"}, else OpenAI's."""
    body = reply.json()
    if path in ("/rerank", "/embed", "/embed_all", "/"):
        assert set(body) == {"error", "error_type"}, body
        return body["error"]
    if path == "/v2/embed":
        assert set(body) == {"id", "message"}, body
        return body["message"]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["message"]


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/v1/rerank", {"query": QUERY}, 400, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, 400, "documents is empty"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, 400, "top_n"),
        ("/v1/rerank", {"query": 3, "documents": ["a"]}, 400, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "model": "other"}, 404, "other"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"] * 65}, 400, "limit is 64"),
        ("/v1/rerank", '{"query": "a\\ud800", "documents": ["a"]}', 400, "The query holds a lone surrogate (U+D800)"),
        ("/rerank", {"query": QUERY}, 422, "texts"),
        ("/rerank", {"query": QUERY, "texts": [1]}, 422, "texts"),
        ("/rerank", {"query": QUERY, "texts": []}, 400, "texts is empty"),
        ("/rerank", {"query": QUERY, "texts": ["a"] * 65}, 413, "limit is 64"),
        ("/rerank", '{"query": "q", "texts": ["a", "b\\udc00"]}', 422, "texts[1] holds a lone surrogate (U+DC00)"),
        ("/rerank", {"query": QUERY, "texts": [" ".join(DOCUMENTS)], "truncate": False}, 413, "texts[0]"),
        ("/rerank", "{not json", 400, "not valid JSON"),
        ("/v1/embeddings", {"input": "a"}, 404, "Invalid URL"),
        ("/embed", {"inputs": "a"}, 404, "Invalid URL"),  # a route this model is not served on: its dialect's 404
        ("/v2/embed", {"texts": ["a"]}, 404, "Invalid URL"),
    ],
)
def test_bad_requests_name_the_field_in_the_dialects_shape(client, path, body, status, fragment):
    """The trial: TEI's /rerank answered all 7 bad bodies in OpenAI's shape, and /embed its 404 too."""
    sent = {"content": body} if isinstance(body, str) else {"json": body}
    reply = client.post(path, **sent, headers={**HEADERS, "Content-Type": "application/json"})
    assert reply.status_code == status, reply.text
    assert fragment in error_message(path, reply)
    unauthorized = client.post(path, **sent, headers={"Content-Type": "application/json"})
    assert unauthorized.status_code == 401 and error_message(path, unauthorized)


def test_auth_metrics_and_concurrent_clients(client, plain):
    assert client.post("/v1/rerank", json={"query": QUERY, "documents": ["a"]}).status_code == 401
    expected = {i: plain.rank(DOCUMENTS[i], DOCUMENTS[:12]) for i in range(8)}

    def ask(i: int) -> list:
        body = {"query": DOCUMENTS[i], "documents": DOCUMENTS[:12]}
        return client.post("/v1/rerank", json=body, headers=HEADERS).json()["results"]

    with ThreadPoolExecutor(8) as pool:
        answers = dict(zip(range(8), pool.map(ask, range(8)), strict=True))
    for i, results in answers.items():
        assert [r["index"] for r in results] == [r["corpus_id"] for r in expected[i]]
    exposition = client.get("/metrics", headers=HEADERS).text
    assert 'embedding_requests_total{endpoint="/v1/rerank"}' in exposition


def test_serve_tells_a_cross_encoder_folder(folder, plain, tmp_path, st_model):
    def asks(model, task="auto") -> bool:
        return serves_rerank(argparse.Namespace(model=str(model), task=task))

    plain.save(str(tmp_path / "saved"))  # config_sentence_transformers.json: model_type CrossEncoder
    assert asks(folder) and asks(tmp_path / "saved")
    embedder = st_model("bert", pooling_mode="mean")
    assert not asks(embedder) and asks(embedder, "rerank") and not asks(folder, "embed")


@pytest.mark.slow
def test_cli_rerank_prints_and_writes_jsonl(folder, plain, tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(DOCUMENTS[:10]) + "\n")
    command = [sys.executable, "-m", "st_fastbackend.cli", "rerank", str(folder), "--query", QUERY,
               "--input", str(docs), "--device", "cpu"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    expected = plain.rank(QUERY, DOCUMENTS[:10])
    printed = [line.split("\t") for line in out.stdout.splitlines()]
    assert [int(index) for _, index, _ in printed] == [r["corpus_id"] for r in expected]
    assert "10 documents" in out.stderr
    subprocess.run([*command, "--output", str(tmp_path / "out.jsonl"), "--top-k", "3", "--raw-scores"], check=True)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    raw = plain.rank(QUERY, DOCUMENTS[:10], top_k=3, activation_fn=torch.nn.Identity())
    assert [row["index"] for row in rows] == [r["corpus_id"] for r in raw]
    np.testing.assert_allclose([row["score"] for row in rows], [r["score"] for r in raw], atol=1e-5)


def test_cli_rerank_takes_a_prompt_name(folder, tmp_path, capsys):
    """Issue 47: `rerank` had --prompt but not encode's --prompt-name; a named prompt ranks as its text does."""
    from st_fastbackend.cli import main

    saved = tmp_path / "with-prompts"
    sentence_transformers.CrossEncoder(str(folder), prompts={"query": "query: "}, device="cpu").save(str(saved))
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(DOCUMENTS[:6]) + "\n")
    printed = []
    for prompt in (["--prompt-name", "query"], ["--prompt", "query: "]):
        main(["rerank", str(saved), "--query", QUERY, "--input", str(docs), "--device", "cpu", *prompt])
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and len(printed[0].splitlines()) == 6
