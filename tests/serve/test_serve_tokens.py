"""What one request may cost the server's tokenizer: texts without whitespace and long prompts are bounded by
characters, and one request's tokenization never holds up another's. The real all-MiniLM-L6-v2 (WordPiece)
and the suite's small Mistral (Metaspace BPE), on loopback servers where the timing is what is tested."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from builders import train_tokenizer
from helpers import DEVICE, minilm_path
from serving import rss_bytes, start_server
from transformers import AutoTokenizer

from st_fastbackend import SentenceTransformer
from st_fastbackend.embedder import Embedder
from st_fastbackend.modules.tokenizer import clip_text, last_word_start
from st_fastbackend.serve.tokens import RequestTokenizer

# (text, whether WordPiece cuts it within 4,000 characters at 64 tokens): it splits at every punctuation mark
# and CJK ideograph; not in 200,000 x's, and 150 a's are one [UNK] (too few tokens in 4,000 characters).
WITHOUT_WHITESPACE = [("!" * 200_000, True), ("ab!" * 70_000, True), ("日本語のテキスト。" * 20_000, True),
                      ("https://example.com/a?b=c&d=" * 7_000, True), (("a" * 150 + "!") * 1_000, False),
                      ("x" * 200_000, False)]  # fmt: skip


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("text", "wordpiece_cuts"), WITHOUT_WHITESPACE, ids=[repr(t[:9]) for t, _ in WITHOUT_WHITESPACE]
)
@pytest.mark.parametrize("name", ["wordpiece", "metaspace"])
def test_clip_text_reads_a_bounded_prefix_of_a_text_without_whitespace(name, text, wordpiece_cuts):
    """No tokenizer call sees more than max_chars characters; what comes back truncates to the full text's
    tokens, or is None (then no cut is known within the bound)."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_path()) if name == "wordpiece" else train_tokenizer()
    limit, max_chars, seen = 64, 4_000, []

    def ids(value: str, max_length: int) -> list[int]:
        seen.append(len(value))
        return tokenizer(value, truncation=True, max_length=max_length)["input_ids"]

    def word_start(prefix: str) -> int:
        seen.append(len(prefix))
        return last_word_start(tokenizer, prefix)

    clipped = clip_text(text, limit, lambda p: len(ids(p, limit + 1)), max_chars=max_chars, word_start=word_start)
    assert max(seen) <= max_chars
    if clipped is not None:
        assert ids(clipped, limit) == tokenizer(text, truncation=True, max_length=limit)["input_ids"]
    assert (clipped is not None) == (name == "wordpiece" and wordpiece_cuts)  # Metaspace splits only at spaces


@pytest.fixture(scope="module")
def minilm():
    return SentenceTransformer(minilm_path(), backend="fast", device=DEVICE)


def post(url: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=timeout)


def during(url: str, body: dict) -> tuple[httpx.Response, float, httpx.Response]:
    """(the response to `body`, how long a one-word probe sent 0.3 s after it took, the probe's response)."""
    with ThreadPoolExecutor(1) as pool:
        attack = pool.submit(post, url, body)
        time.sleep(0.3)
        start = time.perf_counter()
        probe = post(url, {"input": "one word"})
        waited = time.perf_counter() - start
        return attack.result(), waited, probe


@pytest.mark.slow
@pytest.mark.real_model
def test_a_text_of_punctuation_without_whitespace_holds_up_no_one(minilm_server, minilm):
    """1.95 million '!' (as many WordPiece tokens): cut at 256 tokens after reading a few thousand characters,
    with encode()'s embedding; a probe meanwhile is answered in under 1 s and the server's memory barely grows."""
    process, url = minilm_server
    before = rss_bytes(process.pid)
    response, waited, probe = during(url, {"input": "!" * 1_950_000})
    grown = rss_bytes(process.pid) - before
    assert response.status_code == 200 and probe.status_code == 200
    assert waited < 1.0 and grown < 100 * 2**20
    assert response.json()["usage"]["prompt_tokens"] == 256
    shorter = post(url, {"input": "!" * 200_000}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(shorter, minilm.encode("!" * 200_000), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(response.json()["data"][0]["embedding"], shorter)


@pytest.mark.real_model
def test_a_long_prompt_is_refused_before_any_tokenizer_reads_it(minilm_server):
    process, url = minilm_server
    before = rss_bytes(process.pid)
    response, waited, probe = during(url, {"input": ["short text"] * 16, "prompt": "!" * 1_500_000})
    assert response.status_code == 400 and probe.status_code == 200 and waited < 1.0
    assert response.json()["error"]["message"] == (
        "The prompt has 1,500,000 characters; the limit is 18,432 "
        "(4 x --max-input-tokens 256 x 18, the vocabulary's longest token)."
    )
    assert rss_bytes(process.pid) - before < 100 * 2**20


@pytest.mark.slow
@pytest.mark.real_model
def test_a_prompt_that_fills_the_limit_embeds_as_encode_does(minilm_server, minilm):
    """A prompt of 9,000 '!' (within the bound) leaves no token to the inputs: tokenized once for all of them."""
    _, url = minilm_server
    inputs, prompt = ["first text", "second, longer text"] * 8, "!" * 9_000
    response = post(url, {"input": inputs, "prompt": prompt})
    assert response.status_code == 200
    got = np.array([d["embedding"] for d in response.json()["data"]])
    np.testing.assert_allclose(got, minilm.encode(inputs, prompt=prompt), atol=1e-5, rtol=0)
    refused = post(url, {"input": inputs, "prompt": prompt, "truncate": False})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "The prompt alone has more than 256 tokens and truncate is false."


@pytest.mark.slow
def test_a_text_no_cut_is_found_for_is_refused_naming_the_bound(served_folder):
    """The small Mistral's pre-tokenizer splits only at spaces: 1.95 million '!' are one word, which no prefix
    of the bound's 10,240 characters is known to tokenize as the whole does."""
    process, url = start_server(served_folder)
    try:
        response, waited, probe = during(url, {"input": ["fine", "!" * 1_950_000]})
    finally:
        process.terminate()
        process.wait(30)
    assert response.status_code == 400 and probe.status_code == 200 and waited < 1.0
    assert response.json()["error"]["message"] == (
        "Input 1 (1,950,000 characters) cannot be cut at 256 tokens within its first 10,240 characters: they "
        "hold too few tokens, or no word ends after 256 of them. The server reads at most 10,240 characters of "
        "an input (4 x --max-input-tokens 256 x 10, the vocabulary's longest token)."
    )


def test_one_request_tokenized_chunk_by_chunk_lets_another_through(served_folder):
    """The tokenizer thread takes a request's texts a chunk at a time: a one-text request sent after a big
    one is tokenized long before the big one is done."""
    embedder = Embedder(SentenceTransformer(str(served_folder), backend="fast", device=DEVICE))
    tokenizer = RequestTokenizer(embedder, 256)
    big = [" ".join(["word"] * 300) + f" {i}" for i in range(256)]  # 12 chunks

    async def race() -> tuple[bool, list[list[int]]]:
        first = asyncio.ensure_future(tokenizer(big, None, None, truncate=True))
        await asyncio.sleep(0)  # the big request's first chunk is queued
        await tokenizer(["one word"], None, None, truncate=True)
        return first.done(), await first

    big_done_first, ids = asyncio.run(race())
    tokenizer.close()
    assert not big_done_first
    assert ids == embedder.tokenize(big, None, 256)


@pytest.mark.slow
def test_the_prompt_cache_keeps_the_most_recently_used_within_its_count_and_bytes(served_folder, monkeypatch):
    """A server sees any number of distinct prompts: their tokens are kept for the 256 most recently used, in
    16 MiB at most; one dropped is measured again, to the same tokens."""
    from st_fastbackend.modules import tokenizer

    texts = SentenceTransformer(str(served_folder), backend="fast", device=DEVICE)[0].texts
    first = texts.prompt_ids("prompt 0: ")
    for i in range(1, 300):
        texts.prompt_ids(f"prompt {i}: ")
        texts.prompt_ids("prompt 1: ")  # used again each time: kept
    kept = list(texts._prompts)
    assert len(kept) == tokenizer.PROMPT_CACHE_ENTRIES and kept[-1] == "prompt 1: " and "prompt 0: " not in kept
    assert texts.prompt_ids("prompt 0: ") == first
    monkeypatch.setattr(tokenizer, "PROMPT_CACHE_BYTES", 2**20)
    for i in range(40):
        texts.prompt_ids(f"long prompt {i}: " + "word " * 10_000)  # 50 KB of text each, and its tokens
    kept = list(texts._prompts)
    assert texts._prompt_bytes <= 2**20 and len(kept) < 40 and kept[-1].startswith("long prompt 39: ")
    assert sum(tokenizer._size(p, ids) for p, ids in texts._prompts.items()) == texts._prompt_bytes
