"""What users read says what is, not when or in which session it was found: README.md, docs/*.md and the
docstrings, messages and comments of cluster/ carry no session diary ("this session", "last session"), no
clock times in UTC, and README.md and docs/ name no commit by its hash (a commit is no measure a reader can
check)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIARY = re.compile(r"\b(?:this|last|previous|next) session\b|\b[0-9]{2}:[0-9]{2} UTC\b",
                   re.IGNORECASE)
# a hash as a commit is written: 7-40 hex digits with a digit and a letter among them (not a number, not a
# word like "decade"), after the word commit, after "at", "since" or "from" (a measurement's revision), or
# backticked
HEX = r"(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}"
COMMIT = re.compile(rf"\b(?:commits?|at|since|from)\s+(?:and\s+)?{HEX}\b|`{HEX}`|\b{HEX}\s+and\s+{HEX}\b",
                    re.IGNORECASE)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _read_files() -> list[Path]:
    return [*_pages(), *sorted((ROOT / "cluster").rglob("*.py"))]


def _hits(pattern: re.Pattern[str], files: list[Path]) -> list[str]:
    out = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for m in pattern.finditer(line):
                out.append(f"{f.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    return out


def test_no_session_diary_or_utc_times_where_users_read() -> None:
    assert _hits(DIARY, _read_files()) == []


def test_readme_and_docs_name_no_commit_by_its_hash() -> None:
    assert _hits(COMMIT, _pages()) == []


def test_the_patterns_find_what_they_are_for() -> None:
    """Each pattern against a sentence of the kind it forbids, and against the kind of text it must pass."""
    assert DIARY.search("measured this session, 16:01-16:04 UTC")
    assert DIARY.search("(2026-12-01 13:24 UTC)") and DIARY.search("Last session's figure")
    assert not DIARY.search("starts `sh launch.sh` in a new session at 14:33:59")
    assert COMMIT.search("1272 tests in 38 and 41 min at 2a744d0 and 0e0af27")
    assert COMMIT.search("from a clean clone at 08feaea") and COMMIT.search("the fix (commit 85e43d8)")
    assert COMMIT.search("`3ad0d04`")
    assert not COMMIT.search("at 1234567 images, a facade at deadbee5x, seed 4294967295")
