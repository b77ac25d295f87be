"""The CPU matrix products through oneDNN: the numbers of F.linear, rebuilt when the weight changes."""

import copy
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import load_both
from transformers.activations import ACT2FN

from st_fastbackend.engine import layers
from st_fastbackend.engine.decoder import MLP
from st_fastbackend.engine.layers import Linear, _onednn_dtypes

pytestmark = pytest.mark.skipif(
    torch.float32 not in _onednn_dtypes(), reason="the oneDNN path runs on x86-64 CPUs with oneDNN"
)


def test_linear_matches_f_linear_and_follows_weight_changes():
    torch.manual_seed(0)
    layer, x = Linear(64, 48), torch.randn(37, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert layer.uses_onednn()
        layer.weight.mul_(2)  # in place: the reordered copy must be rebuilt
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert not layer.uses_onednn()  # gradients on: plain F.linear, autograd works
    layer(x).sum().backward()
    assert layer.weight.grad is not None
    with torch.inference_mode():
        layer(x)
    assert layer._prepacked is not None
    layer.to(torch.float64).to(torch.float32)  # moving drops the copies of the old weight
    assert layer._prepacked is None
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    for clone in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):  # multi-process pools pickle
        with torch.inference_mode():
            torch.testing.assert_close(clone(x), layer(x))


@pytest.mark.parametrize("bias", [False, True])
def test_fused_gated_mlp_matches_the_unfused_one(bias):
    """SiLU(gate) * up inside oneDNN's products equals the two-pass form (Llama's mlp_bias too)."""
    torch.manual_seed(0)
    spec = type("Spec", (), dict(hidden_size=64, intermediate_size=96, mlp_bias=bias))
    mlp, x = MLP(spec), torch.randn(29, 64)
    gate, up = F.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
    with torch.inference_mode():
        assert mlp.gate_up_proj.uses_onednn()
        torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(layers.ONEDNN_ACTIVATIONS))
def test_activations_inside_the_product_match_transformers(name):
    """Each activation oneDNN applies inside the product computes transformers' ACT2FN[name]."""
    torch.manual_seed(0)
    layer, x = Linear(64, 96), 3 * torch.randn(41, 64)
    expected = ACT2FN[name](F.linear(x, layer.weight, layer.bias))
    with torch.inference_mode():
        fused = layer.product(x, activation=name)
    torch.testing.assert_close(fused, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(torch.bfloat16 not in _onednn_dtypes(), reason="oneDNN runs bf16 natively with AVX-512 only")
def test_fp32_layer_multiplies_in_bf16_where_pytorch_allows_it():
    """torch.backends.mkldnn.matmul.fp32_precision = "bf16": the product of the bf16-rounded input and
    weight (fp32 sums), returned in fp32; back to the exact fp32 product when the setting is reset."""
    torch.manual_seed(0)
    layer, x = Linear(64, 96), torch.randn(41, 64)
    rounded = F.linear(x.bfloat16().float(), layer.weight.bfloat16().float(), layer.bias.bfloat16().float())
    before = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        with torch.inference_mode():
            y = layer(x)
        assert y.dtype == torch.float32 and layer.product_dtype() == torch.bfloat16
        torch.testing.assert_close(y, rounded, atol=1e-6, rtol=2**-8)  # at most the sums' rounding to bf16
        assert (y - F.linear(x, layer.weight, layer.bias)).abs().max() > 1e-3  # not the fp32 product
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_no_reordered_copies_where_memory_is_short(st_model, monkeypatch):
    """The copies would take more than a quarter of the free memory: PyTorch's product, same numbers."""
    monkeypatch.setattr(layers, "free_memory_bytes", lambda: 1024)
    plain, fast = load_both(st_model("mistral", pooling_mode="mean"))
    linears = [m for m in fast[0].model.modules() if isinstance(m, Linear)]
    assert linears and not any(m.reorder for m in linears)
    texts = ["a short text", "another text, longer than the first one"]
    np.testing.assert_allclose(fast.encode(texts), plain.encode(texts), atol=1e-5, rtol=0)
    assert all(m._prepacked is None for m in linears)


def test_products_run_on_a_bounded_set_of_row_counts():
    """oneDNN keeps a compiled primitive per product shape: token counts are rounded up to at most 56
    row counts up to 8,192, adding at most 15 rows or 12.5%."""
    counts = {rows: layers.product_rows(rows) for rows in range(1, 8193)}
    assert len(set(counts.values())) <= 56
    assert all(rows <= padded <= max(rows + 15, rows * 1.125) for rows, padded in counts.items())
    assert all(layers.product_rows(padded) == padded for padded in counts.values())


def test_padded_rows_change_no_number(monkeypatch):
    """A row's product does not depend on how many rows oneDNN multiplies with it: the products of
    padded inputs equal those of the exact row count bit for bit (activation and gated forms too)."""
    torch.manual_seed(0)
    layer, x, other = Linear(64, 96), torch.randn(300, 64), torch.randn(300, 48)
    row_counts = (1, 2, 15, 17, 100, 129, 257, 300)

    def products() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [
                product
                for rows in row_counts
                for product in (
                    layer(x[:rows]),
                    layer.product(x[:rows], activation="gelu"),
                    layer.product(x[:rows], 1, 2, multiply=other[:rows]),
                )
            ]

    padded, seen = layers.padded, set()
    monkeypatch.setattr(layers, "padded", lambda x, dtype: seen.add(len(out := padded(x, dtype))) or out)
    results, reached = products(), set(seen)  # the row counts that reached oneDNN
    monkeypatch.setattr(layers, "product_rows", lambda rows: rows)
    exact = products()
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(results, exact, strict=True))
    assert reached == {16, 32, 112, 144, 288, 320}
