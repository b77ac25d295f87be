"""Real model, real data: STS-B dev through both backends gives the same Spearman, and MTEB's figure."""

import importlib.util
import sys

import pytest
from helpers import DATA_DIR, REPO, load_both, minilm_path, needs_data

spec = importlib.util.spec_from_file_location("quality", REPO / "eval" / "quality.py")
quality = sys.modules["quality"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
spec.loader.exec_module(quality)


@pytest.mark.slow
@pytest.mark.real_model
@needs_data
def test_stsb_dev_spearman_is_the_same_for_both_backends():
    plain, fast = load_both(minilm_path())
    task = quality.TASKS["stsb-dev"]
    plain_score = quality.sts_spearman(plain, task, DATA_DIR)
    fast_score = quality.sts_spearman(fast, task, DATA_DIR)
    assert fast_score == pytest.approx(plain_score, abs=1e-4)
    published = quality.published(DATA_DIR, quality.MINILM_NAME, task.reference)
    assert fast_score == pytest.approx(published, abs=1e-4)
