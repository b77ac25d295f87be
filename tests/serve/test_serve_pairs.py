"""Rerank pairs read only as far as predict's cut needs (serve/pairs.py): the ids encode_pairs gives the whole texts,
for every pair template and a chat template, with no tokenizer call past the bound; the scores plain predict gives;
and on a real server the trial's hostile requests (a 1.99M-character query without whitespace, 64 documents
of 120,000 characters) answered within seconds while a one-pair probe waits no longer than it does alone."""

import random
import shutil

import httpx
import numpy as np
import pytest
import sentence_transformers
import torch
from builders import build_cross_encoder, make_texts
from fastapi.testclient import TestClient
from helpers import DEVICE, minilm_path
from serving import HEADERS, KEY, assert_fair, probed, rss_bytes, rss_grown, start_server

from st_fastbackend import CrossEncoder
from st_fastbackend.serve.app import create_app
from st_fastbackend.serve.pairs import PairReader
from st_fastbackend.serve.tokens import InputError

IDENTITY = torch.nn.Identity()
WORDS = " ".join(make_texts(200, seed=5)).split()
# Qwen3-Reranker's shape in small: the pair rendered as query/document messages, then the assistant's turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>yes or no:{% endif %}"
)
FAMILIES = {  # max_length 40: the budget longest_first shares out is odd for bert and qwen2, even for xlm-roberta
    "bert": ("bert", {}),
    "xlm-roberta": ("xlm-roberta", {"max_position_embeddings": 516}),
    "qwen2 score": ("qwen2", {}),
    "qwen3 causal LM, chat template": ("qwen3", {"causal_lm": True}),
}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def build(case: str):
        if case not in cache:
            family, options = FAMILIES[case]
            folder = build_cross_encoder(tmp_path_factory.mktemp("pairs") / family, family, **options)
            if "chat" in case:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(folder)
                tokenizer.chat_template = CHAT_TEMPLATE
                tokenizer.save_pretrained(folder)
            cache[case] = folder
        return cache[case]

    return build


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILIES)
def test_pairs_read_as_far_as_the_cut_needs_are_encode_pairs(built, case):
    """Every length against every length: short, at the budget, over it, over the characters the server reads (1,600
    at max_length 40: 4 x 40 x the 10-character longest token), equal lengths (the odd token's tie). Two texts over
    the bound that longest_first must compare (an odd budget) are refused naming it; nothing else is."""
    model = CrossEncoder(str(built(case)), backend="fast", device=DEVICE, max_length=40)
    reader, rng = PairReader(model[0]), random.Random(2)
    seen = []
    own_ids, encode_pairs = reader.texts.own_ids, reader.scoring.encode_pairs
    reader.texts.own_ids = lambda text, *a: seen.append(len(text)) or own_ids(text, *a)
    reader.scoring.encode_pairs = lambda pairs, *a: (
        seen.extend(len(t) for p in pairs for t in p) or encode_pairs(pairs, *a)
    )
    texts = [words(rng, n) for n in (1, 3, 8, 18, 19, 20, 21, 30, 60, 400, 450)]
    refused = 0
    for query in texts:
        expected = encode_pairs([(query, text) for text in texts], None)  # whole, not through the spy
        for index, text in enumerate(texts):
            try:
                got = reader.pairs(reader.read(query, "The query"), [text], index, "texts", True)[0]
            except InputError as error:
                assert min(len(query), len(text)) > reader.max_chars and reader.scoring.pair_budget % 2
                assert f"The query and texts[{index}] both hold more than 40 tokens" in str(error)
                refused += 1
                continue
            assert got == expected[index]  # ids and token types
    assert max(seen) <= reader.max_chars < len(texts[-1])
    assert refused == (4 if reader.scoring.pair_budget % 2 and reader.scoring.pair_formatter is None else 0)


def test_a_query_no_cut_is_found_for_is_refused_naming_the_bound(built):
    """The suite's BPE splits only at spaces: 1.99 million '!' are one word, which no prefix of the bound is known to
    tokenize as the whole does."""
    reader = PairReader(CrossEncoder(str(built("bert")), backend="fast", device=DEVICE)[0])
    expected = (
        r"^The query \(1,990,000 characters\) cannot be cut at 512 tokens within its first 20,480 characters"
        r".*\(4 x max_length 512 x 10, the vocabulary's"
    )
    with pytest.raises(InputError, match=expected):
        reader.read("!" * 1_990_000, "The query")


def test_long_pairs_score_as_plain_predict(built):
    """Through the app: pairs far past max_length (512), the query long too, give plain predict's scores."""
    folder, rng = built("bert"), random.Random(4)
    plain = sentence_transformers.CrossEncoder(str(folder), device="cpu")
    query, documents = words(rng, 700), [words(rng, n) for n in (5, 300, 900, 1500)]
    app = create_app(CrossEncoder(str(folder), backend="fast", device=DEVICE), "tiny", max_tokens_per_batch=4096,
                     max_batch_size=64, max_input_tokens=512, api_key=KEY)  # fmt: skip
    with TestClient(app) as client:
        reply = client.post("/rerank", json={"query": query, "texts": documents, "raw_scores": True}, headers=HEADERS)
    assert reply.status_code == 200, reply.text
    got = sorted(reply.json(), key=lambda result: result["index"])
    expected = plain.predict([(query, document) for document in documents], activation_fn=IDENTITY)
    np.testing.assert_allclose([result["score"] for result in got], expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def wordpiece_server(tmp_path_factory):
    """A random-weight BERT cross-encoder with all-MiniLM-L6-v2's WordPiece tokenizer (512 tokens), on loopback,
    taking 8 million characters a request: WordPiece splits at every punctuation mark, so 1.99 million '!' are cut
    and answered."""
    folder = build_cross_encoder(tmp_path_factory.mktemp("wordpiece") / "bert", "bert", vocab_size=30522)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(f"{minilm_path()}/{name}", folder / name)
    process, url = start_server(folder, "--max-request-chars", "8000000")
    yield folder, process, url
    process.terminate()
    process.wait(30)


def rerank(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/rerank", json=body, timeout=300)


def one_pair(url: str) -> httpx.Response:
    return rerank(url, {"query": "a short query", "documents": ["one short document"]})


QUERY = "what is it about"


def rerank_probed(process, url: str, documents: list[str]) -> tuple[httpx.Response, float]:
    """`documents` reranked against QUERY (returned too) while one-pair probes run: the response and its seconds,
    once the probe is held as fast as alone and the server's memory back within 50 MiB. The worker hands freed memory
    back when a burst ends: what a large request and its answer held is freed after it, and handed back when the
    next request's burst ends (one more pair)."""
    body = {"query": QUERY, "documents": documents, "return_documents": True}
    before = rss_bytes(process.pid)
    response, seconds, alone, during = probed(lambda: rerank(url, body), lambda: one_pair(url))
    assert_fair(alone, during)
    one_pair(url)
    assert rss_grown(process.pid, before) < 50 * 2**20
    return response, seconds


@pytest.mark.slow
@pytest.mark.real_model
def test_a_query_of_two_million_characters_holds_up_no_one(wordpiece_server):
    """The trial: 200 after 7 to 22 s, a probe waiting up to 6.8 s, +400 MiB. The query is read for its first 513
    tokens; the pair scores as predict scores it (any query of over 512 '!' is cut the same)."""
    folder, process, url = wordpiece_server
    before, document = rss_bytes(process.pid), "a short document about something"
    body = {"query": "!" * 1_990_000, "documents": [document]}
    response, seconds, alone, during = probed(lambda: rerank(url, body), lambda: one_pair(url))
    assert response.status_code == 200 and seconds < 5.0, (response.text, seconds)
    assert_fair(alone, during)
    assert rss_grown(process.pid, before) < 50 * 2**20
    expected = CrossEncoder(str(folder), backend="fast", device="cpu").predict([("!" * 8_000, document)])
    plain = sentence_transformers.CrossEncoder(str(folder), device="cpu").predict([("!" * 8_000, document)])
    np.testing.assert_allclose(response.json()["results"][0]["relevance_score"], expected[0], atol=1e-6, rtol=0)
    np.testing.assert_allclose(expected, plain, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.real_model
def test_long_documents_hold_up_no_one(wordpiece_server):
    """The trial: 256 documents of 7,500 characters, 32 to 99 s, a probe waiting up to 3 s. Here 30 documents of
    256,000 characters (the server takes 8 million a request): tokenized whole, as before, 7.7 million characters
    held the probe 7 s (the trial's 1.9 million only about 2 s, too close to the bound to tell on a busy machine).
    Read for their first 513 tokens, a chunk of documents per task of the tokenizer's thread, they cost what 30 short
    ones do: the request ends within seconds (30 pairs of 512 tokens, inside the default bound of 32), and the worker
    runs the probe's pair in the next pack."""
    folder, process, url = wordpiece_server
    rng = random.Random(7)
    documents = [(words(rng, 47_000) + f" {i}")[:256_000] for i in range(30)]
    response, seconds = rerank_probed(process, url, documents)
    assert response.status_code == 200 and seconds < 15.0, seconds
    scores = {result["index"]: result["relevance_score"] for result in response.json()["results"]}
    expected = CrossEncoder(str(folder), backend="fast", device="cpu").predict([(QUERY, d) for d in documents[:8]])
    np.testing.assert_allclose([scores[i] for i in range(8)], expected, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.real_model
def test_the_trials_256_documents_are_refused_by_the_default_bound_at_once(wordpiece_server):
    """The trial's case 2 itself: 256 documents of 7,500 characters are 131,072 tokens of pairs cut to 512, over
    the default bound on a CPU (32 full-length pairs, 16,384 tokens): a 413 naming it within seconds, the probe as
    alone, and memory back. On a GPU the default is 256 pairs, and the same request is answered."""
    folder, process, url = wordpiece_server
    rng = random.Random(11)
    documents = [(words(rng, 1_500) + f" {i}")[:7_500] for i in range(256)]
    response, seconds = rerank_probed(process, url, documents)
    if DEVICE != "cpu":
        assert response.status_code == 200 and len(response.json()["results"]) == 256
        return
    assert response.status_code == 413 and seconds < 5.0, (response.text, seconds)
    assert "131,072 tokens of pairs in one request; the limit is 16,384 (--max-request-tokens)" in response.text


@pytest.mark.slow
def test_a_tokenizers_release_that_cuts_pairs_otherwise_is_refused_and_embedder_is_not_a_reranker(built, monkeypatch):
    """The server cuts pairs as tokenizers >= 0.23.3 does; an older release (installed without the serve extra) is
    named at start, not left to give other scores than predict(). A cross-encoder is the Reranker's, not Embedder's."""
    import tokenizers

    from st_fastbackend.embedder import Embedder

    model = CrossEncoder(str(built("bert")), backend="fast", device=DEVICE)
    with pytest.raises(TypeError, match="CrossEncoder gives scores"):
        Embedder(model)
    monkeypatch.setattr(tokenizers, "__version__", "0.23.2")
    with pytest.raises(RuntimeError, match=r"tokenizers 0.23.2: the server cuts rerank pairs as tokenizers >= 0.23.3"):
        PairReader(model[0])
