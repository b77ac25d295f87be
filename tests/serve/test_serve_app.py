"""The real server process on a loopback port: OpenAI client for the happy paths, httpx for errors."""

import base64
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from helpers import DEVICE
from serving import KEY, metric, start_server

from st_fastbackend import SentenceTransformer
from st_fastbackend.engine.batch import Tokens

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(served_folder):
    process, url = start_server(
        served_folder, "--api-key", KEY, "--max-batch-size", "64"
    )  # inputs: max_seq_length 256
    yield url
    process.terminate()
    process.wait(30)


@pytest.fixture(scope="module")
def model(served_folder):
    return SentenceTransformer(str(served_folder), backend="fast", device=DEVICE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)


@pytest.mark.slow
def test_float_and_base64_single_and_batch(client, model, texts):
    batch = [t for t in texts if t][:10]
    for inputs in (batch[0], batch):
        response = client.embeddings.create(model="tiny", input=inputs)
        expected = model.encode([inputs] if isinstance(inputs, str) else inputs)
        got = np.array([d.embedding for d in response.data])
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
        assert [d.index for d in response.data] == list(range(len(expected)))
        tokens = sum(len(ids) for ids in model[0].texts.encode([inputs] if isinstance(inputs, str) else inputs))
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    raw = httpx.post(f"{client.base_url}embeddings", headers={"Authorization": f"Bearer {KEY}"},
                     json={"input": batch, "encoding_format": "base64"}).json()  # fmt: skip
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    np.testing.assert_allclose(decoded, model.encode(batch), atol=1e-5, rtol=0)
    via_client = client.embeddings.create(model="tiny", input=batch, encoding_format="base64")
    strings = [d.embedding for d in via_client.data]  # returned as sent when asked for explicitly
    np.testing.assert_array_equal([np.frombuffer(base64.b64decode(x), dtype="<f4") for x in strings], decoded)


def test_dimensions_and_token_ids_and_prompts(client, model, texts):
    text = texts[5]
    response = client.embeddings.create(model="tiny", input=text, dimensions=16)
    expected = torch.nn.functional.normalize(torch.from_numpy(model.encode(text))[:16], dim=0).numpy()
    np.testing.assert_allclose(response.data[0].embedding, expected, atol=1e-5, rtol=0)
    ids = model[0].texts.encode([text, texts[6]])
    response = client.embeddings.create(model="tiny", input=ids)
    with torch.inference_mode():
        expected = model.forward_sequences([Tokens(i) for i in ids])["sentence_embedding"].cpu().numpy()
    np.testing.assert_allclose(np.array([d.embedding for d in response.data]), expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        client.embeddings.create(model="tiny", input=ids[0]).data[0].embedding, expected[0], atol=1e-5
    )
    query = client.embeddings.create(model="tiny", input=text, extra_body={"prompt_name": "query"}).data[0].embedding
    np.testing.assert_allclose(query, model.encode(text, prompt_name="query"), atol=1e-5, rtol=0)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("embedding_requests_total", "embedding_errors_total", "embedding_batch_tokens",
                 "embedding_batch_texts", "embedding_queue_wait_seconds", "embedding_compute_seconds"):  # fmt: skip
        assert name in metrics


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ('{"input": ', 400, "not valid JSON"),
        ({"input": 3}, 400, "Invalid request"),
        ({"input": []}, 400, "empty"),
        ({"input": ""}, 400, "empty string"),
        ({"input": ["a"] * 65}, 400, "65 inputs"),
        ({"input": " ".join(["word"] * 400), "truncate": False}, 400, "more than 256 tokens"),
        ({"input": [[1, 10**9]]}, 400, "outside the vocabulary"),
        ({"input": "hello", "model": "other"}, 404, "does not exist"),
        ({"input": "hello", "dimensions": 100000}, 400, "exceeds"),
        ({"input": "hello", "prompt_name": "nope"}, 400, "nope"),
        ({"input": [[5, 6]], "prompt_name": "query"}, 400, "not to token ids"),  # issue 44 item 7
        ({"input": [[5, 6]], "prompt": ""}, 400, "not to token ids"),  # an empty prompt was let through
    ],
    ids=str,
)
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    response = httpx.post(f"{server}/v1/embeddings", headers=headers, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"]
    if status == 404:
        assert error["code"] == "model_not_found"


def test_errors_outside_embeddings_have_openai_shape_and_health_takes_head(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    unknown = httpx.get(f"{server}/v1/nothing", headers=headers)
    assert unknown.status_code == 404 and "Invalid URL (GET /v1/nothing)" in unknown.json()["error"]["message"]
    wrong_method = httpx.get(f"{server}/v1/embeddings", headers=headers)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    head = httpx.head(f"{server}/health")
    assert head.status_code == 200 and head.content == b""


def test_unknown_request_fields_are_ignored(server, model):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"input": "hello there", "service_tier": "auto", "extra": {"a": 1}}
    response = httpx.post(f"{server}/v1/embeddings", json=body, headers=headers)
    assert response.status_code == 200
    np.testing.assert_allclose(response.json()["data"][0]["embedding"], model.encode("hello there"), atol=1e-5)


def test_long_input_is_truncated_by_default_as_encode_does(client, model):
    long = " ".join(["word"] * 400)
    response = client.embeddings.create(model="tiny", input=long)
    assert response.usage.prompt_tokens == model.max_seq_length == 256
    np.testing.assert_allclose(response.data[0].embedding, model.encode(long), atol=1e-5, rtol=0)


def test_auth_and_body_limit(server):
    assert httpx.post(f"{server}/v1/embeddings", json={"input": "x"}).status_code == 401
    wrong = httpx.post(f"{server}/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer no"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    huge = httpx.post(f"{server}/v1/embeddings", content=b"x" * (9 * 2**20),
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})  # fmt: skip
    assert huge.status_code == 413


@pytest.mark.slow
def test_concurrent_clients_get_their_own_embeddings(server, model, texts):
    """32 threads x 25 requests of mixed lengths, bad requests among them; nothing lost, nothing mixed up."""
    pool = [t for t in texts if t]
    headers = {"Authorization": f"Bearer {KEY}"}
    expected = {t: e for t, e in zip(pool, model.encode(pool), strict=True)}

    def client_thread(seed: int) -> int:
        rng = np.random.default_rng(seed)
        checked = 0
        with httpx.Client(timeout=120) as http:
            for _ in range(25):
                if rng.random() < 0.1:  # rejected by the worker, inside a batch: it must fail alone
                    bad = {"input": [[1, 10**9]]}
                    assert http.post(f"{server}/v1/embeddings", json=bad, headers=headers).status_code == 400
                    continue
                chosen = [pool[i] for i in rng.choice(len(pool), size=int(rng.integers(1, 4)))]
                data = http.post(f"{server}/v1/embeddings", json={"input": chosen}, headers=headers).json()["data"]
                for text, item in zip(chosen, data, strict=True):
                    np.testing.assert_allclose(item["embedding"], expected[text], atol=1e-5, rtol=0)
                    checked += 1
        return checked

    with ThreadPoolExecutor(32) as executor:
        assert sum(executor.map(client_thread, range(32))) > 0
    metrics = httpx.get(f"{server}/metrics", headers=headers).text
    batch_counts = [line for line in metrics.splitlines() if line.startswith("embedding_batch_texts_count")]
    assert batch_counts


@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests(served_folder, texts):
    process, url = start_server(served_folder, "--max-batch-size", "1000", "--max-request-tokens", "1000000")
    many = [t for t in texts if t] * 20
    with ThreadPoolExecutor(4) as executor:
        futures = [
            executor.submit(httpx.post, f"{url}/v1/embeddings", json={"input": many}, timeout=120) for _ in range(4)
        ]
        deadline = time.time() + 60  # all four read by the server (on a loaded machine this takes a while)
        while metric(url, 'embedding_requests_total{endpoint="/v1/embeddings"}') < 4 and time.time() < deadline:
            time.sleep(0.05)
        assert not all(f.done() for f in futures)  # still in flight when the signal arrives
        process.send_signal(signal.SIGTERM)
        responses = [f.result() for f in futures]
    assert all(r.status_code == 200 and len(r.json()["data"]) == len(many) for r in responses)
    assert process.wait(60) == 0
