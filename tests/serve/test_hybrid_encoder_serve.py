"""A HybridEncoder (BGE-M3's three outputs) served: /embed_hybrid gives each input's dense vector, lexical weights and
ColBERT vectors as encode_all() does, /embed_sparse the lexical weights, /v1/embeddings the dense vector; in process
through the app, and from the CLI on a real port."""

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from serving import HEADERS, KEY, start_server

from st_fastbackend.models.hybrid import HybridEncoder
from st_fastbackend.serve.app import create_app

DATA = Path(__file__).parent.parent / "data" / "bge_m3"
MODEL = DATA / "model"
TEXTS = [t for t in json.loads((DATA / "texts.json").read_text()) if t]  # TEI refuses an empty input


@pytest.fixture(scope="module")
def model() -> HybridEncoder:
    return HybridEncoder(str(MODEL), device="cpu")


def post(client, path: str, body) -> list:
    reply = client.post(path, json=body, headers=HEADERS)
    assert reply.status_code == 200, reply.text
    return reply.json()


def assert_hybrid(got: list, expected) -> None:
    assert np.abs(np.array([row["dense"] for row in got]) - expected.dense).max() < 1e-5
    for row, lexical in zip(got, expected.lexical_weights, strict=True):
        assert {v["index"]: v["value"] for v in row["sparse"]} == pytest.approx(lexical, abs=1e-6)
        assert [v["index"] for v in row["sparse"]] == sorted(lexical)
    for row, vectors in zip(got, expected.multi_vector, strict=True):
        assert np.abs(np.array(row["multi_vector"]) - vectors).max() < 1e-5


def test_routes_give_encode_all(model):
    expected = model.encode_all(TEXTS)
    app = create_app(model, "tiny", max_tokens_per_batch=4096, max_batch_size=64,
                     max_input_tokens=model.max_seq_length, api_key=KEY)  # fmt: skip
    with TestClient(app) as client:
        assert_hybrid(post(client, "/embed_hybrid", {"inputs": TEXTS, "truncate": True}), expected)
        sparse = post(client, "/embed_sparse", {"inputs": TEXTS, "truncate": True})
        assert [{v["index"] for v in row} for row in sparse] == [set(w) for w in expected.lexical_weights]
        dense = post(client, "/v1/embeddings", {"input": TEXTS[:3], "model": "tiny"})["data"]
        assert np.abs(np.array([d["embedding"] for d in dense]) - model.encode(TEXTS[:3])).max() < 1e-5


@pytest.mark.slow
def test_cli_serves_a_bge_m3_folder(model):
    process, url = start_server(MODEL, "--api-key", KEY)
    try:
        reply = httpx.post(f"{url}/embed_hybrid", json={"inputs": TEXTS[:4]}, headers=HEADERS, timeout=60)
        assert reply.status_code == 200, reply.text
        assert_hybrid(reply.json(), model.encode_all(TEXTS[:4]))
    finally:
        process.terminate()
        process.wait(timeout=30)
