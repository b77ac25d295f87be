"""The layer seams compiled by torch.compile (engine/fused.py): the eager seams' numbers, plain
sentence-transformers' numbers through whole models, used only for packs large enough, on by default on
CUDA only, and switched by model[0].compiled_seams or ST_FASTBACKEND_COMPILE. The models of this module
load with ST_FASTBACKEND_COMPILE=1, so they run compiled on the CPU too."""

import collections
import logging

import pytest
import torch
from helpers import DEVICE, TOLERANCE, assert_bf16_error_within_twice_plain, load_both, max_diff
from transformers.activations import ACT2FN

from st_fastbackend import SentenceTransformer
from st_fastbackend.engine import fused

T = fused.MIN_TOKENS + 37  # a pack size the compiled seams run for, not a round number


@pytest.fixture(autouse=True)
def compiled_everywhere(monkeypatch):
    monkeypatch.setenv("ST_FASTBACKEND_COMPILE", "1")


def seam_inputs(dtype):
    """Inputs for each seam at Mistral-like (and Qwen3/Gemma-like) shapes, on the suite's device."""
    torch.manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device=DEVICE).to(dtype)

    heads = (4, 2, 32)
    cos, sin = r(T, 32), r(T, 32)
    qk_norm = (r(32), r(32), 1e-6, True)
    return {
        "rms_norm": [(r(T, 128), r(128), 1e-6, False), (r(T, 128), r(128), 1e-6, True)],
        "residual_rms": [
            (r(T, 128), r(T, 128), None, r(128), 1e-5, False),  # Llama
            (r(T, 128), r(T, 128), r(128), r(128), 1e-6, True),  # Gemma
        ],
        "residual_layer_norm": [(r(T, 96), r(T, 96), r(96), None, 1e-5), (r(T, 96), r(T, 96), r(96), r(96), 1e-12)],
        "add_layer_norm": [(r(T, 96), r(T, 96), r(96), r(96), 1e-12)],
        "split_rotate": [(r(T, 8 * 32), cos, sin, heads, None), (r(T, 8 * 32), cos, sin, heads, qk_norm)],
        "gated": [(r(T, 2 * 48), ACT2FN["silu"]), (r(T, 2 * 48), ACT2FN["gelu_pytorch_tanh"])],
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_compiled_seam_matches_the_eager_one(dtype):
    compiled = fused.seams(True)
    for name, cases in seam_inputs(dtype).items():
        for args in cases:
            expected, got = (_tuple(getattr(seams, name)(*args)) for seams in (fused.EAGER, compiled))
            for e, g in zip(expected, got, strict=True):
                assert g.shape == e.shape and g.dtype == e.dtype, name
                # fp32: reduction order only; bf16: the compiled seam rounds once where eager rounds per op
                tolerance = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
                torch.testing.assert_close(g, e, **tolerance, msg=name)


def _tuple(out) -> tuple:
    return (out,) if torch.is_tensor(out) else out


@pytest.fixture
def compiled_calls(monkeypatch):
    """Counts the calls of each compiled seam."""
    counts: collections.Counter = collections.Counter()
    call = fused._Timed.__call__

    def counting(self, *args):
        counts[self.fn.__name__] += 1
        return call(self, *args)

    monkeypatch.setattr(fused._Timed, "__call__", counting)
    return counts


FAMILIES = {  # family -> the seams its layers go through
    "mistral": {"rms_norm", "residual_rms", "split_rotate"},
    "qwen3": {"rms_norm", "residual_rms", "split_rotate"},
    "gemma3_text": {"rms_norm", "residual_rms", "split_rotate"},
    "modernbert": {"residual_layer_norm", "split_rotate"},
    "bert": {"add_layer_norm"},
    "distilbert": {"add_layer_norm"},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_models_with_compiled_seams_match_plain(st_model, texts, family, compiled_calls):
    plain, fast = load_both(st_model(family, pooling_mode="mean"))
    assert fast[0].runtime.fused
    assert max_diff(plain.encode(texts, batch_size=16), fast.encode(texts, batch_size=16)) <= TOLERANCE
    assert FAMILIES[family] <= set(compiled_calls)  # the packs of 16 texts ran compiled


def test_bf16_error_bound_with_compiled_seams(st_model, texts, compiled_calls):
    assert_bf16_error_within_twice_plain(st_model("qwen3", pooling_mode="mean"), texts)
    assert compiled_calls["residual_rms"] > 0


def test_small_packs_and_the_off_switches_run_eagerly(st_model, texts, compiled_calls, monkeypatch):
    folder = st_model("mistral", pooling_mode="mean")
    model = SentenceTransformer(str(folder), backend="fast", device=DEVICE)
    small = model.encode(texts[:3])  # a few short texts: one pack under MIN_TOKENS
    assert sum(compiled_calls.values()) == 0
    on = model.encode(texts, batch_size=16)
    assert sum(compiled_calls.values()) > 0

    compiled_calls.clear()
    model[0].compiled_seams = False
    assert not model[0].runtime.fused and "layer seams eager" in str(model[0].runtime)
    off = model.encode(texts, batch_size=16)
    assert sum(compiled_calls.values()) == 0
    assert max_diff(on, off) <= TOLERANCE and max_diff(small, off[:3]) <= TOLERANCE

    monkeypatch.setenv("ST_FASTBACKEND_COMPILE", "0")
    assert not SentenceTransformer(str(folder), backend="fast", device=DEVICE)[0].runtime.fused


def test_compiled_by_default_on_cuda_only_and_the_environment_overrides(st_model, monkeypatch):
    monkeypatch.delenv("ST_FASTBACKEND_COMPILE")
    assert fused.on_by_default("cuda") and not fused.on_by_default("cpu")
    model = SentenceTransformer(str(st_model("mistral", pooling_mode="mean")), backend="fast", device=DEVICE)
    assert model[0].compiled_seams is None and model[0].runtime.fused == (torch.device(DEVICE).type == "cuda")
    model[0].compiled_seams = True  # the caller's choice, on any device
    assert model[0].runtime.fused
    for said, on in (("1", True), ("0", False)):
        monkeypatch.setenv("ST_FASTBACKEND_COMPILE", said)
        assert fused.on_by_default("cpu") == fused.on_by_default("cuda") == on
    monkeypatch.setenv("ST_FASTBACKEND_COMPILE", "off")
    with pytest.raises(ValueError, match="ST_FASTBACKEND_COMPILE='off': 1 turns"):
        fused.on_by_default("cpu")


def test_a_failed_compilation_leaves_the_eager_seam(caplog):
    seam = fused._Timed(fused.gated)

    def refuse(*args):
        raise RuntimeError("no C++ compiler")

    seam.compiled = refuse
    x = torch.randn(T, 64)
    with caplog.at_level(logging.WARNING, logger="st_fastbackend.engine.fused"):
        torch.testing.assert_close(seam(x, ACT2FN["silu"]), fused.gated(x, ACT2FN["silu"]), atol=0, rtol=0)
    assert "no C++ compiler" in caplog.text and seam.failed


def test_past_the_recompile_limit_a_new_variant_runs_eagerly():
    """PyTorch compiles a function for at most `recompile_limit` variants (here inputs of another rank);
    past it, no error: the eager result."""
    seam = fused._Timed(fused.add_layer_norm)
    with torch._dynamo.config.patch(recompile_limit=1):
        for shape in ((T, 64), (T, 3, 64), (T, 2, 3, 64)):
            args = (torch.randn(shape), torch.randn(shape), torch.ones(64), None, 1e-5)
            torch.testing.assert_close(seam(*args), fused.add_layer_norm(*args), atol=1e-5, rtol=1e-5)


def rms_norm_for_counting(x, weight, eps, unit_offset):
    """fused.rms_norm under code of its own: Dynamo counts compilations per code object."""
    return fused.rms_norm(x, weight, eps, unit_offset)


def split_rotate_for_counting(qkv, cos, sin, heads, qk_norm):
    return fused.split_rotate(qkv, cos, sin, heads, qk_norm)


@pytest.mark.slow
def test_model_widths_share_one_compiled_variant():
    """Weights arrive as nn.Parameter, whose shapes Dynamo keeps static: without care one compilation per width."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    seam = fused._Timed(rms_norm_for_counting)
    seam.compiled = torch.compile(rms_norm_for_counting, dynamic=True, backend=counter)
    for width in (64, 96, 128):
        x, weight = torch.randn(T, width), torch.nn.Parameter(torch.randn(width))
        torch.testing.assert_close(seam(x, weight, 1e-6, False), fused.rms_norm(x, weight, 1e-6, False))
    assert counter.frame_count == 1
    # q/k norm weights arrive inside a tuple (Qwen3, Gemma 3): head sizes 16 and 32 share one variant too
    counter = CompileCounter()
    seam = fused._Timed(split_rotate_for_counting)
    seam.compiled = torch.compile(split_rotate_for_counting, dynamic=True, backend=counter)
    for head_dim in (16, 32):
        qk_norm = (torch.nn.Parameter(torch.randn(head_dim)), torch.nn.Parameter(torch.randn(head_dim)), 1e-6, True)
        args = (torch.randn(T, 8 * head_dim), torch.randn(T, head_dim), torch.randn(T, head_dim), (4, 2, head_dim))
        for got, expected in zip(seam(*args, qk_norm), fused.split_rotate(*args, qk_norm), strict=True):
            torch.testing.assert_close(got, expected)
    assert counter.frame_count == 1


def test_a_pack_past_int32_indexing_runs_in_parts(monkeypatch):
    """Inductor would compile a seam again for buffers of 2**31 elements or more (64-bit indexing): such a pack
    runs as several calls under the bound, with the eager numbers (shown with a bound of 10,000 elements)."""
    monkeypatch.setattr(fused, "MAX_ELEMENTS", 10_000)
    shapes = []
    for name, make in [("gated", lambda: (torch.randn(T, 96), ACT2FN["silu"])),
                       ("split_rotate", lambda: (torch.randn(T, 8 * 32), torch.randn(T, 32), torch.randn(T, 32),
                                                 (4, 2, 32), None))]:  # fmt: skip
        seam, args = fused._Timed(getattr(fused, name)), make()
        seam.compiled = lambda *a, fn=seam.fn: shapes.append([t.numel() for t in a if torch.is_tensor(t)]) or fn(*a)
        for got, expected in zip(_tuple(seam(*args)), _tuple(getattr(fused, name)(*args)), strict=True):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert len(shapes) > 2 and max(max(numels) for numels in shapes) < 10_000


def test_running_out_of_memory_is_raised_and_compiling_goes_on():
    """The schedule halves a pack that runs out of memory: the error must reach it, at the first call, at a
    later one, or inside a compiler's error, and the seam stays compiled."""
    seam = fused._Timed(fused.gated)
    x = torch.randn(T, 64)

    def wrapped(*args):
        """As Dynamo raises BackendCompilerFailed(...) from None: the error it wraps is left as __context__."""
        try:
            raise torch.OutOfMemoryError("while benchmarking")
        except torch.OutOfMemoryError:
            raise RuntimeError("BackendCompilerFailed") from None

    for fail in (lambda *args: (_ for _ in ()).throw(torch.OutOfMemoryError("injected")), wrapped):
        seam.compiled = fail
        with pytest.raises(torch.OutOfMemoryError):
            seam(x, ACT2FN["silu"])
        assert not seam.failed


def test_a_failed_recompilation_leaves_the_eager_seam(caplog):
    """A compilation that fails after the first call (a new shape, a guard that fails) does not fail encode()."""
    seam = fused._Timed(fused.gated)
    x = torch.randn(T, 64)
    seam(x, ACT2FN["silu"])  # compiled
    seam.compiled = lambda *args: (_ for _ in ()).throw(RuntimeError("recompilation failed"))
    with caplog.at_level(logging.WARNING, logger="st_fastbackend.engine.fused"):
        torch.testing.assert_close(seam(x, ACT2FN["silu"]), fused.gated(x, ACT2FN["silu"]), atol=0, rtol=0)
    assert "recompilation failed" in caplog.text and seam.failed
