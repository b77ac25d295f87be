"""The table of families (engine/families.py) held to the tests: every family has a small random model to build
(builders.MODEL_CONFIGS) and runs the reference test against plain sentence-transformers
(tests/models/test_parity.py)."""

import test_parity
from builders import MODEL_CONFIGS

from st_fastbackend.engine.families import FAMILIES
from st_fastbackend.engine.spec import FP16_OVERFLOWS


def parametrized(test, argument: str) -> list:
    """The values pytest runs `test` with for `argument`, read from its parametrize marks."""
    marks = [mark for mark in test.pytestmark if mark.name == "parametrize" and mark.args[0] == argument]
    return [value for mark in marks for value in mark.args[1]]


def test_every_family_has_a_builder():
    missing = sorted(set(FAMILIES) - set(MODEL_CONFIGS))
    assert not missing, f"families without a small random model in tests/builders.py MODEL_CONFIGS: {missing}"


def test_every_family_runs_the_reference_test():
    tested = parametrized(test_parity.test_every_family_and_pooling_mode_matches_plain, "family")
    missing = sorted(set(FAMILIES) - set(tested))
    assert not missing, f"families test_parity.py does not compare with plain sentence-transformers: {missing}"


def test_the_fp16_overflows_are_families():
    """The one list of model types outside the table (engine/runtime.py reads it, below engine/families.py)."""
    assert set(FP16_OVERFLOWS) <= set(FAMILIES)
