"""Golden files: compare, or rewrite with UPDATE_GOLDEN=1 (then review the diff before committing)."""
from __future__ import annotations

import os
from pathlib import Path

UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def check(golden: Path, content: str, what: str) -> None:
    """Assert `content` equals the golden file; UPDATE_GOLDEN=1 writes it first."""
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(content)
    assert golden.exists(), f"missing golden file {golden} (UPDATE_GOLDEN=1 writes it)"
    assert content == golden.read_text(), f"{what} differs from its golden file {golden}"
