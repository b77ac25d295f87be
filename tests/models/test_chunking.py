"""Long documents (issue 31): chunk boundaries and spans against a reference cut, aggregates against plain
truncation and the weighted mean, late chunking against plain sentence-transformers' token embeddings (fp32,
1e-5), short texts as plain encode, batch invariance, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import TOLERANCE, load_both, max_diff, minilm_path
from sentence_transformers import SentenceTransformer as PlainSentenceTransformer
from transfers import HostToDevice

from st_fastbackend import Chunking, SentenceTransformer
from st_fastbackend.engine.batch import PackedBatch
from st_fastbackend.models.chunked import aggregate, span_vectors

LONG = " ".join(f"word{i} is here, and so is its neighbour number {i * 7}." for i in range(40))
TEXTS = ["a short text", LONG, "", LONG[: len(LONG) // 3], "another text, a bit longer than the first one"]


@pytest.fixture(scope="module")
def minilm():
    plain, fast = load_both(minilm_path(), device="cpu")
    plain.max_seq_length = fast.max_seq_length = 40
    return plain, fast


def reference_cut(n: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """Starts every size - overlap tokens until a chunk reaches the end; an empty text is one empty chunk."""
    starts = range(0, max(n - overlap, 1), size - overlap)
    return [(s, min(s + size, n)) for s in starts if s == 0 or s + overlap < n]


@pytest.mark.slow
@pytest.mark.real_model
def test_boundaries_and_spans(minilm):
    _, fast = minilm
    tokenizer = fast.tokenizer
    for size, overlap in [(38, 0), (10, 3), (7, 6)]:
        found = fast.encode_chunks(TEXTS, Chunking(tokens=size, overlap=overlap, aggregate=None))
        for text, chunks in zip(TEXTS, found, strict=True):
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            offsets = encoded["offset_mapping"]
            assert chunks.token_spans == reference_cut(len(offsets), size, overlap)
            expected = [(offsets[s][0], offsets[e - 1][1]) if e > s else (0, 0) for s, e in chunks.token_spans]
            assert chunks.char_spans == expected
            assert chunks.embeddings.shape == (len(chunks.token_spans), 384)


@pytest.mark.real_model
def test_first_is_truncation_and_short_texts_are_plain(minilm):
    plain, fast = minilm
    expected = plain.encode(TEXTS)
    assert max_diff(fast.encode(TEXTS, chunking=Chunking(aggregate="first")), expected) <= TOLERANCE
    for chunking in (Chunking(), Chunking(aggregate="max"), Chunking(aggregate=None)):
        short = fast.encode_chunks(TEXTS[:1] + TEXTS[2:3], chunking)  # one chunk each, the "" one too
        assert max_diff(np.concatenate([c.embeddings for c in short]), expected[[0, 2]]) <= TOLERANCE, chunking
    # Late chunking pools a chunk's own tokens, without [CLS] and [SEP]; a text of none is what plain gives it.
    assert max_diff(fast.encode([""], chunking=Chunking(late=True)), expected[[2]]) <= TOLERANCE
    with_prompt = fast.encode(TEXTS, prompt="query: ", chunking=Chunking(aggregate="first"))
    assert max_diff(with_prompt, plain.encode(TEXTS, prompt="query: ")) <= TOLERANCE


@pytest.mark.real_model
def test_mean_and_max_aggregate_the_chunks(minilm):
    _, fast = minilm
    chunking = Chunking(tokens=12, overlap=4)
    found = fast.encode_chunks(TEXTS, chunking)
    for how in ("mean", "max"):
        got = fast.encode(TEXTS, chunking=Chunking(tokens=12, overlap=4, aggregate=how))
        for row, chunks in zip(got, found, strict=True):
            weights = np.array([max(e - s, 1) for s, e in chunks.token_spans], dtype=np.float64)[:, None]
            vectors = chunks.embeddings.astype(np.float64)
            want = (vectors * weights).sum(0) / weights.sum() if how == "mean" else vectors.max(0)
            assert max_diff(row, want / np.linalg.norm(want)) <= TOLERANCE  # re-normalised: MiniLM normalises


def late_reference(plain, text: str, spans, context: int) -> np.ndarray:
    """Plain sentence-transformers' token embeddings of [CLS] + each window's tokens + [SEP], each span's mean
    normalised (MiniLM: mean pooling, Normalize); a window runs from a chunk's start to the end of the last
    chunk that fits in context - 2 tokens."""
    ids = plain.tokenizer(text, add_special_tokens=False)["input_ids"]
    groups: list[list[tuple[int, int]]] = []
    for s, e in spans:
        if groups and e - groups[-1][0][0] <= context - 2:
            groups[-1].append((s, e))
        else:
            groups.append([(s, e)])
    plain.max_seq_length = context
    out = []
    for group in groups:
        start, end = group[0][0], group[-1][1]
        tokens = plain_tokens(plain, text, ids, start, end)  # [L, H], [CLS] and [SEP] included
        for s, e in group:
            vector = tokens[1 + s - start : 1 + e - start].mean(0)
            out.append((vector / vector.norm()).numpy())
    return np.stack(out)


def plain_tokens(plain, text: str, ids: list[int], start: int, end: int) -> torch.Tensor:
    """The whole document's token embeddings from encode(output_value="token_embeddings"); a window that starts
    inside a word has no text of its own, so its ids go through plain's Transformer module."""
    if (start, end) == (0, len(ids)):
        return plain.encode(text, output_value="token_embeddings").double()
    window = torch.tensor([[plain.tokenizer.cls_token_id, *ids[start:end], plain.tokenizer.sep_token_id]])
    features = {"input_ids": window, "attention_mask": torch.ones_like(window), "token_type_ids": window * 0}
    with torch.inference_mode():
        return plain[0](features)["token_embeddings"][0].double()


@pytest.mark.real_model
@pytest.mark.parametrize("context", [None, 64])
def test_late_chunking_against_token_embeddings(minilm, context):
    plain, fast = minilm
    texts = [LONG[:1500], LONG, "a short text"]  # 1500 characters: one window of 512 positions
    found = fast.encode_chunks(texts, Chunking(tokens=20, overlap=5, late=True, context=context))
    for text, chunks in zip(texts, found, strict=True):
        reference = late_reference(plain, text, chunks.token_spans, context or 512)
        assert max_diff(chunks.embeddings, reference) <= TOLERANCE
    plain.max_seq_length = 40


@pytest.mark.real_model
def test_batch_invariance(minilm):
    _, fast = minilm
    for chunking in (Chunking(tokens=9, overlap=2, aggregate=None), Chunking(tokens=9, late=True, context=30)):
        together = fast.encode_chunks(TEXTS, chunking, batch_size=3, max_tokens_per_batch=100)
        for text, chunks in zip(TEXTS, together, strict=True):
            alone = fast.encode_chunks([text], chunking)[0]
            assert alone.token_spans == chunks.token_spans
            assert max_diff(alone.embeddings, chunks.embeddings) <= TOLERANCE


def test_late_chunking_copies_without_waiting(st_model):
    """A pack's spans (token positions, the spans' own batch) and the chunks' weights reach a GPU without the host
    waiting for its queue (pinned, non_blocking). The meta device stands in for the GPU."""
    fast = SentenceTransformer(str(st_model("bert", pooling_mode="mean")), backend="fast", device="cpu")
    out = {"packed": PackedBatch.from_sequences([[1] * 12, [1] * 9]).to("meta"),
           "token_embeddings": torch.empty(21, fast.get_embedding_dimension(), device="meta")}  # fmt: skip
    with HostToDevice() as counted:
        vectors = span_vectors(
            fast, out, [[(1, 6), (6, 11)], [(1, 8)]], lambda features: features["sentence_embedding"]
        )
        document = aggregate(vectors[:2], [(0, 5), (5, 10)], "mean", normalizes=True)
    assert vectors.shape == (3, fast.get_embedding_dimension()) and document.device.type == "meta"
    assert counted.copies > 0 and counted.waits == 0


def test_late_with_dense_and_max_pooling(st_model):
    folder = st_model("bert", pooling_mode="max", dense=(16,))
    plain, fast = load_both(folder, device="cpu")
    text = " ".join(["alpha beta gamma delta"] * 12)  # under max_seq_length: plain runs it whole
    chunks = fast.encode_chunks([text], Chunking(tokens=16, late=True))[0]
    features = plain.preprocess([text])
    with torch.inference_mode():
        tokens = plain[0](features)["token_embeddings"][0]  # [L, H] of the whole text
        head = 1 if features["input_ids"][0, 0] in plain.tokenizer.all_special_ids else 0
        for (s, e), got in zip(chunks.token_spans, chunks.embeddings, strict=True):
            pooled = {"sentence_embedding": tokens[head + s : head + e].amax(0, keepdim=True)}
            for module in list(plain)[2:]:
                pooled = module(pooled)
            assert max_diff(got, pooled["sentence_embedding"][0]) <= TOLERANCE


@pytest.mark.real_model
def test_errors(minilm, st_model):
    _, fast = minilm
    for bad, field in [({"tokens": 0}, "tokens"), ({"overlap": -1}, "overlap"), ({"aggregate": "sum"}, "aggregate"),
                       ({"tokens": 4, "overlap": 4}, "overlap"), ({"context": 64}, "context")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"Chunking.{field}"):
            Chunking(**bad)
    with pytest.raises(ValueError, match="Unknown chunking field 'size'"):
        Chunking.from_dict({"size": 3})
    with pytest.raises(ValueError, match="Chunking.tokens=39 does not fit max_seq_length 40"):
        fast.encode(TEXTS, chunking=Chunking(tokens=39))
    with pytest.raises(ValueError, match="encode_chunks"):
        fast.encode(TEXTS, chunking=Chunking(aggregate=None))
    with pytest.raises(ValueError, match="Chunking.context=1000 is more than the model's 512 positions"):
        fast.encode(TEXTS, chunking=Chunking(late=True, context=1000))
    cls = SentenceTransformer(str(st_model("bert", pooling_mode="cls")), backend="fast", device="cpu")
    with pytest.raises(ValueError, match="pooling mode 'cls' has no meaning over a span"):
        cls.encode(TEXTS, chunking=Chunking(late=True))
    plain = PlainSentenceTransformer(minilm_path(), device="cpu")
    with pytest.raises(ValueError, match="chunking"):
        plain.encode(TEXTS, chunking=Chunking())


def test_embed_corpus_chunk_rows_and_aggregate(st_model, tmp_path, capsys):
    """--chunk-tokens: one row per chunk (id, chunk, char_start, char_end) equal to encode_chunks, resumable by
    document id; --aggregate mean: one row per document equal to encode(chunking=)."""
    import pyarrow.parquet as pq
    from corpus_files import embed_corpus, refused, write_parquet

    folder = st_model("bert", pooling_mode="mean")
    model = SentenceTransformer(str(folder), backend="fast", device="cpu")
    texts = [LONG[:600], "short", LONG[:300], "x y z"]
    source = write_parquet(tmp_path / "in.parquet", ["a", "b", "c", "d"], texts)
    chunking = Chunking(tokens=24, overlap=4, aggregate=None)
    embed_corpus(source, tmp_path / "chunks", "--model", folder, "--chunk-tokens", 24, "--chunk-overlap", 4,
                 "--shard-rows", 2)  # fmt: skip
    table = pq.read_table(sorted((tmp_path / "chunks").glob("part-*.parquet")))
    expected = model.encode_chunks(texts, chunking)
    ids = [doc for doc, chunks in zip("abcd", expected, strict=True) for _ in chunks.token_spans]
    assert table.column("id").to_pylist() == ids
    assert table.column("chunk").to_pylist() == [k for c in expected for k in range(len(c.token_spans))]
    spans = list(zip(table.column("char_start").to_pylist(), table.column("char_end").to_pylist(), strict=True))
    assert spans == [span for c in expected for span in c.char_spans]
    rows = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    assert max_diff(rows, np.concatenate([c.embeddings for c in expected])) <= TOLERANCE
    embed_corpus(source, tmp_path / "chunks", "--model", folder, "--chunk-tokens", 24, "--chunk-overlap", 4)
    found = capsys.readouterr().err  # resumed by document id: nothing left
    assert "0 rows written: 0 reused, 0 deduplicated, 0 embedded (4 done before" in found

    embed_corpus(source, tmp_path / "mean", "--model", folder, "--chunk-tokens", 24, "--aggregate", "mean")
    table = pq.read_table(sorted((tmp_path / "mean").glob("part-*.parquet")))
    want = model.encode(texts, chunking=Chunking(tokens=24))
    assert table.column("id").to_pylist() == list("abcd")
    assert max_diff(np.stack(table.column("embedding").to_numpy(zero_copy_only=False)), want) <= TOLERANCE
    assert "--late need --chunk-tokens" in refused(capsys, source, tmp_path / "x", "--model", folder, "--late")
    assert "--chunk-overlap" in refused(capsys, source, tmp_path / "x", "--model", folder, "--chunk-tokens", 4,
                                        "--chunk-overlap", 4)  # fmt: skip
    assert "another job" in refused(capsys, source, tmp_path / "mean", "--model", folder, "--chunk-tokens", 24)


@pytest.mark.slow
def test_server_chunking_field(served_folder):
    """/v1/embeddings with `chunking`: an aggregate in OpenAI's shape equal to encode(chunking=), without one each
    input's chunks with their text spans equal to encode_chunks; late chunking over last-token pooling and unknown
    fields refused."""
    import httpx
    from serving import KEY, start_server

    model = SentenceTransformer(str(served_folder), backend="fast", device="cpu")
    texts = [LONG[:700], "short text"]
    process, url = start_server(served_folder, "--api-key", KEY)
    try:
        post = lambda body: httpx.post(f"{url}/v1/embeddings", json=body, timeout=60,  # noqa: E731
                                       headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
        mean = post({"input": texts, "chunking": {"tokens": 30, "overlap": 5}}).json()
        want = model.encode(texts, chunking=Chunking(tokens=30, overlap=5))
        assert max_diff([d["embedding"] for d in mean["data"]], want) <= TOLERANCE
        each = post({"input": texts, "chunking": {"tokens": 30, "overlap": 5, "aggregate": None}}).json()
        for item, chunks in zip(each["data"], model.encode_chunks(texts, Chunking(tokens=30, overlap=5)), strict=True):
            assert [c["text_span"] for c in item["chunks"]] == [list(span) for span in chunks.char_spans]
            assert max_diff([c["embedding"] for c in item["chunks"]], chunks.embeddings) <= TOLERANCE
        late = post({"input": texts, "chunking": {"late": True}})
        assert late.status_code == 400 and "'lasttoken' has no meaning over a span" in late.text
        unknown = post({"input": texts, "chunking": {"size": 3}})
        assert unknown.status_code == 400 and "Unknown chunking field 'size'" in unknown.text
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.parametrize("family", ["bert", "mistral"])
def test_server_late_chunking(st_model, family):
    """/v1/embeddings with chunking.late: each window run once, each chunk's span pooled by the worker; equal to
    encode_chunks and encode with Chunking(late=True, context=the server's input limit), with a prompt (on the
    Mistral, computed once: the pack holds what follows it)."""
    from fastapi.testclient import TestClient
    from serving import HEADERS, KEY

    from st_fastbackend.serve.app import create_app
    from st_fastbackend.serve.limits import Limits

    # "query: " would merge its space into the text's first token with this tokenizer: chunks refuse such prompts
    folder = st_model(family, pooling_mode="mean", prompts={"query": "query:"})
    model = SentenceTransformer(str(folder), backend="fast", device="cpu")
    texts, limit = [LONG, LONG[:300], "short text"], 64
    # LONG's windows hold more than 32 inputs of 64 tokens, the default bound on a CPU
    app = create_app(SentenceTransformer(str(folder), backend="fast", device="cpu"), "tiny", max_tokens_per_batch=4096,
                     max_batch_size=64, max_input_tokens=limit, api_key=KEY,
                     limits=Limits(max_request_tokens=64 * limit))  # fmt: skip
    chunking = {"tokens": 20, "overlap": 4, "late": True}
    with TestClient(app) as client:
        post = lambda body: client.post("/v1/embeddings", json=body, headers=HEADERS)  # noqa: E731
        each = post({"input": texts, "prompt_name": "query", "chunking": {**chunking, "aggregate": None}})
        assert each.status_code == 200, each.text
        expected = model.encode_chunks(texts, Chunking(**chunking, aggregate=None, context=limit), prompt_name="query")
        for item, chunks in zip(each.json()["data"], expected, strict=True):
            assert [c["text_span"] for c in item["chunks"]] == [list(span) for span in chunks.char_spans]
            assert max_diff([c["embedding"] for c in item["chunks"]], chunks.embeddings) <= TOLERANCE
        assert len(expected[0].embeddings) > 3  # LONG is cut into several windows of several chunks
        mean = post({"input": texts, "chunking": chunking}).json()
        want = model.encode(texts, chunking=Chunking(**chunking, context=limit))
        assert max_diff([d["embedding"] for d in mean["data"]], want) <= TOLERANCE
        over = post({"input": texts, "chunking": {**chunking, "context": limit + 1}})
        assert over.status_code == 400 and "input tokens" in over.text
        default = post({"input": texts, "chunking": {"late": True}})  # chunks of what the input limit leaves
        assert default.status_code == 200, default.text
