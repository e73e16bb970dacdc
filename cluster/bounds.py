"""One check for every number a user gives clusterctl: inventory fields, job settings (spec files and
`--set`) and command-line arguments.

A number must be of its kind (a whole number where one is meant; true/false is no number), finite, and
within its field's bounds (documented beside each field in docs/inventory.md and docs/jobs.md). Finite
matters because YAML reads `.nan` and `.inf` as floats: NaN compares false with every bound, so a check
like `value <= 0` lets it through, and infinity removes whatever bound the field was.

Standard library only: cluster/cli/args.py imports it, and `clusterctl CMD --help` stays cheap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def _fmt(x: float) -> str:
    """A bound as people write it: 4294967295, not 4.29497e+09; 0.5 as 0.5."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """The numbers a field accepts: `low` to `high` (either end excluded when `*_open`), whole numbers
    only when `integer`. `high` infinite: no upper bound, but the number must still be finite."""

    low: float
    high: float = math.inf
    integer: bool = False
    low_open: bool = False
    high_open: bool = False

    @property
    def kind(self) -> str:
        return "a whole number" if self.integer else "a number"

    @property
    def lower(self) -> str:
        return f"{'>' if self.low_open else '>='} {_fmt(self.low)}"

    @property
    def upper(self) -> str:
        return f"{'<' if self.high_open else '<='} {_fmt(self.high)}"

    def __str__(self) -> str:
        """The whole description, e.g. 'a whole number >= 1 and <= 65536'."""
        bounds = f"{self.lower} and {self.upper}" if math.isfinite(self.high) else self.lower
        return f"{self.kind} {bounds}"

    def problem(self, value: object) -> str | None:
        """None when `value` is accepted. Else what it should have been, for "expected ..., got VALUE":
        the bound it broke when it is a number of the right kind (e.g. 'a number > 0'), the whole
        description when it is no such number or not finite."""
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return str(self)
        if isinstance(value, float) and not math.isfinite(value):  # a Python int is always finite
            return f"a finite {str(self)[2:]}"
        if value < self.low or (self.low_open and value == self.low):
            return f"{self.kind} {self.lower}"
        if value > self.high or (self.high_open and value == self.high):
            return f"{self.kind} {self.upper}"
        return None

    def accepts(self, value: object) -> bool:
        return self.problem(value) is None
