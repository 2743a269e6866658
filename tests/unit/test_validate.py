"""engine/validate.py: the one integer validator, and no hand-rolled copies left in engine/."""

import pathlib
import re

import pytest

from engine.errors import ConfigError
from engine.validate import as_int, check_int, int_requirement

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_accepts_ints_in_range_and_returns_them():
    assert check_int("k", 3, minimum=1) == 3
    assert check_int("k", 0, minimum=0, maximum=0) == 0
    assert check_int("k", 5e8, minimum=1, allow_float=True) == 500_000_000
    assert isinstance(check_int("k", 4.0, allow_float=True), int)


@pytest.mark.parametrize("value", [True, False, 1.5, "3", None, float("inf"), 4.0])
def test_rejects_what_is_not_an_int(value):
    with pytest.raises(ConfigError, match=r"^k must be a positive integer \(>= 1\), got "):
        check_int("k", value, minimum=1)


def test_message_names_key_requirement_value_and_fix_and_keeps_the_callers_type():
    with pytest.raises(ValueError, match=r"^pipeline.stages must be an integer from 1 to 4, got 9: lower it$") as e:
        check_int("pipeline.stages", 9, minimum=1, maximum=4, fix="lower it", error=ValueError)
    assert type(e.value) is ValueError
    with pytest.raises(ConfigError, match=r"non-negative integer \(>= 0\), got -1"):
        check_int("x", -1, minimum=0)
    assert int_requirement(None, 3) == "an integer <= 3" and int_requirement(2) == "an integer >= 2"
    assert as_int(True) is None and as_int(2.0) is None and as_int(2.0, allow_float=True) == 2


def test_no_hand_rolled_integer_checks_in_engine():
    pattern = re.compile(r"isinstance\((\w[\w.]*), bool\) or not isinstance\(\1, int\)"
                         r"|not isinstance\((\w[\w.]*), int\) or (isinstance\(\2, bool\)|\2 <)")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in ROOT.joinpath("engine").rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, f"use engine.validate.check_int instead of a hand-rolled check: {found}"
