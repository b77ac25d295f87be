"""text-embeddings-inference's routes (serve/tei.py) against the library's own encode() on the same folder: in process
through the app's guard, worker and errors, then on the real server process with httpx and huggingface_hub's
InferenceClient."""

import httpx
import huggingface_hub
import numpy as np
import pytest
import torch
from builders import make_texts
from helpers import DEVICE, TOLERANCE, max_diff
from huggingface_hub import InferenceClient
from serving import HEADERS, KEY, app_client, metric, start_server

import st_fastbackend
from st_fastbackend import SentenceTransformer
from st_fastbackend.embedder import Embedder
from st_fastbackend.engine.batch import Tokens
from st_fastbackend.serve import tei
from st_fastbackend.serve.batcher import Batcher, Job
from st_fastbackend.serve.metrics import Metrics
from st_fastbackend.serve.tokens import max_text_chars

TEXTS = [t for t in make_texts(24, seed=7) if t and len(t.split()) < 120]  # none over the 256-token limit
LONG = " ".join(make_texts(200, seed=8))  # 22,188 characters: over the limit, and over what the server reads


@pytest.fixture(scope="module")
def model(served_folder):
    """The library's own encode(), on a model of its own (a test may change its tokenizer's settings)."""
    return SentenceTransformer(str(served_folder), backend="fast", device=DEVICE)


@pytest.fixture(scope="module")
def client(served_folder):
    with app_client(served_folder) as client:
        yield client


def post(client, path: str, body) -> list | dict:
    reply = client.post(path, json=body, headers=HEADERS)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_embed_equals_encode(client, model):
    expected = model.encode(TEXTS, normalize_embeddings=True)
    for path in ("/embed", "/", "/invocations"):  # TEI answers an embedding model's root and SageMaker's path too
        assert max_diff(post(client, path, {"inputs": TEXTS}), expected) <= TOLERANCE
    one = post(client, "/embed", {"inputs": TEXTS[3], "normalize": False})
    assert len(one) == 1 and max_diff(one[0], model.encode(TEXTS[3])) <= TOLERANCE
    query = post(client, "/embed", {"inputs": TEXTS, "prompt_name": "query"})
    assert max_diff(query, model.encode(TEXTS, prompt_name="query", normalize_embeddings=True)) <= TOLERANCE
    ids = model[0].texts.encode(TEXTS[:4])
    with torch.inference_mode():
        expected = model.forward_sequences([Tokens(i) for i in ids])["sentence_embedding"]
    assert max_diff(post(client, "/embed", {"inputs": ids}), expected) <= TOLERANCE


@pytest.mark.parametrize("normalize", [True, False])
def test_embed_dimensions_cut_then_normalize_as_truncate_dim(client, model, normalize):
    got = np.array(post(client, "/embed", {"inputs": TEXTS, "dimensions": 16, "normalize": normalize}))
    expected = model.encode(TEXTS, truncate_dim=16, normalize_embeddings=normalize)
    assert got.shape == (len(TEXTS), 16) and max_diff(got, expected) <= TOLERANCE
    assert np.allclose(np.linalg.norm(got, axis=1), 1) == normalize  # the model's Normalize ran before the cut


@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_embed_all_equals_token_embeddings(client, model, prompt_name):
    got = post(client, "/embed_all", {"inputs": TEXTS[:6], "prompt_name": prompt_name})
    expected = model.encode(TEXTS[:6], output_value="token_embeddings", prompt_name=prompt_name)
    assert [np.array(g).shape for g in got] == [tuple(e.shape) for e in expected]
    assert max(max_diff(g, e) for g, e in zip(got, expected, strict=True)) <= TOLERANCE


def test_over_long_input_is_an_error_unless_truncated(client, model):
    reply = client.post("/embed", json={"inputs": ["short", LONG]}, headers=HEADERS)
    assert reply.status_code == 422
    message = "Input 1 has more than 256 tokens and truncate is false."
    assert reply.json() == {"error": message, "error_type": "Validation"}
    right = post(client, "/embed", {"inputs": LONG, "truncate": True})
    assert max_diff(right[0], model.encode(LONG, normalize_embeddings=True)) <= TOLERANCE
    ids = model[0].texts.encode([LONG], max_length=300)[0]  # token ids: the last 256 kept as given
    with torch.inference_mode():
        expected = torch.nn.functional.normalize(
            model.forward_sequences([Tokens(ids[-256:])])["sentence_embedding"], dim=1
        )
    assert (
        max_diff(post(client, "/embed", {"inputs": ids, "truncate": True, "truncation_direction": "Left"}), expected)
        <= TOLERANCE
    )


def test_left_truncation_keeps_the_end_as_truncation_side_left(client, model):
    text = " ".join(TEXTS)  # over 256 tokens, within what the server reads whole
    assert len(model[0].texts.encode([text], max_length=10**6)[0]) > 256
    got = post(client, "/embed", {"inputs": [text], "truncate": True, "truncation_direction": "Left"})
    model.tokenizer.truncation_side = "left"
    try:
        expected = model.encode(text, normalize_embeddings=True)
    finally:
        model.tokenizer.truncation_side = "right"
    assert max_diff(got[0], expected) <= TOLERANCE
    assert max_diff(got[0], model.encode(text, normalize_embeddings=True)) > 0.01  # not the start's embedding


@pytest.mark.parametrize("text", [" ".join(TEXTS), LONG, LONG.lstrip()], ids=["read whole", "its end read", "merged"])
def test_left_truncation_keeps_the_prompt_and_special_tokens(client, model, text):
    """<s> and the prompt's tokens stay, as the whole text has them ("query: "'s last merges with a text that begins
    with a word), then the whole tokenization's last tokens; for a text longer than the server reads
    (max_text_chars), too."""
    assert (len(text) > max_text_chars(model.tokenizer, 256)) == (len(text) > len(LONG) - 2)
    whole = model[0].texts.whole("query: " + text).ids
    prompt = model[0].texts.prompt_ids("query: ")
    kept = next((i for i, (a, b) in enumerate(zip(whole, prompt, strict=False)) if a != b), len(prompt))
    assert whole[0] == 1 and kept == len(prompt) - (not text.startswith(" "))
    with torch.inference_mode():
        expected = model.forward_sequences([Tokens(whole[:kept] + whole[kept - 256 :])], "query: ")[
            "sentence_embedding"
        ]
    body = {"inputs": text, "truncate": True, "truncation_direction": "left", "prompt_name": "query"}
    assert max_diff(post(client, "/embed", body), torch.nn.functional.normalize(expected, dim=1)) <= TOLERANCE


def test_tokenize_gives_encode_ids_with_byte_offsets(client, model):
    text = "héllo wörld " + TEXTS[5]
    tokens = post(client, "/tokenize", {"inputs": [text, TEXTS[6]], "prompt_name": "query"})
    assert [[t["id"] for t in seq] for seq in tokens] == model[0].texts.encode([text, TEXTS[6]], "query: ")
    full = ("query: " + text).encode()
    first = tokens[0]
    assert first[0] == {"id": 1, "text": "<s>", "special": True, "start": None, "stop": None}
    for token in first[1:]:
        assert not token["special"] and full[token["start"] : token["stop"]].decode() == token["text"]
    assert first[-1]["stop"] == len(full)  # bytes: "é" and "ö" are two each
    bare = post(client, "/tokenize", {"inputs": text, "add_special_tokens": False})
    assert [t["id"] for t in bare[0]] == model.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_decode(client, model):
    ids = model[0].texts.encode(TEXTS[:3])
    assert post(client, "/decode", {"ids": ids[0]}) == [model.tokenizer.decode(ids[0], skip_special_tokens=True)]
    both = post(client, "/decode", {"ids": ids, "skip_special_tokens": False})
    assert both == model.tokenizer.batch_decode(ids) and both[0].startswith("<s>")


def test_info_says_what_runs(client, model):
    info = client.get("/info", headers=HEADERS).json()
    assert info["model_id"] == info["served_model_name"] == "tiny"
    assert info["model_dtype"] == "float32" and info["model_type"] == {"embedding": {"pooling": "lasttoken"}}
    assert (info["max_input_length"], info["max_batch_tokens"], info["max_client_batch_size"]) == (256, 4096, 64)
    assert info["version"] == st_fastbackend.__version__ and info["auto_truncate"] is False
    assert info["backend"]["attention_kernel"] == model[0].attention_kernel
    assert info["backend"]["runtime"] == str(model[0].runtime)


@pytest.mark.parametrize(
    "path, body, status, error_type, fragment",
    [
        ("/embed", {"inputs": []}, 400, "Empty", "inputs is empty"),
        ("/", {"inputs": []}, 400, "Empty", "inputs is empty"),
        ("/embed", {"inputs": ["a"] * 65}, 413, "Validation", "65 inputs"),
        ("/embed", {"inputs": 3}, 422, "Validation", "Invalid request"),
        ("/embed", '{"inputs": ', 400, "Validation", "not valid JSON"),
        ("/embed", {"inputs": "a", "prompt_name": "nope"}, 422, "Validation", "nope"),
        ("/embed", {"inputs": "a", "dimensions": 10**5}, 422, "Validation", "exceeds"),
        ("/embed", {"inputs": "a", "truncation_direction": "Middle"}, 422, "Validation", "truncation_direction"),
        ("/embed", {"inputs": [[1, 10**9]]}, 422, "Validation", "outside the vocabulary"),
        # token ids with a prompt (issue 44 item 7: the README says refused; /embed took them; TEI has no `prompt`)
        ("/embed", {"inputs": [[5, 6]], "prompt_name": "query"}, 422, "Validation", "not to token ids"),
        ("/embed_all", {"inputs": [[5, 6]], "prompt_name": "query"}, 422, "Validation", "not to token ids"),
        ("/embed_all", {"inputs": [LONG]}, 422, "Validation", "more than 256 tokens"),
        ("/tokenize", {"inputs": []}, 400, "Empty", "inputs is empty"),
        ("/tokenize", {"inputs": ["a"] * 65}, 413, "Validation", "65 inputs"),
        ("/tokenize", {"inputs": LONG}, 422, "Validation", "characters; the limit is"),
        ("/decode", {"ids": []}, 400, "Empty", "ids is empty"),
        ("/decode", {"ids": [[1, 10**9]]}, 422, "Validation", "outside the vocabulary"),
    ],
)
def test_errors_in_tei_shape(client, path, body, status, error_type, fragment):
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    reply = client.post(path, headers={**HEADERS, "Content-Type": "application/json"}, **kwargs)
    assert reply.status_code == status, reply.text[:300]
    error = reply.json()
    assert set(error) == {"error", "error_type"} and error["error_type"] == error_type and fragment in error["error"]


@pytest.mark.parametrize("path", ["/tokenize", "/embed"])
def test_a_form_body_is_told_to_send_json(client, path):
    """curl -d without -H 'Content-Type: application/json' sends a form (issue 47): the error names the header."""
    form = {**HEADERS, "Content-Type": "application/x-www-form-urlencoded"}
    reply = client.post(path, content='{"inputs": "a"}', headers=form)
    assert reply.status_code == 422, reply.text
    assert "Content-Type: application/json (not application/x-www-form-urlencoded)" in reply.json()["error"]


def test_embed_all_bounds_the_values_it_returns(client, monkeypatch):
    monkeypatch.setattr(tei, "MAX_TOKEN_VALUES", 64 * 100)  # hidden size 64: 100 tokens per request at most
    reply = client.post("/embed_all", json={"inputs": [" ".join(TEXTS)], "truncate": True}, headers=HEADERS)
    assert reply.status_code == 413 and "the limit for token_embeddings is 100" in reply.json()["error"]


def test_auth_and_metrics_per_endpoint(client):
    for path in ("/embed", "/embed_all", "/tokenize", "/decode"):
        reply = client.post(path, json={"inputs": "a", "ids": [1]})
        assert reply.status_code == 401 and reply.json()["error_type"] == "Validation"
        assert client.post(path, json={"inputs": "a", "ids": [1]}, headers=HEADERS).status_code == 200
    assert client.get("/info").status_code == 401
    exposition = client.get("/metrics", headers=HEADERS).text
    for path in ("/embed", "/embed_all", "/tokenize", "/decode"):
        assert f'embedding_requests_total{{endpoint="{path}"}}' in exposition
    assert client.get("/v1/nothing", headers=HEADERS).json()["error"]["message"]  # OpenAI's shape elsewhere


@pytest.mark.slow
def test_live_server(served_folder, model, monkeypatch):
    process, url = start_server(served_folder, "--api-key", KEY, "--max-batch-size", "32")
    try:
        with httpx.Client(base_url=url, headers=HEADERS, timeout=120) as http:
            got = http.post("/embed", json={"inputs": TEXTS}).json()
            assert max_diff(got, model.encode(TEXTS, normalize_embeddings=True)) <= TOLERANCE
            tokens = http.post("/embed_all", json={"inputs": TEXTS[0]}).json()
            assert max_diff(tokens[0], model.encode(TEXTS[0], output_value="token_embeddings")) <= TOLERANCE
            assert http.get("/info").json()["max_client_batch_size"] == 32
            too_many = http.post("/embed", json={"inputs": ["a"] * 33})
            assert too_many.status_code == 413 and too_many.json()["error_type"] == "Validation"
            assert httpx.post(f"{url}/embed", json={"inputs": "a"}).status_code == 401
        # huggingface_hub's client for a TEI URL posts to its root; it refuses every request in the suite's offline
        # mode, which is for the Hub (this one stays on the loopback)
        hub = InferenceClient(model=url, token=KEY)
        with monkeypatch.context() as patch:
            patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
            query = hub.feature_extraction(TEXTS[1], prompt_name="query", truncate=True)
        assert max_diff(query, model.encode([TEXTS[1]], prompt_name="query", normalize_embeddings=True)) <= TOLERANCE
        assert metric(url, 'embedding_requests_total{endpoint="/embed"}', HEADERS) == 3
    finally:
        process.terminate()
        process.wait(30)


def test_one_pack_serves_sentence_and_token_embeddings(model):
    """Jobs asking for different outputs share a pack (the forward pass is the same); each gets its own rows."""
    metrics = Metrics()
    batcher = Batcher(Embedder(model), max_tokens_per_batch=4096, max_batch_size=64, metrics=metrics)
    ids = model[0].texts.encode(TEXTS[:6])
    jobs = [Job(ids[:3], None), Job(ids[3:], None, output="token_embeddings")]
    for job in jobs:  # both waiting when the worker starts: taken together, run in one pack
        batcher.submit(job)
    batcher.start()
    try:
        sentence, tokens = (job.future.result(120) for job in jobs)
    finally:
        batcher.stop()
    assert metrics.registry.get_sample_value("embedding_batch_texts_count") == 1
    assert max_diff([row for row, _ in sentence], model.encode(TEXTS[:3])) <= TOLERANCE
    expected = model.encode(TEXTS[3:6], output_value="token_embeddings")
    assert [n for _, n in tokens] == [len(e) for e in expected]
    assert max(max_diff(row, e) for (row, _), e in zip(tokens, expected, strict=True)) <= TOLERANCE
