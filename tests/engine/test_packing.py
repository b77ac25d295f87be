"""Token-budget packing in encode(): bounds hold, the caller's order and values are unchanged."""

import numpy as np
import pytest
import torch
from helpers import DEVICE
from transformers import DistilBertConfig, MistralConfig

import st_fastbackend.models.fast
from st_fastbackend import SentenceTransformer
from st_fastbackend.embedder import Embedder
from st_fastbackend.engine import schedule
from st_fastbackend.engine.batch import plan_batches
from st_fastbackend.models.host_rows import HostRows
from st_fastbackend.serve.batcher import Batcher, Job
from st_fastbackend.serve.metrics import Metrics


def test_plan_batches_bounds_texts_and_tokens():
    lengths = [50, 40, 40, 30, 9, 9, 9, 9, 9, 1]
    batches = plan_batches(lengths, max_texts=3, max_tokens=60)
    assert [list(b) for b in batches] == [[0], [1], [2], [3, 4, 5], [6, 7, 8], [9]]
    assert plan_batches([500, 3], max_texts=8, max_tokens=100) == [range(0, 1), range(1, 2)]  # too long: alone
    assert plan_batches([], max_texts=8, max_tokens=100) == []


@pytest.fixture(scope="module")
def model(st_model):
    return SentenceTransformer(str(st_model("qwen2", pooling_mode="mean")), backend="fast", device=DEVICE)


def record_batches(model):
    seen = []
    handle = model[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]["packed"].lengths))
    return seen, handle


def test_a_pack_mixing_sequences_with_and_without_token_types_is_refused():
    from st_fastbackend.engine.batch import PackedBatch, Tokens

    with pytest.raises(ValueError, match="some with token types and some without"):
        PackedBatch.from_tokens([Tokens([1, 2], [0, 0]), Tokens([3])])
    assert PackedBatch.from_tokens([Tokens([1, 2], [0, 1]), Tokens([3], [0])]).token_type_ids.tolist() == [0, 1, 0]


def test_cpu_packs_fill_the_token_budget_whatever_batch_size(model, texts):
    """On a CPU batch_size does not cap a pack (each pack's fixed cost tells on short texts); the token budget does.
    Elsewhere a pack holds at most batch_size texts, as in plain sentence-transformers. The numbers are the same."""
    reference = model.encode(texts, batch_size=len(texts))
    seen, handle = record_batches(model)
    try:
        out = model.encode(texts, batch_size=2)
    finally:
        handle.remove()
    np.testing.assert_allclose(out, reference, atol=1e-5, rtol=0)
    widest = max(len(lengths) for lengths in seen)
    assert widest > 2 if model.device.type == "cpu" else widest <= 2
    assert schedule.texts_per_pack(2, torch.device("cpu")) == schedule.CPU_PACK_TEXTS
    assert schedule.texts_per_pack(2, torch.device("cuda")) == 2
    assert schedule.texts_per_pack(10_000, torch.device("cpu")) == 10_000


@pytest.mark.slow
@pytest.mark.parametrize("budget, batch_size", [(64, 32), (300, 4), (100_000, 1000)])
def test_encode_respects_the_budget_and_keeps_order(model, texts, monkeypatch, budget, batch_size):
    monkeypatch.setattr(st_fastbackend.models.fast, "TOKENIZE_CHUNK", 7)  # several tokenizer chunks
    reference = np.stack([model.encode(text) for text in texts])
    seen, handle = record_batches(model)
    try:
        out = model.encode(texts, batch_size=batch_size, max_tokens_per_batch=budget)
    finally:
        handle.remove()
    np.testing.assert_allclose(out, reference, atol=1e-5, rtol=0)
    assert sum(len(lengths) for lengths in seen) == len(texts)
    for lengths in seen:
        assert len(lengths) <= schedule.texts_per_pack(batch_size, model.device)
        assert sum(lengths) <= budget or len(lengths) == 1
        assert list(lengths) == sorted(lengths, reverse=True)  # sorted by token length within a chunk


@pytest.mark.slow
def test_budget_is_a_model_property(model, texts):
    dtype = next(model[0].parameters()).dtype
    assert model.max_tokens_per_batch == schedule.default_max_tokens(model[0].config, dtype, model.device)
    if DEVICE == "cpu":
        assert model.max_tokens_per_batch == schedule.CPU_TOKENS
    model.max_tokens_per_batch = 50
    seen, handle = record_batches(model)
    try:
        model.encode(texts)
    finally:
        handle.remove()
        model.max_tokens_per_batch = None
    assert all(sum(lengths) <= 50 or len(lengths) == 1 for lengths in seen)
    with pytest.raises(ValueError):
        model.max_tokens_per_batch = 0


def test_error_names_the_callers_index_across_chunks(st_model, monkeypatch):
    """A text with no tokens at all (possible with tokenizers that add no special tokens)."""
    monkeypatch.setattr(st_fastbackend.models.fast, "TOKENIZE_CHUNK", 3)
    model = SentenceTransformer(str(st_model("qwen2", pooling_mode="mean")), backend="fast", device=DEVICE)
    monkeypatch.setattr(model[0].texts, "_token_ids", lambda texts, max_length: [[5] if t else [] for t in texts])
    with pytest.raises(ValueError, match="Input 4 "):
        model.encode(["a", "b", "c", "d", "", "f"])


def test_out_of_memory_splits_the_pack_and_keeps_the_learned_budget(model, texts, monkeypatch):
    """CUDA out-of-memory, injected on the CPU: packs over 150 tokens fail; nothing is lost or reordered."""
    reference = model.encode(texts, batch_size=16)
    real_forward = model.forward_sequences
    attempts = []

    def forward(sequences, *args, **kwargs):
        tokens = sum(len(ids) for ids in sequences)
        attempts.append((tokens, len(sequences)))
        if tokens > 150 and len(sequences) > 1:
            raise torch.OutOfMemoryError("injected")
        return real_forward(sequences, *args, **kwargs)

    monkeypatch.setattr(model, "forward_sequences", forward)
    out = model.encode(texts, batch_size=16)
    np.testing.assert_allclose(out, reference, atol=1e-5, rtol=0)
    assert any(tokens > 150 for tokens, n in attempts)  # the injection did fire
    budget = None  # the budget learned so far: every later pack of several texts stays within it
    for tokens, n in attempts:
        assert budget is None or n == 1 or tokens <= budget
        if tokens > 150 and n > 1:
            budget = tokens // 2


def test_a_single_text_that_does_not_fit_is_an_error(model, monkeypatch):
    def forward(*args, **kwargs):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(model, "forward_sequences", forward)
    with pytest.raises(torch.OutOfMemoryError):
        model.encode(["one text"])


def test_server_worker_splits_a_pack_that_runs_out_of_memory(model, texts, monkeypatch):
    """The same back-off in the server's worker: every queued request still gets its own embedding."""
    reference = model.encode(texts, convert_to_tensor=True)
    real_forward = model.forward_sequences
    failures = []

    def forward(sequences, *args, **kwargs):
        if sum(len(ids) for ids in sequences) > 150 and len(sequences) > 1:
            failures.append(len(sequences))
            raise torch.OutOfMemoryError("injected")
        return real_forward(sequences, *args, **kwargs)

    monkeypatch.setattr(model, "forward_sequences", forward)
    batcher = Batcher(Embedder(model), 100_000, 1000, Metrics())
    futures = [batcher.submit(Job(token_ids=model[0].texts.encode([text]), prompt=None)) for text in texts]
    batcher.start()  # all requests are queued: the worker takes them as one batch
    batcher.stop()
    assert failures
    for future, expected in zip(futures, reference, strict=True):
        ((row, _),) = future.result(timeout=0)
        torch.testing.assert_close(row, expected.cpu(), atol=1e-5, rtol=0)  # the worker's rows are on the host


def test_gpu_budget_comes_from_free_memory(monkeypatch):
    """The CUDA default, with the memory queries answered as an H200 holding a 7B bf16 model would."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (120 * gib, 139 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 16 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 14 * gib)
    config = MistralConfig(hidden_size=4096, intermediate_size=14336)
    budget = schedule.cuda_max_tokens(config, torch.bfloat16, torch.device("cuda"))
    per_token = 4 * (4096 + 14336) * 2  # bytes of the largest activations of a layer
    assert 32768 * 8 <= budget <= 122 * gib / 2 / per_token  # a few 32k-token texts per pack, half the memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (gib // 4, 139 * gib))
    small = schedule.cuda_max_tokens(config, torch.bfloat16, torch.device("cuda"))
    assert small == schedule.MIN_GPU_TOKENS


def test_gpu_budget_reads_distilberts_mlp_width(monkeypatch):
    """DistilBertConfig names the MLP width hidden_dim, and has no intermediate_size."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    config = DistilBertConfig(dim=768, hidden_dim=3072)
    budget = schedule.cuda_max_tokens(config, torch.float16, torch.device("cuda"))
    assert budget == 30 * gib // (4 * (768 + 3072) * 2)


class CopyDone:
    """Stands for a CUDA event: records when the host waits for it, and on which queue it was recorded."""

    waited: list = []
    queues: list = []

    def record(self, stream) -> None:
        self.waited.append(False)
        self.queues.append(stream)
        self.index = len(self.waited) - 1

    def synchronize(self) -> None:
        self.waited[self.index] = True


def test_rows_from_a_gpu_leave_pinned_memory_a_few_packs_behind():
    """encode() on a GPU copies each pack's rows to pinned host memory without waiting; they move to ordinary
    memory once copied, so at most HostRows.DEPTH packs are pinned at any time, whatever the call's size."""
    CopyDone.waited, CopyDone.queues = [], []
    results: list = [None] * 40
    landing = HostRows(results, torch.device("cuda", 1), event=CopyDone, stream=lambda device: f"queue of {device}")
    packs = [torch.randn(4, 8) for _ in range(10)]  # stand-ins for the pinned rows of 10 packs
    for n, rows in enumerate(packs):
        landing.add(list(range(4 * n, 4 * n + 4)), rows)
        assert len(landing.pending) <= HostRows.DEPTH
        assert CopyDone.waited[: max(0, n + 1 - HostRows.DEPTH)] == [True] * max(0, n + 1 - HostRows.DEPTH)
    landing.finish()
    assert all(CopyDone.waited) and not landing.pending
    assert set(CopyDone.queues) == {"queue of cuda:1"}  # the model's GPU, whichever device is current
    assert torch.equal(torch.stack(results), torch.cat(packs))
    assert all(results[4 * n].data_ptr() != packs[n].data_ptr() for n in range(10))  # copies, not the pinned rows


def test_a_packs_rows_of_several_lengths_land_split():
    """A MultiVectorEncoder's pack: every text's rows in one tensor, copied once, split as it lands (a text may keep
    no rows)."""
    CopyDone.waited, CopyDone.queues = [], []
    results: list = [None] * 3
    landing = HostRows(results, torch.device("cuda", 0), event=CopyDone, stream=lambda device: device)
    rows = torch.randn(7, 8)
    landing.add([2, 0, 1], rows, counts=[3, 0, 4])
    landing.finish()
    assert [tuple(r.shape) for r in results] == [(0, 8), (4, 8), (3, 8)]
    assert torch.equal(torch.cat([results[2], results[0], results[1]]), rows) and CopyDone.waited == [True]
