import numpy as np
import pytest
import torch

from st_fastbackend import SentenceTransformer
from st_fastbackend.cli import main
from st_fastbackend.engine import quantize
from st_fastbackend.engine.onednn import onednn_dtypes


def test_encode_command_writes_the_embeddings(st_model, texts, tmp_path):
    folder = st_model("mistral", pooling_mode="lasttoken")
    lines = [t for t in texts if t]  # one text per line: an empty line stays an empty text, skip it here
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    main(["encode", str(folder), "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.npy")])
    expected = SentenceTransformer(str(folder), backend="fast", device="cpu").encode(lines)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected)


@pytest.mark.skipif(torch.bfloat16 not in onednn_dtypes(), reason="oneDNN runs bf16 natively with AVX-512 only")
def test_encode_command_with_bf16_products(st_model, texts, tmp_path, bf16_products_taken):
    """--matmul-precision medium: the fp32 model multiplies in bf16, close to but not equal to fp32."""
    folder = st_model("bert", pooling_mode="mean")
    lines = [t for t in texts if t]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    exact = SentenceTransformer(str(folder), backend="fast", device="cpu").encode(lines)
    try:
        main(["encode", str(folder), "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.npy"),
              "--matmul-precision", "medium"])  # fmt: skip
    finally:
        torch.set_float32_matmul_precision("highest")
    got = np.load(tmp_path / "out.npy")
    assert got.dtype == np.float32 and 1e-6 < np.abs(got - exact).max() < 1e-2


@pytest.mark.slow
@pytest.mark.skipif(not quantize.int8_supported(), reason="int8 products need AVX512-VNNI and oneDNN")
@pytest.mark.parametrize("mode", ["int8", "int8-static"])
def test_quantize_int8_from_the_command_line(st_model, texts, tmp_path, capsys, mode):
    """--quantize MODE gives model_kwargs={"quantize": MODE}'s embeddings; a corpus folder written with it
    does not take a resume without it (other numbers)."""
    folder = st_model("bert", pooling_mode="mean")
    lines = [t for t in texts if t]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    main(["encode", str(folder), "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.npy"),
          "--quantize", mode])  # fmt: skip
    int8 = SentenceTransformer(str(folder), backend="fast", device="cpu", model_kwargs={"quantize": mode})
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), int8.encode(lines))
    (tmp_path / "in.jsonl").write_text('{"id": 1, "text": "one text"}\n{"id": 2, "text": "another text"}\n')
    job = ["embed-corpus", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", str(folder)]
    main([*job, "--quantize", mode])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(job)
    assert "quantize" in capsys.readouterr().err
