"""engine/prefix.py: a prompt shared by the texts of a call, computed once on causal decoders, gives the
embeddings plain sentence-transformers gives with the prompt run for every text."""

import kernel_standins
import numpy as np
import pytest
import torch
from builders import add_e5_tokenizer_contradiction, build_st_model
from helpers import DEVICE, TOLERANCE, load_both, max_diff, one_minus_cosine

from st_fastbackend import SentenceTransformer
from st_fastbackend.embedder import Embedder
from st_fastbackend.engine import decoder
from st_fastbackend.serve.batcher import Batcher, Job
from st_fastbackend.serve.metrics import Metrics

INSTRUCTION = "Instruct: Given a scientific claim, retrieve documents that support or refute the claim\nQuery: "
MODES = ["lasttoken", "mean", "max", "cls", "weightedmean", "mean_sqrt_len_tokens", ("mean", "lasttoken")]


@pytest.fixture
def reused(monkeypatch):
    """The number of tokens that attended to a prompt computed once, counted as the engine runs."""
    counts = {"tokens": 0}
    attention = decoder.prefixed_attention

    def counting(q, *args, **kwargs):
        counts["tokens"] += q.shape[0]
        return attention(q, *args, **kwargs)

    monkeypatch.setattr(decoder, "prefixed_attention", counting)
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("include_prompt", [True, False], ids=["with prompt tokens", "without"])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_every_pooling_mode_matches_plain(st_model, texts, reused, mode, include_prompt):
    plain, fast = load_both(st_model("mistral", pooling_mode=mode, include_prompt=include_prompt))
    expected = plain.encode(texts, prompt=INSTRUCTION, batch_size=8)
    assert max_diff(fast.encode(texts, prompt=INSTRUCTION, batch_size=8), expected) <= TOLERANCE
    assert reused["tokens"] > 0  # the texts with tokens of their own; "" runs the ordinary way in the same call


VARIANTS = {
    "mistral window 16": ("mistral", dict(sliding_window=16)),  # shorter than the prompt alone
    "qwen2 window in layer 1": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "qwen3 q/k norm": ("qwen3", {}),
    "llama grouped heads": ("llama", dict(num_key_value_heads=1)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_windows_and_families_match_plain(st_model, texts, reused, variant):
    family, overrides = VARIANTS[variant]
    plain, fast = load_both(st_model(family, pooling_mode="mean", **overrides))
    expected = plain.encode(texts, prompt=INSTRUCTION, batch_size=8)
    assert max_diff(fast.encode(texts, prompt=INSTRUCTION, batch_size=8), expected) <= TOLERANCE
    assert reused["tokens"] > 0


KERNEL_VARIANTS = {
    **{name: VARIANTS[name] for name in ("mistral window 16", "llama grouped heads")},
    "mistral window 1024": ("mistral", dict(sliding_window=1024)),  # longer than every text: never cuts
}


@pytest.mark.skipif(DEVICE != "cpu", reason="the stand-ins replace the CUDA kernels on the CPU")
@pytest.mark.parametrize("name", kernel_standins.STANDINS)
@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
def test_the_varlen_kernels_take_each_texts_keys_after_the_prompts(standin, st_model, texts, reused, name, variant):
    """bf16 through each kernel release's stand-in: the texts' queries against [prompt keys ; own keys]
    packed with their own boundaries, where the kernel aligns them with the keys' end (all but flash-attn 2.0)
    and takes the window where it cuts (all but PyTorch 2.10 and flash-attn before 2.3); else through SDPA."""
    standin(name)
    family, overrides = KERNEL_VARIANTS[variant]
    _, fast = load_both(st_model(family, pooling_mode="mean", **overrides), model_kwargs={"dtype": torch.bfloat16})
    once = fast.encode(texts, prompt=INSTRUCTION, batch_size=8)
    assert reused["tokens"] > 0
    runtime = fast[0].runtime
    through_sdpa = not runtime.longer_keys or (variant == "mistral window 16" and not runtime.window)
    assert (kernel_standins.Calls.longer_keys == 0) == through_sdpa
    fast.prompt_reuse = False
    every_time = fast.encode(texts, prompt=INSTRUCTION, batch_size=8)
    assert one_minus_cosine(once.astype(np.float32), every_time.astype(np.float32)).max() <= 2e-3


def test_a_text_alone_equals_the_same_text_among_others(st_model, texts):
    _, fast = load_both(st_model("mistral", pooling_mode="weightedmean"))
    together = fast.encode(texts, prompt=INSTRUCTION, batch_size=7)
    alone = np.stack([fast.encode([text], prompt=INSTRUCTION)[0] for text in texts[:8]])
    assert max_diff(together[:8], alone) <= TOLERANCE


def test_prompts_that_merge_with_the_text_and_the_off_switch(st_model, texts, reused):
    """A prompt that ends inside a word: the text's first letters merge with it, deeper than the prompt's
    last token for some texts (found by trying the builders' tokenizer); those run the ordinary way, in the
    same call as texts that reuse the prompt. prompt_reuse = False runs every prompt with its text."""
    prompt = "query: ynbi"
    plain, fast = load_both(st_model("mistral", pooling_mode="mean"), prompts={"query": prompt})
    merged = ["qpmz and more words", "qpmz", "q and more"] + texts
    prefix = fast.prompt_prefix(prompt)
    follows = [prefix.follows(ids) for ids in fast[0].texts.encode(merged, prompt)]
    assert not follows[0] and any(follows)  # both kinds in one call
    expected = plain.encode(merged, prompt_name="query")
    assert max_diff(fast.encode(merged, prompt_name="query"), expected) <= TOLERANCE
    fast.prompt_reuse = False
    before = reused["tokens"]
    assert max_diff(fast.encode(merged, prompt_name="query"), expected) <= TOLERANCE
    assert before > 0 and reused["tokens"] == before


def test_encoders_and_bidirectional_decoders_never_reuse(st_model):
    _, bert = load_both(st_model("bert", pooling_mode="mean"))
    assert bert.prompt_prefix(INSTRUCTION) is None
    gemma = SentenceTransformer(str(st_model("gemma3_text", pooling_mode="mean")), backend="fast", device=DEVICE)
    assert gemma[0].model.spec.causal is False and gemma.prompt_prefix(INSTRUCTION) is None


def test_e5_eos_appended_after_a_reused_prompt(tmp_path, texts, reused):
    """e5-mistral: </s> ends each text, not the prompt; the same embeddings with and without reuse."""
    folder = build_st_model(tmp_path, "mistral", pooling_mode="lasttoken", max_seq_length=64)
    add_e5_tokenizer_contradiction(folder)
    fast = SentenceTransformer(str(folder), backend="fast", device=DEVICE)
    reusing = fast.encode(texts, prompt=INSTRUCTION)
    assert reused["tokens"] > 0
    fast.prompt_reuse = False
    assert max_diff(reusing, fast.encode(texts, prompt=INSTRUCTION)) <= TOLERANCE


def test_the_server_worker_computes_a_shared_prompt_once_per_batch(st_model, texts, monkeypatch):
    """Requests of one batch that share a prompt: one prompt pass for all of them, the embeddings of encode()."""
    model = SentenceTransformer(str(st_model("mistral", pooling_mode="lasttoken")), backend="fast", device=DEVICE)
    embedder = Embedder(model)
    expected = model.encode(texts, prompt=INSTRUCTION, convert_to_tensor=True)
    prompt_passes = []
    prefix_pass = model[0].model.prefix_pass
    monkeypatch.setattr(model[0].model, "prefix_pass", lambda *args: prompt_passes.append(1) or prefix_pass(*args))
    batcher = Batcher(embedder, 100_000, 1000, Metrics())
    jobs = [Job(token_ids=embedder.tokenize([text], INSTRUCTION), prompt=INSTRUCTION) for text in texts]
    futures = [batcher.submit(job) for job in jobs]
    batcher.start()  # all requests are queued: the worker takes them as one batch
    batcher.stop()
    assert len(prompt_passes) == 1
    for future, row in zip(futures, expected, strict=True):
        # the worker's rows are on the host
        torch.testing.assert_close(future.result(timeout=0)[0][0], row.cpu(), atol=TOLERANCE, rtol=0)
