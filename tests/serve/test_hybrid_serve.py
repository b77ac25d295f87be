"""A SparseEncoder's /embed_sparse and a MultiVectorEncoder's /embed_all against the library's own encode() on the
same folder, in process through the app's guard, worker and errors; the dense routes name the right one; and the
CLI serving such a folder on a real port."""

import httpx
import pytest
from builders import make_texts
from fastapi.testclient import TestClient
from helpers import DEVICE, TOLERANCE, max_diff
from hybrid_builders import build_colbert, build_splade
from serving import HEADERS, KEY, start_server

from st_fastbackend import MultiVectorEncoder, SparseEncoder
from st_fastbackend.serve.app import create_app

TEXTS = [t for t in make_texts(24, seed=7) if t and len(t.split()) < 120]


@pytest.fixture(scope="module")
def splade_folder(tmp_path_factory):
    return build_splade(tmp_path_factory.mktemp("splade"), "bert", prompts={"query": "query: "})


@pytest.fixture(scope="module")
def colbert_folder(tmp_path_factory):
    return build_colbert(tmp_path_factory.mktemp("colbert"), "bert")


def client_for(model):
    """The app as `st-fastbackend serve` makes it: inputs up to the model's max_seq_length."""
    app = create_app(model, "tiny", max_tokens_per_batch=4096, max_batch_size=64,
                     max_input_tokens=model.max_seq_length, api_key=KEY)  # fmt: skip
    return TestClient(app)


def post(client, path: str, body, status: int = 200):
    reply = client.post(path, json=body, headers=HEADERS)
    assert reply.status_code == status, reply.text
    return reply.json()


def test_embed_sparse_equals_encode(splade_folder):
    model = SparseEncoder(str(splade_folder), backend="fast", device=DEVICE)
    with client_for(SparseEncoder(str(splade_folder), backend="fast", device=DEVICE)) as client:
        for extra, kwargs in [({}, {}), ({"prompt_name": "query"}, {"prompt_name": "query"})]:
            got = post(client, "/embed_sparse", {"inputs": TEXTS, "truncate": True, **extra})
            expected = model.encode(TEXTS, convert_to_tensor=True, convert_to_sparse_tensor=False, **kwargs)
            for row, values in zip(expected, got, strict=True):
                active = row.nonzero().squeeze(1).tolist()
                assert [v["index"] for v in values] == active
                assert max_diff([v["value"] for v in values], row[active]) <= TOLERANCE
        for path in ("/v1/embeddings", "/embed", "/embed_all"):
            body = {"input": TEXTS[:2]} if path == "/v1/embeddings" else {"inputs": TEXTS[:2]}
            reply = client.post(path, json=body, headers=HEADERS)
            assert reply.status_code in (400, 422) and "/embed_sparse" in reply.text, (path, reply.text)
        assert client.post("/embed_sparse", json={"inputs": TEXTS[:1]}).status_code == 401  # the same guard


def test_embed_all_gives_multi_vectors(colbert_folder):
    model = MultiVectorEncoder(str(colbert_folder), backend="fast", device=DEVICE)
    with client_for(MultiVectorEncoder(str(colbert_folder), backend="fast", device=DEVICE)) as client:
        got = post(client, "/embed_all", {"inputs": TEXTS, "truncate": True})
        expected = model.encode_document(TEXTS)
        for vectors, values in zip(expected, got, strict=True):
            assert (len(values), len(values[0])) == tuple(vectors.shape)
            assert max_diff(values, vectors) <= TOLERANCE
        reply = client.post("/v1/embeddings", json={"input": TEXTS[:2]}, headers=HEADERS)
        assert reply.status_code == 400 and "/embed_all" in reply.text


@pytest.mark.slow
def test_cli_serves_a_sparse_folder(splade_folder):
    model = SparseEncoder(str(splade_folder), backend="fast", device=DEVICE)
    process, url = start_server(splade_folder, "--api-key", KEY)
    try:
        reply = httpx.post(f"{url}/embed_sparse", json={"inputs": TEXTS[:4]}, headers=HEADERS, timeout=60)
        assert reply.status_code == 200, reply.text
        expected = model.encode(TEXTS[:4], convert_to_tensor=True, convert_to_sparse_tensor=False)
        for row, values in zip(expected, reply.json(), strict=True):
            assert [v["index"] for v in values] == row.nonzero().squeeze(1).tolist()
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.slow
def test_served_as_encode_document(tmp_path):
    """A SparseEncoder's max_active_dims and a MultiVectorEncoder's document_length and document prompt hold on
    the server, as encode_document gives them."""
    prompts = {"query": "query:", "document": "passage:"}
    splade = build_splade(tmp_path / "splade", "bert", prompts=prompts)
    model = SparseEncoder(str(splade), backend="fast", device=DEVICE, max_active_dims=5)
    with client_for(SparseEncoder(str(splade), backend="fast", device=DEVICE, max_active_dims=5)) as client:
        got = post(client, "/embed_sparse", {"inputs": TEXTS[:6], "truncate": True})
        expected = model.encode_document(TEXTS[:6], convert_to_tensor=True, convert_to_sparse_tensor=False)
        for row, values in zip(expected, got, strict=True):
            assert len(values) == 5 and [v["index"] for v in values] == row.nonzero().squeeze(1).tolist()
            assert max_diff([v["value"] for v in values], row[row != 0]) <= TOLERANCE
    colbert = build_colbert(tmp_path / "colbert", "bert", document_length=16, prompts=prompts)
    model = MultiVectorEncoder(str(colbert), backend="fast", device=DEVICE)
    with client_for(MultiVectorEncoder(str(colbert), backend="fast", device=DEVICE)) as client:
        got = post(client, "/embed_all", {"inputs": TEXTS[:6], "truncate": True})
        expected = model.encode_document(TEXTS[:6])
        assert max(len(vectors) for vectors in expected) == 16
        for vectors, values in zip(expected, got, strict=True):
            assert (len(values), len(values[0])) == tuple(vectors.shape) and max_diff(values, vectors) <= TOLERANCE
