"""bf16: error against the fp32 embeddings at most 2x what plain sentence-transformers in bf16 gives."""

import numpy as np
import pytest
import torch
from helpers import (
    DATA_DIR,
    DEVICE,
    assert_bf16_error_within_twice_plain,
    load_both,
    minilm_path,
    needs_data,
    one_minus_cosine,
)
from transformers import AutoConfig

from st_fastbackend import SentenceTransformer
from st_fastbackend.engine.onednn import onednn_dtypes
from st_fastbackend.engine.runtime import resolve_dtype


def bf16_products_allowed_here() -> bool:
    return torch.bfloat16 in onednn_dtypes()


@pytest.mark.parametrize("family", ["mistral", "qwen3", "bert", "distilbert"])
def test_bf16_error_bound_on_random_models(st_model, texts, family):
    assert_bf16_error_within_twice_plain(st_model(family, pooling_mode="mean"), [t for t in texts if t])


@pytest.mark.slow
@pytest.mark.real_model
@needs_data
def test_bf16_error_bound_on_minilm_real_sentences():
    import csv

    with open(DATA_DIR / "stsb" / "stsb-dev.tsv", encoding="utf8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:150]
    assert_bf16_error_within_twice_plain(minilm_path(), [r["sentence1"] for r in rows])


def test_fp16_for_a_family_that_overflows_only_when_asked_by_name(st_model, caplog, monkeypatch):
    folder = str(st_model("qwen2", pooling_mode="mean"))
    with caplog.at_level("WARNING"):
        model = SentenceTransformer(folder, backend="fast", device=DEVICE, model_kwargs={"dtype": torch.float16})
    assert next(model[0].parameters()).dtype == torch.float16
    assert "overflow in float16" in caplog.text
    assert np.isfinite(model.encode(["runs in float16 as asked"])).all()

    # dtype="auto", or none, takes the checkpoint's dtype, except fp16 for such a family (bf16 where there is bf16).
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    config = AutoConfig.from_pretrained(folder)
    config.dtype = torch.float16
    assert resolve_dtype({"dtype": "auto"}, config, "cuda") == resolve_dtype({}, config, "cpu") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert resolve_dtype({}, config, "cuda") == torch.float32  # a GPU without bf16
    config.model_type = "mistral"
    assert resolve_dtype({"dtype": "auto"}, config, "cuda") == torch.float16
    config.dtype = torch.bfloat16
    assert resolve_dtype({"dtype": "auto"}, config, "cuda") == torch.bfloat16


@pytest.fixture
def restore_matmul_precision():
    """PyTorch's setting for fp32 products (process-wide) as it was before the test."""
    before = torch.backends.mkldnn.matmul.fp32_precision
    yield
    torch.backends.mkldnn.matmul.fp32_precision = before


def assert_bf16_products_closer_than_bf16(folder, texts):
    """An fp32 model whose products run in bf16 keeps its activations in fp32: its error against fp32
    is at most half of plain sentence-transformers' in bf16 end to end. oneDNN's products are the CPU's:
    the models run there whatever device the suite runs on."""
    plain32, fast32 = load_both(folder, device="cpu")
    plain16, _ = load_both(folder, device="cpu", model_kwargs={"dtype": torch.bfloat16})
    reference = plain32.encode(texts)
    bf16_error = one_minus_cosine(plain16.encode(texts).astype(np.float32), reference).max()
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    assert fast32[0].product_dtype == torch.bfloat16
    mixed = fast32.encode(texts)
    error = one_minus_cosine(mixed, reference)
    assert mixed.dtype == np.float32 and 0 < error.max() <= bf16_error / 2
    torch.backends.mkldnn.matmul.fp32_precision = "none"  # PyTorch's default: exact fp32 again
    assert np.abs(fast32.encode(texts) - reference).max() <= 1e-5


@pytest.mark.skipif(not bf16_products_allowed_here(), reason="oneDNN runs bf16 on x86-64 with AVX-512 only")
@pytest.mark.parametrize("family", ["mistral", "bert", "distilbert"])
def test_bf16_products_in_an_fp32_model(st_model, texts, family, restore_matmul_precision, bf16_products_taken):
    assert_bf16_products_closer_than_bf16(st_model(family, pooling_mode="mean"), [t for t in texts if t])


@pytest.mark.slow
@pytest.mark.real_model
@needs_data
@pytest.mark.skipif(not bf16_products_allowed_here(), reason="oneDNN runs bf16 on x86-64 with AVX-512 only")
def test_bf16_products_in_minilm_on_real_sentences(restore_matmul_precision, bf16_products_taken):
    import csv

    with open(DATA_DIR / "stsb" / "stsb-dev.tsv", encoding="utf8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:150]
    assert_bf16_products_closer_than_bf16(minilm_path(), [r["sentence1"] for r in rows])


@pytest.mark.skipif(torch.bfloat16 not in onednn_dtypes(), reason="oneDNN runs bf16 on x86-64 with AVX-512 only")
def test_bf16_products_are_not_taken_without_bf16_dot_products(st_model, texts, restore_matmul_precision, monkeypatch):
    """On an AVX-512 CPU without AVX512-BF16 (Ice Lake) oneDNN converts bf16 to fp32 first, slower than fp32
    products: PyTorch's bf16 setting leaves them fp32, exact; with bf16 dot products they are bf16."""
    from st_fastbackend.engine import onednn

    folder = str(st_model("bert", pooling_mode="mean"))
    plain32, fast32 = load_both(folder, device="cpu")
    lines = [t for t in texts if t]
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    monkeypatch.setattr(onednn, "native_bf16", lambda: False)
    assert fast32[0].product_dtype != torch.bfloat16
    np.testing.assert_allclose(fast32.encode(lines), plain32.encode(lines), atol=1e-5, rtol=0)
    monkeypatch.setattr(onednn, "native_bf16", lambda: True)
    assert fast32[0].product_dtype == torch.bfloat16
    assert 1e-6 < np.abs(fast32.encode(lines) - plain32.encode(lines)).max() < 1e-2


def test_the_products_setting_is_read_once_per_call_not_per_pack(st_model, texts, monkeypatch):
    """The runtime is decided at load and passed down; PyTorch's fp32-product setting is looked at once per
    schedule (here an encode() call of 8 packs), as the one thing a caller may change between calls."""
    from st_fastbackend.engine import onednn

    model = SentenceTransformer(str(st_model("bert", pooling_mode="mean")), backend="fast", device=DEVICE)
    reads = []
    real = onednn.bf16_products_allowed
    monkeypatch.setattr(onednn, "bf16_products_allowed", lambda: reads.append(1) or real())
    model.encode([t for t in texts if t][:8], batch_size=1)
    assert len(reads) == 1
