"""eval/'s scripts without their data: one line naming the file and where the data folder is looked for."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_a_missing_data_file_is_one_line_naming_the_folder(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "eval"))
    from harness import data

    with pytest.raises(SystemExit, match=r"no .*stsb-test.tsv \(the data folder is --data-dir, else \$ST_FAST"):
        data.sts_sentences(tmp_path)


@pytest.mark.slow
def test_bench_without_data_says_where_it_looked(tmp_path):
    """Issue 47: `eval/bench.py --workloads sts` tracebacked where ../shared/data was absent."""
    command = [sys.executable, str(REPO / "eval" / "bench.py"), "--workloads", "sts", "--data-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("eval: error: no ")
