"""Where clusterctl keeps its own state on the head node."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # cluster/: in the clone, or in site-packages once installed
PROJECT_ROOT = PACKAGE_DIR.parent  # the clone (editable install, tests); site-packages for an installed wheel
DATA_FOLDERS = ("jobs", "playbooks", "templates", "inventory")  # setup.py ships the same four as package data


def data_dir(name: str) -> Path:
    """One of the clone's top-level DATA_FOLDERS: inside the package in an installed wheel
    (cluster/_data/NAME, put there by setup.py), else the clone's own folder (editable install, tests)."""
    shipped = PACKAGE_DIR / "_data" / name
    return shipped if shipped.is_dir() else PROJECT_ROOT / name


PLAYBOOKS_DIR = data_dir("playbooks")  # the provision playbook
JOBS_DIR = data_dir("jobs")  # the built-in job specs
TEMPLATES_DIR = data_dir("templates")  # what playbook steps and launches render
INVENTORY_DIR = data_dir("inventory")
LOCAL_INVENTORY = INVENTORY_DIR / "local.yaml"
# in the first lines of every page `clusterctl report` writes: a program folder's launch never ships one
WRITTEN_BY = "written by clusterctl report"


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


def write_atomic(path: Path, text: str) -> None:
    """Replace PATH whole: a reader (another clusterctl, a test polling it) sees the old text or the new,
    never an empty or half file. A unique temporary name (two writers never share one), fsync, rename,
    fsync the folder."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
