"""Every file clusterctl reads from a user's folder is a regular file of bounded size (cluster.bounds.read_regular),
or a refusal that names the path, what it is and the fix: a FIFO would block the reader forever, /dev/zero
never ends (a MemoryError, exit 70), and an oversize file is no such file.

Each case runs in a child process with a timeout and a memory cap: a regression that blocks on a FIFO fails
at the timeout, and one that reads /dev/zero ends in the cap, not in this machine's memory.
"""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import errors
from cluster.bounds import FILE_MAX_BYTES
from cluster.provision import wheelhouse_export
from tests.conftest import ROOT
from tests.unit.test_wheelhouse_io import fake_wheelhouse

TIMEOUT_S = 20


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A python child (`-m cluster ...` or `-c CODE`) with its memory capped and a timeout."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                          preexec_fn=cap, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)  # no disk used
    return path


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_wheelhouse_import_refuses_a_manifest_that_is_no_regular_file(tmp_path: Path, kind: str) -> None:
    """DIR/manifest.json a FIFO hung `wheelhouse import`; a link to /dev/zero ended in MemoryError (exit 70)."""
    usb = tmp_path / "usb"
    usb.mkdir()
    manifest = usb / "manifest.json"
    if kind == "fifo":
        os.mkfifo(manifest)
    else:
        manifest.symlink_to("/dev/zero")
    r = _run("-m", "cluster", "wheelhouse", "import", str(usb), env={"CLUSTERCTL_WHEELHOUSE": str(tmp_path / "c")})
    what = "a named pipe (FIFO)" if kind == "fifo" else "a character device"
    assert r.returncode == errors.EXIT_USAGE, r.stderr
    assert f"cannot read {manifest}: it is {what}, not a regular file" in r.stderr, r.stderr
    assert "fix: manifest.json is the regular file `clusterctl wheelhouse export DIR` writes" in r.stderr
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_wheelhouse_import_refuses_an_oversize_manifest(tmp_path: Path) -> None:
    usb = tmp_path / "usb"
    usb.mkdir()
    _sparse(usb / "manifest.json", FILE_MAX_BYTES + 1)
    r = _run("-m", "cluster", "wheelhouse", "import", str(usb), env={"CLUSTERCTL_WHEELHOUSE": str(tmp_path / "c")})
    assert r.returncode == errors.EXIT_USAGE, r.stderr
    assert f"{usb / 'manifest.json'}: it is 16.0 MiB ({FILE_MAX_BYTES + 1} bytes)" in r.stderr \
        and "more than an export's manifest holds (at most 16 MiB)" in r.stderr, r.stderr


def test_a_wheelhouse_manifest_that_is_a_fifo_is_called_so_not_missing(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheelhouse's own manifest.json a FIFO inside a good export: named as what it is, not "missing"."""
    monkeypatch.setenv("CLUSTERCTL_WHEELHOUSE", str(tmp_path / "connected"))
    key = fake_wheelhouse(tmp_path / "connected", ["pkg0==1.0"], "3.11").dir.parent.name
    usb = tmp_path / "usb"
    wheelhouse_export.export(usb)
    (usb / key / "manifest.json").unlink()
    os.mkfifo(usb / key / "manifest.json")
    r = _run("-m", "cluster", "wheelhouse", "import", str(usb), env={"CLUSTERCTL_WHEELHOUSE": str(tmp_path / "head")})
    assert r.returncode == errors.EXIT_FAILED, r.stderr
    assert f"{key}/manifest.json: is a named pipe (FIFO), not a regular file" in r.stderr, r.stderr
    assert "missing" not in r.stderr and "nothing was imported" in r.stderr and "copy those files again" in r.stderr


_SCAN = """
import sys
from pathlib import Path
from cluster.runs import code, schema
try:
    code.scan(Path(sys.argv[1]))
    print("scanned")
except code.CodeError as e:
    print(e.exit_code, e.message, "|", e.fix)
"""


def test_a_fifo_clusterctlignore_is_refused_plainly(tmp_path: Path) -> None:
    """Not "only regular files can be shipped ... list .clusterctlignore in .clusterctlignore"."""
    (tmp_path / "train.py").write_text("print(1)\n")
    os.mkfifo(tmp_path / ".clusterctlignore")
    r = _run("-c", _SCAN, str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("2 code: cannot read .clusterctlignore") \
        and "is a named pipe (FIFO), not a regular file" in r.stdout, r.stdout
    assert "list .clusterctlignore in" not in r.stdout and "regular text file of gitignore lines" in r.stdout


@pytest.mark.parametrize("kind", ["fifo", "big"])
def test_an_inventory_that_is_a_fifo_or_oversize_is_refused(tmp_path: Path, kind: str) -> None:
    inv = tmp_path / "inventory.yaml"
    if kind == "fifo":
        os.mkfifo(inv)
    else:
        _sparse(inv, FILE_MAX_BYTES + 1)
    r = _run("-m", "cluster", "exec", str(inv), "--", "true")
    assert r.returncode == errors.EXIT_USAGE and "Traceback" not in r.stderr, r.stderr
    problem = "is a named pipe (FIFO), not a regular file" if kind == "fifo" else \
        f"is 16.0 MiB ({FILE_MAX_BYTES + 1} bytes), more than an inventory holds (at most 16 MiB)"
    assert f"{inv}: cannot read inventory: it {problem}" in r.stderr, r.stderr
    assert "fix: give the inventory itself: its file (a regular file of at most 16 MiB) or its folder" in r.stderr


_JOB = """
import sys
from cluster.runs import jobs, schema
try:
    jobs.load(sys.argv[1])
    print("loaded")
except schema.JobError as e:
    print(e.exit_code, e.message, "|", e.fix)
"""


def test_a_job_spec_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    os.mkfifo(spec)
    r = _run("-c", _JOB, str(spec))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"2 {spec}: job: cannot read the job spec: it is a named pipe (FIFO), not a regular "
                               "file") and "(a regular file)" in r.stdout, r.stdout


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no `ssh` program: a config file is refused for that reason first")
def test_an_ssh_config_that_is_a_fifo_is_refused_before_ssh_reads_it(tmp_path: Path) -> None:
    """`ssh -G -F FIFO` blocked until its timeout, then blamed a `Match exec` command."""
    os.mkfifo(tmp_path / "ssh_config")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"defaults:\n  ssh_config: {tmp_path / 'ssh_config'}\nhosts:\n  pc1: {{address: 127.0.0.1}}\n")
    r = _run("-m", "cluster", "exec", str(inv), "--", "true")
    assert r.returncode == errors.EXIT_USAGE and "Traceback" not in r.stderr, r.stderr
    assert f"ssh_config: cannot read {tmp_path / 'ssh_config'}: it is a named pipe (FIFO), not a regular file" \
        in r.stderr and "set `ssh_config: none`" in r.stderr, r.stderr
