from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True, scope="session")
def _session_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The programs tests start (TensorFlow's autograph modules, torchrun's torchelastic_* folders) write their
    temporary files under the session's base folder, which pytest removes as it does the tests' own folders,
    not in the machine's /tmp, where a test that kills a program would leave them. (A Slurm task's TMPDIR
    comes from the lab's login node, not from here.)"""
    tmp = tmp_path_factory.mktemp("tmpdir", numbered=False)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    yield tmp
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own CLUSTERCTL_HOME: no test sees another's context or labs."""
    home = tmp_path_factory.mktemp("cchome")
    monkeypatch.setenv("CLUSTERCTL_HOME", str(home))
    monkeypatch.delenv("CLUSTERCTL_INVENTORY", raising=False)  # a developer's shell must not pick the inventory
    return home


def write(tmp_path: Path, text: str, name: str = "inv.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def can_run_lab() -> str | None:
    """None when the simulated lab can start here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "the simulated lab needs root"
    from cluster.lab import lifecycle
    from cluster.errors import LabError

    try:
        lifecycle.preflight()
    except LabError as e:
        return str(e)
    return None
