"""`pip install clusterctl-*.whl` into a fresh venv, then, from a folder outside the clone, the README's way
onto a lab: `clusterctl lab up 2`, `clusterctl provision`, `clusterctl launch resnet50-ddp` (tiny settings)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import ROOT
from tests.integration.conftest import lab_name, lab_subnet, pytestmark  # noqa: F401
from tests.unit.test_wheel import _clean_env, built, venv  # noqa: F401 (the fixtures: the wheel, the venv)

TINY = ["--set", "epochs=1", "--set", "threads=1", "--set", "max_steps=3", "--set", "log_every=1"]


def installed(venv: Path, cwd: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:  # noqa: F811
    env = _clean_env(HOME=str(cwd / "home"), CLUSTERCTL_HOME=str(cwd / "home" / ".clusterctl"),
                     PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", COLUMNS="200")
    return subprocess.run([str(venv / "bin" / "clusterctl"), *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_the_installed_wheel_starts_a_lab_provisions_and_launches(venv: Path, tmp_path: Path) -> None:  # noqa: F811
    name, lab = lab_name("w"), tmp_path / "lab"
    r = installed(venv, tmp_path, "lab", "up", "2", "--name", name, "--subnet", lab_subnet(16), "--dir", str(lab),
                  timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    try:
        py = str(venv / "bin" / "python")  # the nodes use the fresh venv as it is (python_env: existing)
        r = installed(venv, tmp_path, "provision", "--json", "--set", f"python={py}", "--set", "vars.python_env=existing")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        r = installed(venv, tmp_path, "launch", "resnet50-ddp", "--json", *TINY)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        rec = json.loads(r.stdout)
        assert rec["state"] == "succeeded" and rec["world_size"] == 2
        assert str(ROOT) not in rec["spec_file"]  # the job spec came from the installed package
    finally:
        installed(venv, tmp_path, "lab", "down", "--name", name, "--dir", str(lab), timeout=120)
