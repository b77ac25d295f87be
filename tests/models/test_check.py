"""`st-fastbackend check` and model.check(): the fast backend against plain sentence-transformers on the suite's
families, exact at fp32; and failing, exit status 1 with the case named, where the fast path is broken."""

import numpy as np
import pytest
import torch
from builders import build_cross_encoder
from helpers import DEVICE

from st_fastbackend import CrossEncoder, SentenceTransformer
from st_fastbackend.cli import main
from st_fastbackend.engine import quantize
from st_fastbackend.engine.onednn import onednn_dtypes
from st_fastbackend.models.check import EXACT, INT8_ONE_MINUS_COS
from st_fastbackend.modules import PackedTransformer

PROMPTS = {"query": "query: ", "document": ""}
PROBE_CASES = {"short", "long", "cjk", "arabic", "devanagari", "cyrillic", "emoji", "special characters", "whitespace"}


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp("check") / "bert", "bert")


def rows(output: str) -> dict[str, str]:
    """The table's rows by case name."""
    table = output.split("\n\n", 1)[1].splitlines()[1:]
    return {line[:22].strip(): line for line in table}


@pytest.mark.parametrize("family, pooling", [("bert", "mean"), ("qwen3", "lasttoken")])
def test_check_passes_from_the_command_line(st_model, family, pooling, capsys):
    main(["check", str(st_model(family, pooling_mode=pooling, prompts=PROMPTS)), "--device", DEVICE])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"EXACT: every case within {EXACT:g} of plain sentence-transformers"
    found = rows(out)
    assert set(found) == PROBE_CASES | {"prompt 'query'"}  # the empty "document" prompt is the short case again
    assert all(line.endswith("ok") for line in found.values())


def test_cross_encoder_check_passes(cross_encoder):
    report = CrossEncoder(str(cross_encoder), backend="fast", device=DEVICE).check()
    assert report.passed and report.exact and "predict() scores" in report.contract
    assert {case.name for case in report.cases} == PROBE_CASES
    assert all(case.one_minus_cos is None and case.max_diff <= EXACT for case in report.cases)


@pytest.mark.slow
def test_model_check_returns_the_report(st_model):
    model = SentenceTransformer(str(st_model("mistral", pooling_mode="lasttoken")), backend="fast", device=DEVICE)
    report = model.check()
    assert report.passed and report.exact and not report.failed
    assert [case.name for case in report.cases][:2] == ["short", "long"] and len(report.cases) == len(PROBE_CASES)
    assert all(case.max_diff <= EXACT and case.one_minus_cos <= EXACT for case in report.cases)
    assert str(model[0].runtime) in report.ran and report.plain_seconds > 0 and report.fast_seconds > 0
    assert str(report).splitlines()[0] == report.verdict() and report.ran in str(report)
    assert "cores over the last minute, this run included" in str(report)  # the load beside the speed ratio
    mine = model.check(texts=["one text of mine", "and another"])
    assert [(case.name, case.inputs) for case in mine.cases] == [("your texts", 2)] and mine.passed
    model.max_seq_length = 16  # changed after load: plain is loaded beside it with the same window
    assert model.check(texts=[" ".join(["word"] * 40)]).passed
    with pytest.raises(ValueError, match='check.. compares a model loaded with backend="fast"'):
        SentenceTransformer(str(st_model("mistral", pooling_mode="lasttoken")), device=DEVICE).check()


def test_a_broken_fast_path_fails_naming_the_case(st_model, monkeypatch, capsys):
    """1e-3 added to the token embeddings of packs that reach the window, which only the long case's do: exit
    status 1, "long" named in the verdict and its row, every other case ok."""
    forward = PackedTransformer.forward

    def perturbed(self, features, **kwargs):
        out = forward(self, features, **kwargs)
        if out["packed"].max_seqlen >= self.max_seq_length:
            out["token_embeddings"] = out["token_embeddings"] + 1e-3
        return out

    monkeypatch.setattr(PackedTransformer, "forward", perturbed)
    with pytest.raises(SystemExit) as exited:
        main(["check", str(st_model("bert", pooling_mode="mean", prompts=PROMPTS)), "--device", DEVICE])
    assert exited.value.code == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == "NOT EXACT: 1 of 10 cases fail the contract: long"
    found = rows(captured.out)
    assert "FAIL" in found.pop("long") and all(line.endswith("ok") for line in found.values())
    assert "check failed: long" in captured.err


@pytest.mark.parametrize("kind", ["decoder", "cross-encoder"])
def test_a_weight_broken_after_load_fails_every_case(st_model, cross_encoder, kind):
    if kind == "decoder":
        model = SentenceTransformer(str(st_model("qwen3", pooling_mode="lasttoken")), backend="fast", device=DEVICE)
    else:
        model = CrossEncoder(str(cross_encoder), backend="fast", device=DEVICE)
    norm = next(p for name, p in model[0].model.named_parameters() if "norm" in name.lower())
    with torch.no_grad():
        norm.add_(1e-2)
    report = model.check(texts=["a text", "another text"] if kind == "decoder" else ["a query\ta document"])
    assert not report.passed and report.failed == [report.cases[0].name]
    assert report.cases[0].max_diff > EXACT and str(report).startswith("NOT EXACT")


def test_check_of_your_texts_from_a_file(st_model, cross_encoder, tmp_path, capsys):
    (tmp_path / "texts.txt").write_text("first text\n\nsecond, after an empty line\n")
    main(["check", str(st_model("bert", pooling_mode="mean")), "--texts", str(tmp_path / "texts.txt")])
    assert "your texts                  2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:  # a cross-encoder reads query<TAB>document
        main(["check", str(cross_encoder), "--texts", str(tmp_path / "texts.txt")])
    assert exited.value.code == 2 and "line 1 of the texts has no tab" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(torch.bfloat16 not in onednn_dtypes() and DEVICE == "cpu", reason="bf16 products need AVX-512")
def test_bf16_is_within_its_bound_not_exact(st_model, tmp_path, capsys):
    (tmp_path / "texts.txt").write_text("a short text\nanother text, longer than the first one\nthird\n")
    main(["check", str(st_model("bert", pooling_mode="mean")), "--device", DEVICE, "--dtype", "bf16",
          "--texts", str(tmp_path / "texts.txt")])  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("WITHIN BOUND") and "3x plain sentence-transformers' own in bfloat16" in out
    assert "model in torch.bfloat16" in out


@pytest.mark.skipif(not quantize.int8_supported() or DEVICE != "cpu", reason="int8 products need AVX512-VNNI")
def test_int8_is_within_its_bound(st_model):
    folder = str(st_model("bert", pooling_mode="mean"))
    model = SentenceTransformer(folder, backend="fast", device="cpu", model_kwargs={"quantize": "int8"})
    report = model.check(texts=["a short text", "another text, longer than the first one", "third"])
    assert report.passed and not report.exact and "Linear layers int8" in report.ran
    assert all(case.bound == INT8_ONE_MINUS_COS and case.max_diff > EXACT for case in report.cases)
    assert np.isfinite([case.measured for case in report.cases]).all()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["SparseEncoder", "MultiVectorEncoder"])
def test_check_sparse_and_multi_vector(tmp_path, kind, capsys, monkeypatch):
    """The CLI picks the class from the folder and compares its own outputs: SPLADE's rows, ColBERT's token vectors;
    and fails where they are off (SPLADE's values scaled: unit length would hide it; a pack's first token not
    scored)."""
    from hybrid_builders import build_colbert, build_splade

    from st_fastbackend.modules import multi_vector, splade

    expansion = {"strategy": "fixed", "attend": False, "length": 24}  # the query case runs it
    if kind == "SparseEncoder":
        folder = build_splade(tmp_path, "bert")
    else:
        folder = build_colbert(tmp_path, "bert", query_expansion=expansion)
    main(["check", str(folder), "--device", DEVICE])  # exit status 1 (SystemExit) where a case fails
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("EXACT"), out
    assert "queries" in out
    if kind == "SparseEncoder":
        activate = splade.PackedSpladePooling._activate
        monkeypatch.setattr(splade.PackedSpladePooling, "_activate", lambda self, x: activate(self, x).mul_(3))
    else:
        masked = multi_vector.PackedMultiVectorMask.forward

        def first_dropped(self, features, task=None):
            features = masked(self, features, task)
            features["scoring_mask"][0] = False
            return features

        monkeypatch.setattr(multi_vector.PackedMultiVectorMask, "forward", first_dropped)
    with pytest.raises(SystemExit) as exited:
        main(["check", str(folder), "--device", DEVICE])
    assert exited.value.code == 1 and capsys.readouterr().out.startswith("NOT EXACT")


def test_the_speed_ratio_says_when_the_machine_is_busy(monkeypatch):
    """Issue 47: a loaded host showed "fast 0.76x plain"; the line beside the ratio says the load and, past one
    runnable thread per core, that the ratio is distorted."""
    from st_fastbackend.models.check import machine_load

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (1.5, 1.0, 1.0))
    assert machine_load() == "load 1.5 on 2 cores over the last minute, this run included"
    monkeypatch.setattr("os.getloadavg", lambda: (3.4, 1.0, 1.0))
    assert machine_load().endswith(": busy, so the ratio is distorted; time it on a quiet machine")
