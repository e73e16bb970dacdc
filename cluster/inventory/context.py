"""The current lab, like kubectl's current context: commands without an inventory use it."""
from __future__ import annotations

import json
import os
from pathlib import Path

from cluster import paths
from cluster.errors import UsageError


ENV = "CLUSTERCTL_INVENTORY"  # an inventory for this shell: above the saved context, below -i


def _file() -> Path:
    return paths.home() / "context.json"


def current() -> Path | None:
    try:
        p = Path(json.loads(_file().read_text())["inventory"])
    except (OSError, ValueError, KeyError):
        return None
    return p


def set_current(inventory: Path) -> Path:
    p = inventory.resolve()
    _file().parent.mkdir(parents=True, exist_ok=True)
    paths.write_atomic(_file(), json.dumps({"inventory": str(p)}) + "\n")
    return p


def resolve(explicit: str | None) -> tuple[Path, str]:
    """The inventory to use and why: given (-i or the positional) > $CLUSTERCTL_INVENTORY > the current
    context (`clusterctl context`) > the embedded inventory/local.yaml."""
    if explicit:
        return Path(explicit), "given"
    env = os.environ.get(ENV, "")
    if env:
        p = Path(env).expanduser()
        if not p.exists():
            raise UsageError(f"{ENV}={env}: no such inventory",
                             f"unset {ENV}, point it at an inventory, or pass one with -i")
        return p, ENV
    cur = current()
    if cur is not None:
        if not cur.exists():
            raise UsageError(f"the current inventory {cur} no longer exists",
                             "pass one with -i, or set another with `clusterctl context INVENTORY`")
        return cur, "current context"
    if not paths.LOCAL_INVENTORY.exists():
        raise UsageError("no inventory given and no current context",
                         "pass INVENTORY or -i, or run `clusterctl lab up 3`")
    return paths.LOCAL_INVENTORY, "embedded default (no inventory given, no current context)"


def clear() -> None:
    _file().unlink(missing_ok=True)
