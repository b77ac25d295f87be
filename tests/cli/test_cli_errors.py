"""The command line as a user meets it, in real processes: a mistake is one line and exit status 2, with no
traceback and nothing written; --version and --help answer without importing torch."""

import importlib
import subprocess
import sys

import pytest

from st_fastbackend.cli import main

PROG = "st-fastbackend"


def run_cli(*args: str, cwd=None, stdin: bytes = b"") -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "st_fastbackend.cli", *args]
    return subprocess.run(command, cwd=cwd, input=stdin, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def folder(st_model):
    return st_model("bert", pooling_mode="mean")


CASES = {
    "missing input": (["--input", "missing.txt"], "error: input file missing.txt does not exist"),
    "binary input": (["--input", "binary.txt"], "error: binary.txt is not UTF-8 text (byte 0xff at offset 6)"),
    "missing folder": (["--model", "./no/such/model"], "error: model folder ./no/such/model does not exist"),
    "not a model": (["--model", "."], "error: . is not a model folder: it has neither modules.json nor config.json"),
    "unknown dtype": (["--dtype", "fp8"], "error: argument --dtype: invalid choice: 'fp8' (choose from float32, fp32"),
    "output extension": (["--output", "out.txt"], "the extension chooses the format, one of .npy, .parquet, .jsonl"),
    "output directory": (["--output", "nowhere/out.npy"], "error: --output nowhere/out.npy: directory nowhere does"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_mistake_is_one_line_and_exit_status_2(folder, tmp_path, case):
    changes, expected = CASES[case]
    (tmp_path / "texts.txt").write_text("first text\nsecond text\n")
    (tmp_path / "binary.txt").write_bytes(b"hello \xff\xfe world\n")
    options = {"--model": str(folder), "--input": "texts.txt", "--output": "out.npy"}
    options.update(zip(changes[::2], changes[1::2], strict=True))
    model = options.pop("--model")
    result = run_cli("encode", model, *[x for pair in options.items() for x in pair], cwd=tmp_path)
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2, result.stderr.decode()
    assert "Traceback" not in result.stderr.decode()
    assert expected in lines[-1] and lines[-1].startswith(PROG)
    if case != "unknown dtype":  # argparse's own errors come after its usage lines
        assert len(lines) == 1, lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.txt", "texts.txt"]  # no out.npy, no out.txt.npy


def test_an_error_from_encode_is_one_line(folder, tmp_path, capsys):
    """Past loading (in this process: a subprocess would import torch again)."""
    (tmp_path / "texts.txt").write_text("first text\n")
    with pytest.raises(SystemExit) as exit_:
        main(["encode", str(folder), "--input", str(tmp_path / "texts.txt"), "--output", str(tmp_path / "out.npy"),
              "--prompt-name", "nope"])  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and not (tmp_path / "out.npy").exists()
    assert lines == [f"{PROG}: error: ValueError: Prompt name 'nope' not found in the configured prompts dictionary "
                     "with keys ['query', 'document']."]  # fmt: skip


def test_debug_shows_the_traceback(tmp_path):
    result = run_cli("encode", "some/model", "--input", "missing.txt", "--output", "out.npy", "--debug", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" in result.stderr.decode()
    assert "CliError: input file missing.txt does not exist" in result.stderr.decode()


def test_ctrl_c_is_one_line_saying_what_was_kept(tmp_path, monkeypatch, capsys):
    """Issue 47: Ctrl-C during embed-corpus printed a 27-frame traceback; now one line, the shards kept named."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("part-00000.parquet", "part-00001.parquet", ".part-00002.parquet.tmp"):
        (out / name).write_bytes(b"")

    def stopped(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("st_fastbackend.cli.main"), "embed_corpus", stopped)
    with pytest.raises(SystemExit) as exit:
        main(["embed-corpus", "corpus.parquet", str(out), "--model", "m"])
    assert exit.value.code == 130
    assert capsys.readouterr().err == (
        f"{PROG}: interrupted; 2 complete shards kept in {out}: run the same command to resume\n"
    )


def test_dtype_aliases_are_accepted():
    from st_fastbackend.cli import build_parser

    parse = build_parser().parse_args
    names = [parse(["encode", "m", "--output", "o.npy", "--dtype", alias]).dtype for alias in ("fp16", "BF16", "half")]
    assert names == ["float16", "bfloat16", "float16"]


def test_version_and_help_without_torch():
    from st_fastbackend import __version__

    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.decode().strip() == f"{PROG} {__version__}"
    for command in (["--help"], ["encode", "--help"], ["serve", "--help"]):
        assert run_cli(*command).returncode == 0
    assert "(default: 32)" in run_cli("encode", "--help").stdout.decode()
    code = "import sys, st_fastbackend, st_fastbackend.cli; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"


def test_library_names_still_import():
    import st_fastbackend
    from st_fastbackend import (
        Chunking,
        CrossEncoder,
        HybridEncoder,
        MultiVectorEncoder,
        SentenceTransformer,
        SparseEncoder,
        UnsupportedModelError,
    )

    assert SentenceTransformer.__module__ == "st_fastbackend.models.sentence_transformer"
    assert CrossEncoder.__module__ == "st_fastbackend.models.cross_encoder" and Chunking.__name__ == "Chunking"
    assert SparseEncoder.__module__ == "st_fastbackend.models.sparse_encoder"
    assert MultiVectorEncoder.__module__ == "st_fastbackend.models.multi_vector_encoder"
    assert HybridEncoder.__module__ == "st_fastbackend.models.hybrid"
    assert issubclass(UnsupportedModelError, Exception)
    classes = {"SentenceTransformer", "CrossEncoder", "SparseEncoder", "MultiVectorEncoder", "HybridEncoder"}
    assert set(st_fastbackend.__all__) == classes | {"Chunking", "UnsupportedModelError"}
    with pytest.raises(AttributeError):
        st_fastbackend.nothing  # noqa: B018
