"""The bound on one request's model work (issue 44 item 3): chunks' and late-chunking windows' tokens counted against
--max-request-tokens (by default 32 full-length inputs on a CPU, --max-batch-size's on a GPU), a 413 naming it as
soon as the tokens read pass it; a chunked text read a piece at a time on the server gives encode_chunks' chunks;
and on a real server the trial's 2M-character text with "chunking": {"tokens": 128} refused within seconds while a
probe waits no longer than alone."""

import argparse
import random

import httpx
import pytest
from builders import WORDS
from helpers import DEVICE, TOLERANCE, max_diff
from serving import HEADERS, app_client, assert_fair, probed, rss_bytes, rss_grown

from st_fastbackend import Chunking, SentenceTransformer
from st_fastbackend.cli.serve import add_serve
from st_fastbackend.serve import chunked, tokens
from st_fastbackend.serve.limits import Limits, default_request_tokens

LONG = " ".join(f"word{i} is here, and so is its neighbour number {i * 7}." for i in range(60))


@pytest.fixture(scope="module")
def folder(st_model):
    return st_model("bert", pooling_mode="mean", prompts={"query": "query:"})


def post(client, body: dict):
    return client.post("/v1/embeddings", json=body, headers=HEADERS)


def test_chunks_past_the_request_tokens_are_a_413_naming_the_bound(folder):
    """Chunks, late-chunking windows and plain inputs alike; within the bound the same request is answered."""
    texts = [LONG, LONG[:500]]
    with app_client(folder, limits=Limits(max_request_tokens=400)) as client:
        for chunking in ({"tokens": 16, "overlap": 8}, {"tokens": 16, "late": True}):
            refused = post(client, {"input": texts, "chunking": chunking})
            assert refused.status_code == 413, refused.text
            message = refused.json()["error"]["message"]
            assert "tokens of chunks in one request; the limit is 400 (--max-request-tokens)" in message
            assert post(client, {"input": ["a short text", LONG[:120]], "chunking": chunking}).status_code == 200
        plain = post(client, {"input": [LONG[:100]] * 8})
        assert plain.status_code == 413 and "the limit is 400 (--max-request-tokens)" in plain.text


def test_the_default_bound_is_32_full_length_inputs_on_a_cpu_and_the_batch_size_on_a_gpu(folder):
    assert default_request_tokens("cpu", 256, 512) == 32 * 512
    assert default_request_tokens("cpu", 4, 512) == 4 * 512
    assert default_request_tokens("cuda", 256, 512) == 256 * 512
    with app_client(folder, max_batch_size=64, max_input_tokens=16) as client:  # app_client serves on the CPU
        refused = post(client, {"input": [LONG * 2], "chunking": {"tokens": 32}})
        assert refused.status_code == 413 and "the limit is 512 (--max-request-tokens)" in refused.text
        assert post(client, {"input": [LONG[:400]], "chunking": {"tokens": 8}}).status_code == 200
    with app_client(folder, max_batch_size=4, max_input_tokens=64) as client:
        refused = post(client, {"input": [LONG * 2], "chunking": {"tokens": 32}})
        assert refused.status_code == 413 and "the limit is 256 (--max-request-tokens)" in refused.text
        assert post(client, {"input": [LONG[:150]], "chunking": {"tokens": 32}}).status_code == 200


def test_the_option_and_its_default_are_in_the_help():
    parser = argparse.ArgumentParser()
    add_serve(parser)
    help_text = " ".join(parser.format_help().split())
    assert "--max-request-tokens MAX_REQUEST_TOKENS tokens of model work one request may hold" in help_text
    assert "Default on a CPU: 32 full- length inputs" in help_text
    assert "on a GPU: --max-batch-size x --max-input-tokens" in help_text


def test_a_text_read_in_many_pieces_gives_encode_chunks(folder, monkeypatch):
    """Pieces of 64 characters, tasks of 64: each text is read in dozens of tasks, and its chunks and their spans are
    still encode_chunks'; a word past the characters the server reads is a 400 naming the bound."""
    monkeypatch.setattr(tokens, "CHUNK_CHARS", 64)
    monkeypatch.setattr(chunked, "CHUNK_CHARS", 64)
    model = SentenceTransformer(str(folder), backend="fast", device="cpu")
    texts, chunking = [LONG, "short text", LONG[:900]], {"tokens": 24, "overlap": 4, "aggregate": None}
    with app_client(folder) as client:
        for prompt in (None, "query"):
            each = post(client, {"input": texts, "chunking": chunking, "prompt_name": prompt})
            assert each.status_code == 200, each.text
            expected = model.encode_chunks(texts, Chunking(**chunking), prompt_name=prompt)
            for item, chunks in zip(each.json()["data"], expected, strict=True):
                assert [c["text_span"] for c in item["chunks"]] == [list(span) for span in chunks.char_spans]
                assert max_diff([c["embedding"] for c in item["chunks"]], chunks.embeddings) <= TOLERANCE
        word = post(client, {"input": ["start " + "x" * 40_000], "chunking": chunking})
        assert word.status_code == 400 and "a word (as the tokenizer splits words) of over" in word.text
        assert "the most a word may hold: 4 x --max-input-tokens 256 x" in word.text


@pytest.mark.slow
@pytest.mark.real_model
def test_two_million_characters_to_chunk_hold_up_no_one(minilm_server):
    """The trial: no answer within 240 s, a probe at 2 s median, 6 s at most. The text is read a task of 32,768
    characters at a time and refused once its chunks pass the default bound (8,192 tokens on a CPU)."""
    process, url = minilm_server
    text = " ".join(random.Random(3).choices(WORDS, k=400_000))[:1_990_000]
    body = {"input": [text], "chunking": {"tokens": 128}}
    send = lambda: httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)  # noqa: E731
    probe = lambda: httpx.post(f"{url}/v1/embeddings", json={"input": ["a short probe"]}, timeout=60)  # noqa: E731
    before = rss_bytes(process.pid)
    response, seconds, alone, during = probed(send, probe)
    assert response.status_code == 413 and seconds < 5.0, (response.text, seconds)
    bound = default_request_tokens(DEVICE, 256, 256)
    assert f"the limit is {bound:,} (--max-request-tokens)" in response.json()["error"]["message"]
    assert_fair(alone, during)
    assert rss_grown(process.pid, before) < 50 * 2**20
