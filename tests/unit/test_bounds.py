"""cluster.bounds: the one check every number from a user passes (inventory, job settings, CLI arguments)."""
from __future__ import annotations

import argparse
import math
from typing import Any, Callable

import pytest

from cluster.bounds import Range
from cluster.cli import args
from cluster.inventory.model import NUMBERS as INVENTORY_NUMBERS
from cluster.runs.schema import DEFAULTS
from cluster.runs.schema import NUMBERS as JOB_NUMBERS

TIMEOUT = Range(0, 86400, low_open=True)
BATCH = Range(1, 65536, integer=True)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused_whatever_the_bounds(value: float) -> None:
    """NaN compares false with every bound, so `value <= 0` alone lets it through; infinity removes the bound."""
    for rng in (TIMEOUT, Range(0), Range(-math.inf, math.inf), Range(0, 1, high_open=True)):
        assert rng.problem(value) is not None and not rng.accepts(value)
    assert TIMEOUT.problem(value) == "a finite number > 0 and <= 86400"


@pytest.mark.parametrize("value, problem", [
    (0, "a number > 0"), (-1, "a number > 0"), (86400.5, "a number <= 86400"), (10**400, "a number <= 86400"),
    (True, "a number > 0 and <= 86400"), ("10", "a number > 0 and <= 86400"), (None, "a number > 0 and <= 86400"),
])
def test_a_refused_number_is_told_the_bound_it_broke(value: object, problem: str) -> None:
    assert TIMEOUT.problem(value) == problem


def test_whole_numbers_and_their_bounds() -> None:
    assert BATCH.accepts(1) and BATCH.accepts(65536) and BATCH.accepts(32)
    assert BATCH.problem(10**22) == "a whole number <= 65536"
    assert BATCH.problem(2.0) == BATCH.problem(math.nan) == "a whole number >= 1 and <= 65536"
    assert BATCH.problem(0) == "a whole number >= 1"
    assert str(Range(0, 2**32 - 1, integer=True)) == "a whole number >= 0 and <= 4294967295"
    assert str(Range(0, 1, high_open=True)) == "a number >= 0 and < 1" and str(Range(0.5)) == "a number >= 0.5"


def test_every_default_and_shipped_value_is_accepted() -> None:
    """The bounds chosen for each field keep every default (the fixes quote them as examples)."""
    for field, rng in JOB_NUMBERS.items():
        if field in ("shares", "procs_per_node"):
            continue  # no number by default (empty / auto)
        value: Any = DEFAULTS
        for part in field.split("."):
            value = value[part]
        assert rng.accepts(value), (field, value)
    for field, default in (("port", 22), ("connect_timeout", 5.0), ("command_timeout", 600.0), ("gpu.count", 1)):
        assert INVENTORY_NUMBERS[field].accepts(default)


@pytest.mark.parametrize("kind, text, message", [
    (args.POSITIVE_FLOAT, "nan", "expected a finite number > 0, got 'nan'"),
    (args.POSITIVE_FLOAT, "inf", "expected a finite number > 0, got 'inf'"),
    (args.NON_NEGATIVE_FLOAT, "-inf", "expected a finite number >= 0, got '-inf'"),
    (args.NON_NEGATIVE_FLOAT, "1e400", "expected a finite number >= 0, got '1e400'"),
    (args.FRACTION, "NaN", "expected a finite number > 0 and <= 1, got 'NaN'"),
    (args.FRACTION, "90", "expected a number > 0 and <= 1, got '90'"),
    (args.POSITIVE_INT, "0", "expected a whole number > 0, got '0'"),
    (args.POSITIVE_INT, "nan", "expected a whole number, got 'nan'"),
])
def test_command_line_numbers_pass_the_same_check(kind: Callable[[str], object], text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as e:
        kind(text)
    assert str(e.value) == message
    assert args.FRACTION("0.9") == 0.9 and args.NON_NEGATIVE_INT("0") == 0
