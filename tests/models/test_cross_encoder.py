"""CrossEncoder(backend="fast") against plain sentence_transformers.CrossEncoder on the same random-weight
folder, one per head type: predict raw and with activation, rank order, batch invariance, pairs past
max_length, refused heads; the CUDA path through the kernel stand-ins."""

import contextlib

import kernel_standins
import numpy as np
import pytest
import sentence_transformers
import torch
from builders import build_cross_encoder, make_texts
from helpers import DEVICE
from torch.utils._python_dispatch import TorchDispatchMode

from st_fastbackend import CrossEncoder, UnsupportedModelError

IDENTITY = torch.nn.Identity()
HEADS = {
    "bert (pooler, token types)": ("bert", {}),
    # Positions from padding_idx + 1 (pad id 3 here): room for 512 tokens, as bge-reranker's 514 for pad id 1.
    "roberta": ("roberta", {"max_position_embeddings": 516}),
    "xlm-roberta (bge-reranker)": ("xlm-roberta", {"max_position_embeddings": 516}),
    "distilbert (pre_classifier)": ("distilbert", {}),
    "modernbert cls": ("modernbert", {"classifier_pooling": "cls"}),
    "modernbert mean": ("modernbert", {"classifier_pooling": "mean"}),
    "qwen2 score": ("qwen2", {}),
    "qwen3 score": ("qwen3", {}),
    "llama score, 3 labels (NLI)": ("llama", {"num_labels": 3}),
    "bert, 3 labels (NLI)": ("bert", {"num_labels": 3}),
    "qwen3 causal LM + LogitScore": ("qwen3", {"causal_lm": True}),
    "llama causal LM + LogitScore": ("llama", {"causal_lm": True}),
    "qwen2 causal LM, tied embeddings": ("qwen2", {"causal_lm": True, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module")
def pairs() -> list[tuple[str, str]]:
    texts = [t for t in make_texts(48, seed=3, max_words=200) if t]
    return [(texts[i % 5], texts[i]) for i in range(len(texts))]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def build(case: str):
        if case not in cache:
            family, options = HEADS[case]
            cache[case] = build_cross_encoder(tmp_path_factory.mktemp("ce") / family, family, **options)
        return cache[case]

    return build


def load_both(folder, **kwargs):
    plain = sentence_transformers.CrossEncoder(str(folder), device="cpu", **kwargs)
    return plain, CrossEncoder(str(folder), device=DEVICE, backend="fast", **kwargs)


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


@pytest.mark.parametrize("case", HEADS)
def test_predict_matches_plain(built, pairs, case):
    plain, fast = load_both(built(case), max_length=128)
    assert fast.num_labels == plain.num_labels
    assert type(fast.activation_fn) is type(plain.activation_fn)
    for options in ({"activation_fn": IDENTITY}, {}, {"apply_softmax": True}):
        expected = plain.predict(pairs, batch_size=8, **options)
        ours = fast.predict(pairs, batch_size=8, **options)
        assert ours.shape == expected.shape
        assert max_diff(ours, expected) <= 1e-5, options
    tensor = fast.predict(pairs[:3], convert_to_tensor=True)
    assert isinstance(tensor, torch.Tensor) and tensor.shape[0] == 3
    assert isinstance(fast.predict(pairs[:3], convert_to_numpy=False), list)
    single = fast.predict(pairs[0], activation_fn=IDENTITY)
    assert max_diff(single, plain.predict(pairs[0], activation_fn=IDENTITY)) <= 1e-5


@pytest.mark.parametrize("case", [c for c, (_, o) in HEADS.items() if o.get("num_labels", 1) == 1])
def test_rank_order_matches_plain(built, pairs, case):
    plain, fast = load_both(built(case), max_length=128)
    query, documents = pairs[0][0], [second for _, second in pairs]
    expected = plain.rank(query, documents, return_documents=True, top_k=10)
    ours = fast.rank(query, documents, return_documents=True, top_k=10)
    assert [r["corpus_id"] for r in ours] == [r["corpus_id"] for r in expected]
    assert [r["text"] for r in ours] == [r["text"] for r in expected]
    assert max_diff([r["score"] for r in ours], [r["score"] for r in expected]) <= 1e-5
    prompted = plain.rank(query, documents, prompt="Judge: "), fast.rank(query, documents, prompt="Judge: ")
    assert [r["corpus_id"] for r in prompted[1]] == [r["corpus_id"] for r in prompted[0]]


@pytest.mark.parametrize("case", ["bert (pooler, token types)", "modernbert mean", "qwen3 causal LM + LogitScore"])
def test_a_pair_scores_the_same_in_any_pack(built, pairs, case):
    _, fast = load_both(built(case), max_length=128)
    packed = fast.predict(pairs, batch_size=48, activation_fn=IDENTITY)
    small = fast.predict(pairs, batch_size=3, max_tokens_per_batch=300, activation_fn=IDENTITY)
    alone = np.array([fast.predict([pair], activation_fn=IDENTITY)[0] for pair in pairs[:8]])
    np.testing.assert_allclose(small, packed, atol=1e-5, rtol=0)
    np.testing.assert_allclose(alone, packed[:8], atol=1e-5, rtol=0)
    reordered = fast.predict(pairs[::-1], activation_fn=IDENTITY)[::-1]  # results in the caller's order
    np.testing.assert_allclose(reordered, packed, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bert (pooler, token types)", "xlm-roberta (bge-reranker)", "qwen2 score"])
def test_pairs_longer_than_max_length_truncate_longest_first(built, pairs, case):
    long_pairs = [(first * 3, second * 3) for first, second in pairs[:12]]
    plain, fast = load_both(built(case), max_length=40)
    assert fast.max_seq_length == plain.max_seq_length == 40
    ours = fast[0].encode_pairs(long_pairs, None)
    assert max(len(ids) for ids in ours) == 40
    expected = plain.predict(long_pairs, activation_fn=IDENTITY)
    assert max_diff(fast.predict(long_pairs, activation_fn=IDENTITY), expected) <= 1e-5


def test_bert_second_text_is_segment_one(built, pairs):
    """The token types reach the engine: without them the scores would be a single text's."""
    _, fast = load_both(built("bert (pooler, token types)"))
    (sequence,) = fast[0].encode_pairs(pairs[:1], None)
    assert 0 in sequence.token_types and 1 in sequence.token_types
    with_types = fast.predict(pairs[:4], activation_fn=IDENTITY)
    fast[0].token_types = False
    assert max_diff(fast.predict(pairs[:4], activation_fn=IDENTITY), with_types) > 1e-3


def test_refused_clearly(tmp_path, built, pairs):
    folder = build_cross_encoder(tmp_path / "bert", "bert")
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text(config.replace("BertForSequenceClassification", "BertForTokenClassification"))
    with pytest.raises(UnsupportedModelError, match='BertForTokenClassification.*backend="torch"'):
        CrossEncoder(str(folder), backend="fast", device=DEVICE)
    assert CrossEncoder(str(built("bert (pooler, token types)")), backend="fast").predict([]).shape == (0,)


@pytest.mark.parametrize(
    "bad, error, says",
    [
        (("a", None), TypeError, "Input 1: its second element is None, not a text"),
        ((3.5, "b"), TypeError, "Input 1: its first element is float '3.5', not a text"),
        (5, TypeError, "Input 1 is int '5'; CrossEncoder scores pairs of two texts"),
        (("only one",), ValueError, "Input 1 is a tuple of length 1; CrossEncoder scores pairs of two texts"),
        (("a", "b", "c"), ValueError, "Input 1 is a tuple of length 3"),
        (("a", "b\ud800"), ValueError, r"Input 1 holds a lone surrogate \(U\+D800\), which is not Unicode text"),
    ],
    ids=["None", "a number", "not a pair", "one text", "three texts", "a lone surrogate"],
)
def test_bad_input_is_a_type_or_value_error_about_it(built, pairs, bad, error, says):
    """Not the fast backend's limit (plain refuses these too): no UnsupportedModelError sending the user to it."""
    fast = CrossEncoder(str(built("bert (pooler, token types)")), backend="fast", device=DEVICE)
    with pytest.raises(error, match=f"^{says}") as raised:
        fast.predict([pairs[0], bad])
    assert type(raised.value) is error


def test_a_folder_saved_by_plain_sentence_transformers(tmp_path, built, pairs):
    for case in ("xlm-roberta (bge-reranker)", "qwen3 causal LM + LogitScore"):
        plain = sentence_transformers.CrossEncoder(str(built(case)), device="cpu")
        plain.save(str(tmp_path / case))
        fast = CrossEncoder(str(tmp_path / case), backend="fast", device=DEVICE)
        assert max_diff(fast.predict(pairs), plain.predict(pairs)) <= 1e-5


@pytest.mark.skipif(DEVICE != "cpu", reason="the stand-ins replace the CUDA kernels on the CPU")
@pytest.mark.parametrize("name", ["torch 2.14", "flash-attn 2.8"])
@pytest.mark.parametrize("case", ["bert (pooler, token types)", "qwen3 causal LM + LogitScore"])
def test_bf16_through_the_cuda_kernel_standins(standin, built, pairs, name, case):
    """On the CUDA path (kernel stand-ins on the CPU), bf16: the pair scores stay within 3x plain's bf16 error."""
    folder = built(case)
    reference = sentence_transformers.CrossEncoder(str(folder), device="cpu").predict(pairs, activation_fn=IDENTITY)
    plain_bf16 = sentence_transformers.CrossEncoder(
        str(folder), device="cpu", model_kwargs={"dtype": torch.bfloat16}
    ).predict(pairs, activation_fn=IDENTITY)
    standin(name)
    fast = CrossEncoder(str(folder), backend="fast", device="cpu", model_kwargs={"dtype": torch.bfloat16})
    assert fast[0].attention_kernel == ("flash_attn" if name.startswith("flash") else "torch_varlen")
    ours = fast.predict(pairs, activation_fn=IDENTITY)
    assert kernel_standins.Calls.count > 0
    assert max_diff(ours, reference) <= 3 * max(max_diff(plain_bf16, reference), 1e-3)


class AtomicIndexAdd(TorchDispatchMode):
    """index_add_ as CUDA runs it: one atomic add per source element, each rounded to the destination's dtype
    (aten/src/ATen/native/cuda/Indexing.cu, gpuAtomicAdd); here in source order, there in no fixed order. (The
    CPU's kernel accumulates a bf16 index_add_ in fp32.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.aten.index_add_.default:
            return func(*args, **(kwargs or {}))
        out, dim, index, source = args
        assert dim == 0 and not kwargs
        for i, row in zip(index.tolist(), source, strict=True):
            out[i] += row
        return out


def test_modernbert_mean_head_sums_in_fp32():
    """bf16 rounding after each token would stall a sum of ones at 256; transformers sums in fp32, then rounds."""
    from st_fastbackend.engine.batch import PackedBatch
    from st_fastbackend.modules.heads import mean_tokens

    packed = PackedBatch.from_sequences([[1] * 1000, [1] * 3, [1] * 300])
    ones = torch.ones(packed.num_tokens, 4, dtype=torch.bfloat16)
    with AtomicIndexAdd():
        assert torch.equal(mean_tokens(ones, packed), torch.ones(3, 4, dtype=torch.bfloat16))
    h = torch.randn(packed.num_tokens, 16, dtype=torch.bfloat16) + 1
    segments = torch.split(h, list(packed.lengths))
    expected = torch.stack([s.sum(0) / torch.tensor(len(s)) for s in segments])  # transformers' expression
    assert expected.dtype == torch.bfloat16
    torch.testing.assert_close(mean_tokens(h, packed), expected, atol=0, rtol=2**-8)  # one bf16 rounding


def test_modernbert_mean_head_in_bf16_within_plains_error(built, pairs):
    """bf16 scores against plain fp32 within 3x plain bf16's own error, and the same from run to run: on a GPU with
    its atomic adds, on the CPU with them emulated."""
    folder = built("modernbert mean")
    long_pairs = [(first * 3, second * 3) for first, second in pairs]  # up to max_length: long sums
    reference = sentence_transformers.CrossEncoder(str(folder), device="cpu").predict(
        long_pairs, activation_fn=IDENTITY
    )
    plain_bf16 = sentence_transformers.CrossEncoder(
        str(folder), device="cpu", model_kwargs={"dtype": torch.bfloat16}
    ).predict(long_pairs, activation_fn=IDENTITY)
    fast = CrossEncoder(str(folder), backend="fast", device=DEVICE, model_kwargs={"dtype": torch.bfloat16})
    with AtomicIndexAdd() if DEVICE == "cpu" else contextlib.nullcontext():
        ours = fast.predict(long_pairs, activation_fn=IDENTITY)
        again = fast.predict(long_pairs, activation_fn=IDENTITY)
    assert max_diff(ours, reference) <= 3 * max(max_diff(plain_bf16, reference), 1e-3)
    assert np.array_equal(again, ours)


# Qwen3-Reranker's shape in small: the pair rendered as query/document messages, then the assistant's turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>yes or no:{% endif %}"
)


@pytest.mark.parametrize("causal_lm", [True, False], ids=["causal LM + LogitScore", "score head"])
def test_chat_template_rerankers(tmp_path, pairs, causal_lm):
    """A tokenizer with a chat template: pairs rendered as sentence-transformers renders them (query and document
    messages; the template's suffix restored after truncation), scored on the packed engine; also as plain saves
    it (its message modality in sentence_bert_config.json)."""
    from transformers import AutoTokenizer

    folder = build_cross_encoder(tmp_path / "qwen3", "qwen3", causal_lm=causal_lm)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    plain, fast = load_both(folder, max_length=96)  # the longest pairs are cut, the suffix put back
    assert max_diff(plain.predict(pairs, activation_fn=IDENTITY), fast.predict(pairs, activation_fn=IDENTITY)) <= 1e-5
    alone = [fast.predict([pair], activation_fn=IDENTITY)[0] for pair in pairs[:5]]
    assert max_diff(alone, fast.predict(pairs[:5], activation_fn=IDENTITY)) <= 1e-5
    rendered = plain[0].preprocess([list(p) for p in pairs[:6]])["attention_mask"].sum(1).tolist()
    lengths = fast[0].pair_lengths(pairs[:6])  # untruncated: the server's truncate=false check
    assert all(n >= r for n, r in zip(lengths, rendered, strict=True)) and max(lengths) > 96
    plain.save(str(tmp_path / "saved"))
    again = CrossEncoder(str(tmp_path / "saved"), device=DEVICE, backend="fast")
    assert max_diff(plain.predict(pairs[:8]), again.predict(pairs[:8])) <= 1e-5


def test_shared_tokens_computed_once(tmp_path, pairs, monkeypatch):
    """A causal-LM reranker's pairs computed after the tokens they all begin with (a chat template's head, rank()'s
    query): the same scores as plain, as with every pair run whole (prefix_reuse=False), and the shared pass ran."""
    from transformers import AutoTokenizer

    from st_fastbackend.modules import scoring

    folder = build_cross_encoder(tmp_path / "qwen3", "qwen3", causal_lm=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = "<|system|>judge whether the document answers the query, yes or no\n" + CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    plain, fast = load_both(folder)
    found = []
    shared = scoring.PackedScoringTransformer.shared_prefix
    monkeypatch.setattr(scoring.PackedScoringTransformer, "shared_prefix",
                        lambda self, sequences: found.append(shared(self, sequences)) or found[-1])  # fmt: skip
    computed = []  # the prefixes run (their token ids), once each
    prefix_pass = fast[0].computed_prefix
    monkeypatch.setattr(
        fast[0], "computed_prefix", lambda prefix, device: computed.append(prefix.ids) or prefix_pass(prefix, device)
    )
    assert max_diff(plain.predict(pairs, activation_fn=IDENTITY), fast.predict(pairs, activation_fn=IDENTITY)) <= 1e-5
    query, documents = pairs[0][0], [document for _, document in pairs]
    expected = plain.rank(query, documents)
    ranked = fast.rank(query, documents)
    assert [r["corpus_id"] for r in ranked] == [r["corpus_id"] for r in expected]
    assert max_diff([r["score"] for r in ranked], [r["score"] for r in expected]) <= 1e-5
    assert found[0] is not None and computed[0] == found[0].ids  # predict: the template's head, run once
    assert found[1].length > found[0].length  # rank: the query too
    assert computed == [found[0].ids, found[1].ids]
    fast.prefix_reuse = False
    assert max_diff(fast.predict(pairs, activation_fn=IDENTITY), plain.predict(pairs, activation_fn=IDENTITY)) <= 1e-5
    assert len(found) == 2  # not asked for
