"""Where clusterctl keeps its own state on the head node."""
from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
INVENTORY_DIR = PROJECT_ROOT / "inventory"
LOCAL_INVENTORY = INVENTORY_DIR / "local.yaml"


def home() -> Path:
    """CLUSTERCTL_HOME, default ~/.clusterctl: context, lab directories."""
    return Path(os.environ.get("CLUSTERCTL_HOME") or "~/.clusterctl").expanduser()


def inventory_key(name: str, path: Path | str) -> str:
    """A file name for per-inventory state on the head (bench, plans, provision records): the inventory's
    name, which the loader has checked is path-safe, plus a digest of where it lives, so two inventories
    that share a name never share state."""
    import hashlib

    where = str(Path(path).expanduser().resolve()) if str(path) else ""
    return f"{name}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"
