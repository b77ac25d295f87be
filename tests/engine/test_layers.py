"""engine/layers.Linear and engine/onednn.py: the CPU matrix products through oneDNN give the numbers of
F.linear, rebuilt when the weight changes; the engine sets its layers up once per runtime."""

import copy
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import load_both
from transformers.activations import ACT2FN

from st_fastbackend.engine import onednn
from st_fastbackend.engine.decoder import MLP
from st_fastbackend.engine.layers import IN_PLACE, Linear
from st_fastbackend.engine.runtime import choose_runtime
from st_fastbackend.modules import PackedTransformer

pytestmark = pytest.mark.skipif(
    torch.float32 not in onednn.onednn_dtypes(), reason="the oneDNN path runs on x86-64 CPUs with oneDNN"
)


def onednn_linear(*args, **kwargs) -> Linear:
    layer = Linear(*args, **kwargs)
    layer.product_dtype = torch.float32  # as the engine sets it from its runtime on a CPU
    return layer


def test_linear_matches_f_linear_and_follows_weight_changes():
    torch.manual_seed(0)
    layer, x = onednn_linear(64, 48), torch.randn(37, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert layer._packed is not None  # through oneDNN
        layer.weight.mul_(2)  # in place: the reordered copy must be rebuilt
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    layer._packed = None
    layer(x).sum().backward()  # gradients on: plain F.linear, autograd works
    assert layer.weight.grad is not None and layer._packed is None
    layer.to(torch.float64).to(torch.float32)  # moving drops the copies of the old weight
    assert layer._packed is None
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    for clone in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):  # multi-process pools pickle
        with torch.inference_mode():
            torch.testing.assert_close(clone(x), layer(x))


def test_a_copy_in_the_weights_dtype_replaces_the_weight():
    """Where the engine lets it, the dense weight is given back once its copy in the same dtype is made, and is
    rebuilt from the copy, bit for bit, wherever it is needed: state_dict, load_state_dict, pickling, .to(),
    gradients; the same numbers throughout."""
    torch.manual_seed(0)
    layer, x = onednn_linear(64, 48), torch.randn(37, 64)
    layer.releases_weight = True
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    with torch.inference_mode():
        y = layer(x)
    torch.testing.assert_close(y, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.float32  # given back; its dtype kept
    assert torch.equal(layer.state_dict()["weight"], weight) and layer.weight.numel() == 0  # not rebuilt in place
    assert torch.equal(layer.state_dict(keep_vars=True)["weight"], weight)
    clone = pickle.loads(pickle.dumps(layer))  # multi-process pools pickle: the dense weight travels
    assert torch.equal(clone.weight, weight) and torch.equal(layer.weight, weight)
    with torch.inference_mode():
        assert torch.equal(clone(x), y) and torch.equal(layer(x), y) and layer.weight.numel() == 0
    layer.load_state_dict({"weight": 2 * weight, "bias": bias})  # into the rebuilt weight
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, 2 * weight, bias), atol=1e-5, rtol=1e-5)
    layer.load_state_dict({"weight": weight, "bias": bias})
    with torch.inference_mode():
        layer(x)
    layer.to(torch.float64)  # moves the rebuilt weight
    assert torch.equal(layer.weight, weight.double())
    layer.to(torch.float32)
    with torch.inference_mode():
        layer(x)
    layer(x).sum().backward()  # gradients on: F.linear on the rebuilt weight
    assert torch.equal(layer.weight, weight) and layer.weight.grad is not None


@pytest.mark.parametrize("product", [torch.bfloat16, torch.int8])
def test_a_copy_in_another_dtype_keeps_the_weight(product):
    """bf16 or int8 copies of fp32 weights lose digits: the dense weight stays."""
    if product not in (*onednn.onednn_dtypes(), torch.int8):
        pytest.skip("oneDNN runs bf16 natively with AVX-512")
    torch.manual_seed(0)
    layer, x = onednn_linear(64, 48), torch.randn(37, 64)
    layer.releases_weight, layer.product_dtype = True, product
    weight = layer.weight.detach().clone()
    with torch.inference_mode():
        layer(x)
    assert layer._packed is not None and torch.equal(layer.weight, weight)


def test_the_halves_of_a_gated_layer_replace_its_weight():
    """A gated MLP's first layer is copied as two halves: both are made before its weight is given back, and the
    weight is rebuilt from both."""
    torch.manual_seed(0)
    spec = type("Spec", (), dict(hidden_size=64, intermediate_size=96, mlp_bias=True, hidden_act="silu"))
    mlp, x, runtime = MLP(spec), torch.randn(29, 64), choose_runtime("cpu", torch.float32)
    weight = mlp.gate_up_proj.weight.detach().clone()
    with torch.inference_mode():
        expected = mlp(x, runtime)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.product_dtype, layer.releases_weight = torch.float32, True
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x, runtime), expected, atol=1e-5, rtol=1e-5)
    assert mlp.gate_up_proj.weight.numel() == 0 and set(mlp.gate_up_proj._packed) >= {(0, 2), (1, 2)}
    assert torch.equal(mlp.gate_up_proj.state_dict()["weight"], weight)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_fused_gated_mlp_matches_the_unfused_one(bias, act):
    """act(gate) * up inside oneDNN's products equals the two-pass form (Llama's mlp_bias too; Gemma's
    GELU-tanh; ModernBERT's GeGLU)."""
    torch.manual_seed(0)
    spec = type("Spec", (), dict(hidden_size=64, intermediate_size=96, mlp_bias=bias, hidden_act=act))
    mlp, x = MLP(spec), torch.randn(29, 64)
    gate, up = F.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, dim=-1)
    expected = F.linear(ACT2FN[act](gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
    mlp.gate_up_proj.product_dtype = mlp.down_proj.product_dtype = torch.float32
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x, choose_runtime("cpu", torch.float32)), expected, atol=1e-5, rtol=1e-5)
    assert set(mlp.gate_up_proj._packed) == {"key", (0, 2), (1, 2)}  # the two halves' products


@pytest.mark.parametrize("name", sorted(onednn.ACTIVATIONS))
def test_activations_inside_the_product_match_transformers(name):
    """Each activation oneDNN applies inside the product computes transformers' ACT2FN[name]."""
    torch.manual_seed(0)
    layer, x = onednn_linear(64, 96), 3 * torch.randn(41, 64)
    expected = ACT2FN[name](F.linear(x, layer.weight, layer.bias))
    with torch.inference_mode():
        fused = layer.act(x, name)
    assert layer._packed is not None
    torch.testing.assert_close(fused, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(torch.bfloat16 not in onednn.onednn_dtypes(), reason="oneDNN runs bf16 natively with AVX-512")
def test_fp32_layer_multiplies_in_bf16_where_pytorch_allows_it(bf16_products_taken):
    """torch.backends.mkldnn.matmul.fp32_precision = "bf16": the product of the bf16-rounded input and
    weight (fp32 sums), returned in fp32; back to the exact fp32 product when the setting is reset."""
    torch.manual_seed(0)
    layer, x = onednn_linear(64, 96), torch.randn(41, 64)
    rounded = F.linear(x.bfloat16().float(), layer.weight.bfloat16().float(), layer.bias.bfloat16().float())
    before = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        layer.product_dtype = onednn.product_dtype(torch.float32)
        with torch.inference_mode():
            y = layer(x)
        assert y.dtype == torch.float32 and layer.product_dtype == torch.bfloat16
        torch.testing.assert_close(y, rounded, atol=1e-6, rtol=2**-8)  # at most the sums' rounding to bf16
        assert (y - F.linear(x, layer.weight, layer.bias)).abs().max() > 1e-3  # not the fp32 product
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
    layer.product_dtype = onednn.product_dtype(torch.float32)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_the_engine_is_set_up_once_per_runtime(st_model, monkeypatch):
    """At load every Linear takes the runtime's product dtype; encode() does not set them up again; moving
    the model to another dtype does, and back."""
    monkeypatch.setattr(onednn, "fp32_products", lambda: True)  # oneDNN's fp32 products, as on an AVX-512 CPU
    _, fast = load_both(st_model("mistral", pooling_mode="mean"), device="cpu")
    linears = [m for m in fast[0].model.modules() if isinstance(m, Linear)]
    assert linears and all(m.product_dtype == torch.float32 for m in linears)
    calls, use = [], PackedTransformer._use
    monkeypatch.setattr(PackedTransformer, "_use", lambda self, runtime: calls.append(runtime) or use(self, runtime))
    fast.encode(["one text", "another, longer text"] * 3, batch_size=2)
    assert calls == []
    fast.to(torch.float64).to(torch.float32)
    assert [runtime.product_dtype for runtime in calls] == [None, torch.float32]
    fast.encode(["one text"])
    assert len(calls) == 2


def test_the_engine_keeps_one_copy_of_its_weights(st_model, monkeypatch):
    """After encode() the engine's matrix weights live only in their reordered copies (fp32 products of fp32
    weights): the model's state_dict is still every weight as loaded, and moving it and back gives the same
    numbers."""
    monkeypatch.setattr(onednn, "fp32_products", lambda: True)
    plain, fast = load_both(st_model("bert", pooling_mode="mean"), device="cpu")
    loaded = {name: tensor.clone() for name, tensor in fast.state_dict().items()}
    texts = ["a short text", "another text, longer than the first one"]
    embeddings = fast.encode(texts)
    np.testing.assert_allclose(embeddings, plain.encode(texts), atol=1e-5, rtol=0)
    linears = [m for m in fast[0].model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.numel() == 0 for m in linears)
    state = fast.state_dict()
    assert state.keys() == loaded.keys() and all(torch.equal(state[name], loaded[name]) for name in loaded)
    fast.to(torch.float64).to(torch.float32)
    np.testing.assert_array_equal(fast.encode(texts), embeddings)


@pytest.mark.skipif(torch.bfloat16 not in onednn.onednn_dtypes(), reason="oneDNN runs bf16 natively with AVX-512")
def test_no_reordered_copies_where_memory_is_short(st_model, monkeypatch, bf16_products_taken):
    """bf16 copies kept beside fp32 weights would take more than a quarter of the free memory: PyTorch's
    product, same numbers."""
    monkeypatch.setattr(onednn, "free_memory_bytes", lambda: 1024)
    before, torch.backends.mkldnn.matmul.fp32_precision = torch.backends.mkldnn.matmul.fp32_precision, "bf16"
    try:  # bf16 products at load, where the copies are chosen; fp32 products on both sides after
        plain, fast = load_both(st_model("mistral", pooling_mode="mean"), device="cpu")
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
    linears = [m for m in fast[0].model.modules() if isinstance(m, Linear)]
    assert not fast[0].onednn_copies and fast[0].runtime.product_dtype is None
    assert linears and not any(m.product_dtype for m in linears)
    texts = ["a short text", "another text, longer than the first one"]
    np.testing.assert_allclose(fast.encode(texts), plain.encode(texts), atol=1e-5, rtol=0)
    assert all(m._packed is None for m in linears)


def test_products_run_on_a_bounded_set_of_row_counts():
    """oneDNN keeps a compiled primitive per product shape: token counts are rounded up to at most 70
    row counts up to 8,192, adding at most 15 rows or 12.5%; from 2 to 15 rows nothing is added."""
    counts = {rows: onednn.product_rows(rows) for rows in range(1, 8193)}
    assert len(set(counts.values())) <= 70
    assert all(rows <= padded <= max(rows + 15, rows * 1.125) for rows, padded in counts.items())
    assert all(onednn.product_rows(padded) == padded for padded in counts.values())
    assert [counts[rows] for rows in range(1, 17)] == [2, *range(2, 17)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs", [64, 1536])
def test_a_rows_product_does_not_depend_on_the_rows_multiplied_with_it(inputs, dtype, monkeypatch):
    """A row's product has the same bits whatever the number of rows oneDNN multiplies with it, padded or not
    (activation and gated forms too; fp32, and bf16 where oneDNN runs it, as an fp32 model's bf16 products do): from
    2 rows up to 320, so one row goes in as two. Alone oneDNN sums a row in another order (a matrix-vector kernel:
    1e-6 apart here at 1,536 inputs, 1e-4 with unit-variance weights, on a Zen 4). Before PyTorch 2.13 only within
    an ulp: torch 2.11's oneDNN on an AVX2 CPU multiplies 100 rows with other sums than 300 (the GPU image's twin)."""
    if dtype not in onednn.onednn_dtypes():
        pytest.skip("oneDNN does not run bf16 on this CPU")
    torch.manual_seed(0)
    layer, x = onednn_linear(inputs, 384), torch.randn(300, inputs)
    layer.product_dtype = dtype
    padded, seen = onednn.padded, set()
    monkeypatch.setattr(onednn, "padded", lambda x, dtype: seen.add(len(out := padded(x, dtype))) or out)

    def forms(x: torch.Tensor) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [layer(x), layer.act(x, "gelu"), layer.silu_mul(x)]

    together = forms(x)
    bitwise = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)
    for rows in (1, 2, 3, 9, 15, 16, 17, 100, 129, 257):
        start = (7 * rows) % (len(x) - rows + 1)
        for a, t in zip(forms(x[start : start + rows]), together, strict=True):
            b = t[start : start + rows]
            assert torch.equal(a, b) if bitwise else (a - b).abs().max() <= 1e-6, rows
    assert seen == {2, 3, 9, 15, 16, 32, 112, 144, 288, 320}


def test_pytorch_products_change_no_number_with_the_row_count():
    """PyTorch's own CPU product (where fp32 products do not run through oneDNN, or oneDNN's copies do not fit) gives
    a row the same bits whatever number of rows it is multiplied with: fewer than 16 rows are padded to 16, and
    from 12 rows on MKL sums each row in one order (it sums 1 to 11 rows in others, up to 3e-05 apart here)."""
    torch.manual_seed(0)
    layer, x = Linear(384, 1536), torch.randn(2100, 384)
    with torch.inference_mode():
        assert layer.product_dtype is None
        whole = layer(x)
        for rows in (*range(1, 40), 64, 100, 129, 257, 300, 511, 1000, 2047, 2100):
            start = (7 * rows) % (len(x) - rows + 1)
            assert torch.equal(layer(x[start : start + rows]), whole[start : start + rows]), rows
        assert torch.equal(layer(x[5]), whole[5])  # one row, no row dimension


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_in_place_are_transformers_own(dtype):
    """Where PyTorch multiplies, the activation after the product runs in place: the same bits as ACT2FN."""
    torch.manual_seed(0)
    layer, x = Linear(64, 96).to(dtype), torch.randn(40, 64, dtype=dtype) * 3
    for name in IN_PLACE:
        with torch.inference_mode():
            assert torch.equal(layer.act(x, name), ACT2FN[name](F.linear(x, layer.weight, layer.bias))), name


@pytest.mark.parametrize("said", ["", "0", "1", "yes"])
def test_fp32_products_through_onednn_where_pytorch_runs_avx512(said, monkeypatch):
    """oneDNN's fp32 products where PyTorch's CPU capability is AVX-512, PyTorch's own (MKL) elsewhere;
    ST_FASTBACKEND_ONEDNN_FP32 says it for every model, and anything but 0 or 1 there is an error that names it."""
    monkeypatch.setenv("ST_FASTBACKEND_ONEDNN_FP32", said)
    if said == "yes":
        with pytest.raises(ValueError, match="ST_FASTBACKEND_ONEDNN_FP32='yes'"):
            onednn.fp32_products.__wrapped__()
        return
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert onednn.fp32_products.__wrapped__() == (said == "1" or (said == "" and avx512))
    monkeypatch.setattr(onednn, "fp32_products", lambda: said == "1")
    assert onednn.product_dtype(torch.float32) == (torch.float32 if said == "1" else None)


def test_a_product_takes_a_buffer_with_room_as_it_stands():
    """An input that is the first rows of a larger buffer in the product dtype (a product's own output, attention's
    result on a CPU) is multiplied in place, the buffer's next rows appended as they stand: NaN there changes no
    number. An input without room is copied, with zero rows appended."""
    torch.manual_seed(0)
    layer, second, x = onednn_linear(64, 96), onednn_linear(96, 32), torch.randn(100, 64)
    buffer = torch.full((112, 64), float("nan"))
    buffer[:100] = x
    assert onednn.padded(buffer[:100], torch.float32).data_ptr() == buffer.data_ptr()
    assert onednn.padded(x, torch.float32).data_ptr() != x.data_ptr()
    assert torch.equal(onednn.padded(x, torch.float32)[100:], torch.zeros(12, 64))
    with torch.inference_mode():
        assert torch.equal(layer(buffer[:100]), layer(x))
        assert torch.equal(layer.act(buffer[:100], "gelu"), layer.act(x, "gelu"))
        hidden = layer.act(x, "gelu")  # [100, 96], the first rows of the product's [112, 96]
        assert onednn.has_room(hidden, 112)
        assert torch.equal(second(hidden), second(hidden.clone()))
    empty = onednn.with_room((100, 4, 8), x)
    assert empty.shape == (100, 4, 8) and onednn.has_room(empty.flatten(1), 112)
    assert torch.equal(empty.as_strided((112, 4, 8), empty.stride())[100:], torch.zeros(12, 4, 8))
