"""Everything users pass to encode() keeps working and gives plain sentence-transformers' numbers."""

import shutil

import numpy as np
import pytest
import torch
from helpers import DEVICE, TOLERANCE, load_both, max_diff

from st_fastbackend import Chunking, SentenceTransformer

PROMPTS = {"query": "query: ", "document": "passage: ", "sts": "Instruct: similar text\nQuery: "}


@pytest.fixture(scope="module")
def models(st_model):
    return load_both(st_model("mistral", pooling_mode="lasttoken"), prompts=PROMPTS)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompt_name="sts"),
        dict(prompt="custom prompt: "),
        dict(normalize_embeddings=True),
        dict(truncate_dim=16),
        dict(precision="int8"),
        dict(precision="ubinary"),
        dict(convert_to_tensor=True),
        dict(convert_to_numpy=False),
        dict(show_progress_bar=True),
    ],
    ids=str,
)
def test_encode_arguments(models, texts, kwargs):
    plain, fast = models
    a, b = plain.encode(texts, batch_size=8, **kwargs), fast.encode(texts, batch_size=8, **kwargs)
    assert type(a) is type(b)
    if isinstance(a, list):
        a, b = torch.stack(a), torch.stack(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    tolerance = TOLERANCE if kwargs.get("precision") is None else 1  # quantised: one step at a bin edge
    assert max_diff(a, b) <= tolerance


def test_query_and_document_prompts(models, texts):
    plain, fast = models
    assert max_diff(plain.encode_query(texts), fast.encode_query(texts)) <= TOLERANCE
    assert max_diff(plain.encode_document(texts), fast.encode_document(texts)) <= TOLERANCE
    assert max_diff(fast.encode_query(texts), fast.encode(texts, prompt="query: ")) == 0


def test_default_prompt_name(st_model, texts):
    plain, fast = load_both(st_model("qwen2", pooling_mode="mean"), prompts=PROMPTS, default_prompt_name="query")
    assert max_diff(plain.encode(texts), fast.encode(texts)) <= TOLERANCE
    assert max_diff(fast.encode(texts), fast.encode(texts, prompt="query: ")) == 0


def test_token_embeddings_are_unpadded_per_text(models, texts):
    plain, fast = models
    a = plain.encode(texts, output_value="token_embeddings", batch_size=8)
    b = fast.encode(texts, output_value="token_embeddings", batch_size=8)
    assert [t.shape for t in a] == [t.shape for t in b]
    assert max(max_diff(x, y) for x, y in zip(a, b, strict=True)) <= 1e-4  # hidden states are not unit-norm


def test_output_value_none(models, texts):
    plain, fast = models
    a, b = plain.encode(texts[:5], output_value=None), fast.encode(texts[:5], output_value=None)
    for x, y in zip(a, b, strict=True):
        assert max_diff(x["sentence_embedding"], y["sentence_embedding"]) <= TOLERANCE
        n = len(y["input_ids"])
        assert torch.equal(x["input_ids"][:n].cpu(), y["input_ids"].cpu()) and y["token_embeddings"].shape[0] == n


def test_bad_arguments_are_refused_as_plain_refuses_them(models, texts):
    plain, fast = models
    with pytest.raises(KeyError):
        plain.encode(texts[:2], output_value="foo")
    with pytest.raises(ValueError, match="output_value must be one of"):
        fast.encode(texts[:2], output_value="foo")
    for budget in (0, -5):
        with pytest.raises(ValueError, match="max_tokens_per_batch must be positive"):
            fast.encode(texts[:2], max_tokens_per_batch=budget)


def test_single_string_empty_list_and_attributes(models, texts):
    plain, fast = models
    assert fast.encode(texts[5]).shape == plain.encode(texts[5]).shape == (64,)
    assert max_diff(plain.encode(texts[5]), fast.encode(texts[5])) <= TOLERANCE
    assert len(fast.encode([])) == len(plain.encode([])) == 0
    assert fast.get_sentence_embedding_dimension() == plain.get_sentence_embedding_dimension() == 64
    assert fast.tokenizer("a b")["input_ids"] == plain.tokenizer("a b")["input_ids"]


def test_max_seq_length_get_and_set(st_model, texts):
    plain, fast = load_both(st_model("llama", pooling_mode="mean"))
    assert fast.max_seq_length == plain.max_seq_length == 256
    plain.max_seq_length = fast.max_seq_length = 20
    assert max(len(ids) for ids in fast[0].texts.encode(texts)) == 20
    assert max_diff(plain.encode(texts), fast.encode(texts)) <= TOLERANCE


@pytest.mark.parametrize(
    "bad, says", [(None, "None"), (3, "int '3'"), (["a", "b"], "a list .a pair of texts"), ({"text": "a"}, "a dict")]
)
def test_non_string_input_is_a_clear_error(models, bad, says):
    """Plain sentence-transformers takes pairs and dicts; the fast backend says it does not, by index."""
    _, fast = models
    with pytest.raises(TypeError, match=f"input 1 is {says}.*backend=.torch. accepts them"):
        fast.encode(["fine", bad])


def test_a_lone_surrogate_is_named_with_its_input(models):
    """The tokenizer's TypeError ("TextEncodeInput must be Union[...]") names neither input nor character: a
    ValueError says both, as the server does; the index is the caller's past the first tokenizing chunk (4,096)."""
    _, fast = models
    with pytest.raises(ValueError, match=r"^Input 2 holds a lone surrogate \(U\+DC00\), which is not Unicode text"):
        fast.encode(["fine", "also fine", "broken \udc00 text"])
    with pytest.raises(ValueError, match=r"^The prompt holds a lone surrogate \(U\+D800\)"):
        fast.encode(["fine"], prompt="query\ud800: ")
    with pytest.raises(ValueError, match=r"^Input 1 holds a lone surrogate \(U\+D83D\)"):
        fast.encode(["fine", "an emoji cut in half \ud83d"], chunking=Chunking(tokens=8))
    with pytest.raises(ValueError, match=r"^Input 4097 holds a lone surrogate"):
        fast.encode(["a"] * 4097 + ["\ud800"], batch_size=4096)


def test_multi_process_pool_names_the_callers_index(models):
    _, fast = models
    with pytest.raises(TypeError, match="input 12 is int"):
        fast.encode(["fine"] * 12 + [3], device=["cpu", "cpu"], chunk_size=5)


def test_a_folder_without_tokenizer_files_is_refused(st_model, tmp_path):
    """transformers 5 would build a 5-token tokenizer, and every text would embed to the same vector."""
    folder = shutil.copytree(st_model("mistral", pooling_mode="mean"), tmp_path / "no_tokenizer")
    for file in folder.glob("tokenizer*"):
        file.unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer files.*tokenizer.json"):
        SentenceTransformer(str(folder), backend="fast", device=DEVICE)


@pytest.mark.slow
def test_multi_process_pool_gives_the_same_vectors(models, texts):
    _, fast = models
    single = fast.encode(texts, batch_size=8)
    pooled = fast.encode(texts, batch_size=8, device=["cpu", "cpu"], chunk_size=10)
    np.testing.assert_allclose(pooled, single, atol=TOLERANCE, rtol=0)


@pytest.mark.slow
def test_started_pool_gives_the_same_vectors(models, texts):
    _, fast = models
    pool = fast.start_multi_process_pool(["cpu", "cpu"])
    try:
        pooled = fast.encode(texts, batch_size=8, pool=pool, prompt_name="query")
    finally:
        fast.stop_multi_process_pool(pool)
    np.testing.assert_allclose(pooled, fast.encode(texts, batch_size=8, prompt_name="query"), atol=TOLERANCE, rtol=0)


def test_token_embeddings_with_a_prompt_computed_once(st_model, texts):
    """On a causal decoder the prompt is computed once, yet token embeddings hold every token of prompt + text as
    plain gives them (the prompt's rows first), in output_value=None's dicts too."""
    folder = st_model("qwen3", pooling_mode="mean")
    plain, fast = load_both(folder)
    prompt = "Instruct: retrieve the passage that answers the question\nQuery:"
    a = plain.encode(texts[:8], prompt=prompt, output_value="token_embeddings")
    b = fast.encode(texts[:8], prompt=prompt, output_value="token_embeddings")
    assert fast.prompt_prefix(prompt) is not None  # the prompt is computed once here
    assert [tuple(x.shape) for x in a] == [tuple(y.shape) for y in b]
    assert max(max_diff(x, y) for x, y in zip(a, b, strict=True)) <= TOLERANCE
    dicts = fast.encode(texts[:3], prompt=prompt, output_value=None)
    expected = plain.encode(texts[:3], prompt=prompt, output_value=None)
    for x, y in zip(expected, dicts, strict=True):
        n = int(x["attention_mask"].sum())
        assert torch.equal(x["input_ids"][:n].cpu(), y["input_ids"].cpu()) and y["token_embeddings"].shape[0] == n


def test_a_move_is_seen_by_the_next_call(models, texts):
    """The device found at one call is kept (sentence-transformers checks every tensor at every call), until the
    model moves: every move passes through _apply, which forgets it."""
    plain, fast = models
    before = fast.encode(texts)
    assert fast._placed is not None
    fast.to(DEVICE)
    assert fast._placed is None
    assert max_diff(fast.encode(texts), before) == 0 and max_diff(plain.encode(texts), before) <= TOLERANCE


def test_train_and_eval_modes(models, texts):
    """model.train() and .eval() set every module's mode as nn.Module's do, except the engine's own modules, which
    stay in eval mode (none acts differently in training; encode() sets the mode at every call)."""
    _, fast = models
    expected = fast.encode(texts[:8])
    fast.train()
    assert fast.training and fast[0].training and fast[1].training
    assert not any(module.training for module in fast[0].model.modules())
    np.testing.assert_array_equal(fast.encode(texts[:8]), expected)  # encode() puts it in eval mode itself
    assert not fast.training and not fast[0].training and not fast[1].training


def first_tokens(out: dict) -> torch.Tensor:
    return out["token_embeddings"][out["packed"].cu_seqlens[:-1].long()]  # [B, H]: each text's first token


class FirstTokens(SentenceTransformer):
    """A fifth output kind, in one class: each text's first token vector, from its one row rule (pack_rows), which
    encode() and the server's worker (what a route asking for sentence embeddings gets) both finish rows through."""

    output_kind = "first_token"

    def pack_rows(self, prompt, options):
        from st_fastbackend.models.fast import PackRows, text_tokens

        for name in ("output_value", "save_to_cpu", "truncate_dim", "normalize_embeddings"):
            options.pop(name)
        return PackRows(text_tokens(self[0].texts, prompt), lambda out: (first_tokens(out), None),
                        lambda results, device: torch.stack(results))  # fmt: skip


def test_an_output_kind_is_one_row_rule(st_model, texts):
    """encode()'s loop (FastModel._packed_inference) is every class's, and so is the server's worker; what a class
    makes of a pack is its own: a subclass that gives each text's first token vector needs nothing else, in encode()
    or served."""
    from fastapi.testclient import TestClient

    from st_fastbackend.serve.app import create_app

    model = FirstTokens(str(st_model("bert", pooling_mode="mean")), backend="fast", device=DEVICE)
    texts = [t for t in texts if t]
    first = model.encode(texts, batch_size=3, convert_to_tensor=True)
    tokens = SentenceTransformer(str(st_model("bert", pooling_mode="mean")), backend="fast", device=DEVICE).encode(
        texts, output_value="token_embeddings"
    )
    assert first.shape == (len(texts), tokens[0].shape[1])
    assert max_diff(first, torch.stack([t[0] for t in tokens]).cpu()) <= TOLERANCE
    app = create_app(model, "first", max_tokens_per_batch=4096, max_batch_size=64, max_input_tokens=256)
    with TestClient(app) as client:
        reply = client.post("/v1/embeddings", json={"input": texts[:8]})
    assert reply.status_code == 200, reply.text
    served = torch.tensor([item["embedding"] for item in reply.json()["data"]])
    assert max_diff(served, first[:8].cpu()) <= TOLERANCE


@pytest.mark.parametrize("chunked", [False, True])
def test_processing_kwargs_are_refused_by_name(st_model, chunked):
    """The fast backend tokenizes with the model's own tokenizer as loaded: processing_kwargs would be ignored."""
    model = SentenceTransformer(str(st_model("bert", pooling_mode="mean")), backend="fast", device=DEVICE)
    chunking = {"chunking": Chunking(tokens=8)} if chunked else {}
    with pytest.raises(Exception, match=r"processing_kwargs in encode\(\)"):
        model.encode(["a text"], processing_kwargs={"text": {"max_length": 4}}, **chunking)
