"""Cohere's /v2/embed (serve/cohere.py) against the library's own encode() and sentence-transformers'
quantize_embeddings on the same folder: in process through the app's guard, worker and errors, then on the real
server process with the official `cohere` client."""

import base64

import httpx
import numpy as np
import pytest
import torch
from builders import make_texts
from helpers import DEVICE, TOLERANCE, max_diff
from sentence_transformers import quantize_embeddings
from serving import HEADERS, KEY, app_client, metric, start_server

from st_fastbackend import SentenceTransformer

TEXTS = [t for t in make_texts(24, seed=9) if t and len(t.split()) < 120]  # none over the 256-token limit
LONG = " ".join(TEXTS)  # over 256 tokens
# "passage", not "document": search_document takes the first of document, passage, corpus (encode_document's order)
PROMPTS = {"query": "query: ", "passage": "passage: ", "clustering": "cluster: "}


@pytest.fixture(scope="module")
def folder(st_model):
    return st_model("bert", pooling_mode="mean", prompts=PROMPTS)


@pytest.fixture(scope="module")
def model(folder):
    return SentenceTransformer(str(folder), backend="fast", device=DEVICE)


@pytest.fixture(scope="module")
def client(folder):
    with app_client(folder) as client:
        yield client


def embed(client, **body) -> dict:
    reply = client.post("/v2/embed", json={"model": "tiny", **body}, headers=HEADERS)
    assert reply.status_code == 200, reply.text[:300]
    return reply.json()


@pytest.mark.parametrize(
    "input_type, encode",
    [
        ("search_query", lambda m, texts: m.encode_query(texts)),
        ("search_document", lambda m, texts: m.encode_document(texts)),
        ("clustering", lambda m, texts: m.encode(texts, prompt_name="clustering")),
        ("classification", lambda m, texts: m.encode(texts)),  # no prompt of that name: encode()'s default
        (None, lambda m, texts: m.encode(texts)),
    ],
)
def test_float_equals_encode_with_the_input_types_prompt(client, model, input_type, encode):
    reply = embed(client, texts=TEXTS, input_type=input_type)
    assert list(reply["embeddings"]) == ["float"] and reply["texts"] == TEXTS
    assert max_diff(reply["embeddings"]["float"], encode(model, TEXTS)) <= TOLERANCE


def test_meta_counts_the_input_tokens(client, model):
    reply = embed(client, texts=TEXTS[:5], input_type="search_query")
    tokens = sum(map(len, model[0].texts.encode(TEXTS[:5], "query: ")))
    assert reply["meta"] == {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}}
    assert reply["id"] and reply["response_type"] == "embeddings_by_type"


@pytest.mark.parametrize("output_dimension", [None, 16])
def test_every_embedding_type_is_quantize_embeddings_of_the_floats(client, model, output_dimension):
    kinds = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    got = embed(client, texts=TEXTS, input_type="search_document", embedding_types=kinds,
                output_dimension=output_dimension)["embeddings"]  # fmt: skip
    expected = model.encode_document(TEXTS, convert_to_tensor=True)
    if output_dimension:  # Matryoshka: the first values, unit length again as the model's output is
        expected = torch.nn.functional.normalize(expected[:, :output_dimension], dim=1)
    expected = expected.cpu().numpy()
    floats = np.array(got["float"], dtype=np.float32)
    assert floats.shape == expected.shape and max_diff(floats, expected) <= TOLERANCE
    for kind in ("binary", "ubinary"):  # a sign per value: exact against encode()'s
        np.testing.assert_array_equal(got[kind], quantize_embeddings(expected, kind))
    for kind in ("int8", "uint8"):
        # The ranges are the request's own (quantize_embeddings without `ranges`): exact on the floats served;
        # encode()'s floats differ from those by ~1e-8, which may move a value across a bucket's edge.
        np.testing.assert_array_equal(got[kind], quantize_embeddings(floats, kind))
        assert np.abs(np.array(got[kind], dtype=int) - quantize_embeddings(expected, kind).astype(int)).max() <= 1
    decoded = np.stack([np.frombuffer(base64.b64decode(b), dtype="<f4") for b in got["base64"]])
    np.testing.assert_array_equal(decoded, floats)


def test_truncate_end_start_and_none(client, model):
    end = embed(client, texts=[LONG])["embeddings"]["float"]  # END is the default
    assert max_diff(end, model.encode([LONG])) <= TOLERANCE
    start = embed(client, texts=[LONG], truncate="START")["embeddings"]["float"]
    model.tokenizer.truncation_side = "left"
    try:
        expected = model.encode([LONG])
    finally:
        model.tokenizer.truncation_side = "right"
    assert max_diff(start, expected) <= TOLERANCE and max_diff(start, end) > 0.01
    refused = client.post("/v2/embed", json={"texts": [LONG], "truncate": "NONE"}, headers=HEADERS)
    assert refused.status_code == 400 and "more than 256 tokens" in refused.json()["message"]


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"texts": []}, 400, "texts is empty"),
        ({}, 400, "texts is required"),
        ({"texts": ["a"] * 65}, 400, "65 inputs"),
        ({"texts": ["a"], "model": "other"}, 404, "does not exist"),
        ({"texts": ["a"], "input_type": "image"}, 400, "input_type 'image'"),
        ({"texts": ["a"], "embedding_types": ["float16"]}, 400, "embedding_types"),
        ({"texts": ["a"], "embedding_types": []}, 400, "embedding_types"),
        ({"texts": ["a"], "embedding_types": ["int8"]}, 400, "two texts or more"),
        ({"texts": ["a"], "output_dimension": 10**5}, 400, "output_dimension=100000 exceeds"),
        ({"texts": ["a"], "truncate": "MIDDLE"}, 400, "truncate"),
        ({"texts": ["a"], "max_tokens": 8}, 400, "max_tokens=8"),
        ({"images": ["data:image/png;base64,AAAA"]}, 400, "embeds text"),
        ({"texts": "a"}, 400, "texts"),
    ],
)
def test_errors_in_cohere_shape(client, body, status, fragment):
    reply = client.post("/v2/embed", json=body, headers=HEADERS)
    assert reply.status_code == status, reply.text[:300]
    error = reply.json()
    assert set(error) == {"id", "message"} and fragment in error["message"]


def test_auth_and_metrics(client):
    denied = client.post("/v2/embed", json={"texts": ["a"]})
    assert denied.status_code == 401 and set(denied.json()) == {"id", "message"}
    before = float(_sample(client, 'embedding_requests_total{endpoint="/v2/embed"}'))
    embed(client, texts=["a"])
    assert float(_sample(client, 'embedding_requests_total{endpoint="/v2/embed"}')) == before + 1


def _sample(client, name: str) -> str:
    lines = client.get("/metrics", headers=HEADERS).text.splitlines()
    return next(line.rsplit(" ", 1)[1] for line in lines if line.rsplit(" ", 1)[0] == name)


@pytest.mark.slow
def test_official_cohere_client_on_a_live_server(folder, model):
    cohere = pytest.importorskip("cohere", reason="the cohere package is not installed (pip install cohere)")
    process, url = start_server(folder, "--api-key", KEY)
    try:
        client = cohere.ClientV2(base_url=url, api_key=KEY, timeout=120)
        reply = client.embed(
            model="tiny", texts=TEXTS, input_type="search_query", embedding_types=["float", "ubinary"]
        )
        assert max_diff(reply.embeddings.float_, model.encode_query(TEXTS)) <= TOLERANCE
        expected_bits = quantize_embeddings(model.encode_query(TEXTS), "ubinary")
        np.testing.assert_array_equal(reply.embeddings.ubinary, expected_bits)
        assert reply.texts == TEXTS and reply.meta.billed_units.input_tokens > 0
        with pytest.raises(cohere.errors.BadRequestError) as refused:
            client.embed(model="tiny", texts=[LONG], input_type="search_query", truncate="NONE")
        assert "more than 256 tokens" in refused.value.body["message"]
        with pytest.raises(cohere.errors.NotFoundError):
            client.embed(model="other", texts=["a"], input_type="search_query")
        with pytest.raises(cohere.errors.UnauthorizedError):
            cohere.ClientV2(base_url=url, api_key="wrong").embed(model="tiny", texts=["a"], input_type="search_query")
        assert metric(url, 'embedding_requests_total{endpoint="/v2/embed"}', HEADERS) == 3  # not the one refused a key
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        process.terminate()
        process.wait(30)


def test_int8_of_a_dimension_every_text_shares():
    """A dimension of one value across the request (identical texts) quantizes to its lowest code, not NaN."""
    from st_fastbackend.serve.cohere import _typed

    vectors = np.array([[0.5, -0.2, 0.1], [0.5, 0.3, 0.4]], dtype=np.float32)
    for kind, lowest in (("int8", -128), ("uint8", 0)):
        codes = np.asarray(_typed(vectors, kind))
        assert (codes[:, 0] == lowest).all() and codes[0, 1] == lowest and codes[1, 1] >= lowest + 254  # its top
