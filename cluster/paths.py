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
