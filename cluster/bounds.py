"""One check for every number a user gives clusterctl: inventory fields, job settings (spec files and
`--set`) and command-line arguments; and one reader for every file clusterctl reads from a user's folder
(read_regular): a regular file of bounded size, or a refusal that says what it is.

A number must be of its kind (a whole number where one is meant; true/false is no number), finite, and
within its field's bounds (documented beside each field in docs/inventory.md and docs/jobs.md). Finite
matters because YAML reads `.nan` and `.inf` as floats: NaN compares false with every bound, so a check
like `value <= 0` lets it through, and infinity removes whatever bound the field was.

Standard library only (and cluster.errors, which is too): cluster/cli/args.py imports it, and
`clusterctl CMD --help` stays cheap.
"""
from __future__ import annotations

import math
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from cluster.errors import UsageError


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


# --------------------------------------------------------------------------- files from a user's folder

# A file a person writes (an inventory, a job spec, a requirements or ignore file) or clusterctl wrote for them
# (an export's manifest, a facts file): 16 MiB is hundreds of thousands of lines. Larger, it is no such file
# (or it is /dev/zero under another name), and reading it whole would only exhaust the memory.
FILE_MAX_BYTES = 16 << 20


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in an error message's words."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def _amount(n: int) -> str:
    """16 MiB for a limit; 4096 bytes, or 16.0 MiB (16777217 bytes) for a file just over it."""
    if n and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    return f"{n} bytes" if n < 1 << 20 else f"{n / 2**20:.1f} MiB ({n} bytes)"


def file_problem(st: os.stat_result, limit: int | None = FILE_MAX_BYTES, noun: str = "such a file") -> str | None:
    """Why a file cannot be read whole, or None: it is no regular file (a FIFO blocks its reader forever, a
    device such as /dev/zero never ends), or it is over `limit` bytes (None: no limit), more than `noun` holds."""
    if not stat.S_ISREG(st.st_mode):
        return f"is {file_kind(st.st_mode)}, not a regular file"
    if limit is not None and st.st_size > limit:
        return f"is {_amount(st.st_size)}, more than {noun} holds (at most {_amount(limit)})"
    return None


class FileRefused(UsageError):
    """A file that is no regular file of bounded size (exit 2). `problem` is what it is ("is a named pipe
    (FIFO), not a regular file"); `size` is its size when the refusal is for size, else None. Callers with
    their own error class (an inventory's, a job's) raise it again with `problem` and `fix`."""

    def __init__(self, path: Path, problem: str, fix: str, size: int | None = None) -> None:
        super().__init__(f"cannot read {path}: it {problem}", fix)
        self.path, self.problem, self.size = path, problem, size


@contextmanager
def open_regular(path: Path, fix: str, limit: int | None = FILE_MAX_BYTES,
                 noun: str = "such a file") -> Iterator[BinaryIO]:
    """`path` open for reading, once it is known to be a regular file of at most `limit` bytes. Opened without
    blocking (O_NONBLOCK: a FIFO with no writer opens at once) and checked on the open descriptor, so a FIFO or
    a device, or one swapped in after any earlier stat, is refused before a byte is read. OSError (absent,
    unreadable) is the caller's to word; the refusal is FileRefused, naming the path, what it is and `fix`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        problem = file_problem(st, limit, noun)
        if problem is not None:
            raise FileRefused(path, problem, fix, st.st_size if stat.S_ISREG(st.st_mode) else None)
        yield f


def read_regular(path: Path, fix: str, limit: int = FILE_MAX_BYTES, noun: str = "such a file") -> bytes:
    """The whole of `path`, a regular file of at most `limit` bytes (see open_regular). At most limit + 1
    bytes are read, so a file that grew past the limit since the check is refused too."""
    with open_regular(path, fix, limit, noun) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileRefused(path, f"grew past {_amount(limit)} while read, more than {noun} holds", fix, len(data))
    return data
