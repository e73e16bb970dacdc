"""A real simulated lab for the integration tests: its own name and subnet, removed at the end."""
from __future__ import annotations

import functools
import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from cluster.lab import lifecycle
from tests.conftest import ROOT, can_run_lab

REASON = can_run_lab()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"simulated lab unavailable: {REASON}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this folder is a lab test (marker `lab`, left out by `-m "not lab"`: the quick tier),
    whether or not its module imports `pytestmark` above (a conftest's own pytestmark applies to no module).
    tryfirst: before pytest's own hook deselects by marker."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.lab)


def lab_name(tag: str) -> str:
    return f"t{tag}{os.getpid() % 100000}"[:8]


def lab_subnet(offset: int) -> str:
    # per-process subnets so a parallel or leftover lab of another run never collides with ours
    return f"10.{180 + offset}.{os.getpid() % 250}.0/24"


def clusterctl(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
               user: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would: a new process, its output and exit code. `user`: as that account of this
    machine (one the test made), with its own home and ~/.clusterctl (as_user)."""
    argv, environ = [sys.executable, "-m", "cluster", *args], {**os.environ, **(env or {})}
    if user is not None:
        argv, environ = [*as_user(user), *argv], {k: v for k, v in os.environ.items() if k != "CLUSTERCTL_HOME"}
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=environ, timeout=timeout)


@functools.lru_cache(maxsize=None)
def _python_view() -> str:
    """Mounts that show this machine's interpreter to another user: it may live under a folder only root may
    enter (pyenv in /root, 0700), where a real head would have clusterctl installed for every user. Only the
    interpreter's own folder is shown, in a mount namespace of the command's own; nothing else changes."""
    real = Path(sys.executable).resolve()
    blocked = next((p for p in reversed(real.parents) if p != Path("/") and not p.stat().st_mode & 0o001), None)
    if blocked is None:
        return ""
    child = real.relative_to(blocked).parts[0]
    view = Path(tempfile.mkdtemp(prefix="clusterctl-view-"))
    view.chmod(0o755)
    (view / child).mkdir()
    q = shlex.quote
    return (f"mount --rbind {q(str(blocked / child))} {q(str(view / child))} && "
            f"mount --rbind {q(str(view))} {q(str(blocked))} && ")


def as_user(user: str) -> list[str]:
    """The argv prefix that runs a command as `user`: their home and their default ~/.clusterctl, this
    checkout's code (runuser; a mount namespace of its own for _python_view)."""
    home = pwd.getpwnam(user).pw_dir
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _python_view() + 'exec runuser -u "$0" -- "$@"',
            user, "env", f"HOME={home}", f"USER={user}", f"PYTHONPATH={ROOT}"]


@contextmanager
def accounts(*names: str) -> Iterator[None]:
    """Accounts of this machine for a test (as `useradd -m` makes them), removed with their homes at the end.
    /etc/passwd, group and shadow are written in place, never replaced: useradd and userdel rename a new file
    over each, and the kernel then detaches every mount on the old one, so every running lab PC, which mounts
    its own copy there (cluster.lab.accounts), would fall back to this machine's accounts mid-test."""
    for n in names:
        try:
            pwd.getpwnam(n)
        except KeyError:
            continue
        raise AssertionError(f"this machine has a user {n} already: remove it (userdel -r {n}) if a killed test "
                             "left it, or run the test elsewhere")
    files = {f: Path("/etc", f) for f in ("passwd", "group", "shadow")}
    taken = {int(line.split(":")[2]) for f in ("passwd", "group") for line in files[f].read_text().splitlines()
             if line.count(":") >= 2 and line.split(":")[2].isdigit()}
    ids = [u for u in range(1000, 60000) if u not in taken][:len(names)]
    homes = [Path("/home", n) for n in names]
    try:
        with files["passwd"].open("a") as f:
            f.writelines(f"{n}:x:{u}:{u}::{h}:/bin/sh\n" for n, u, h in zip(names, ids, homes))
        with files["group"].open("a") as f:
            f.writelines(f"{n}:x:{u}:\n" for n, u in zip(names, ids))
        with files["shadow"].open("a") as f:
            f.writelines(f"{n}:!:19700:0:99999:7:::\n" for n in names)
        for h, u in zip(homes, ids):
            shutil.copytree("/etc/skel", h, symlinks=True, dirs_exist_ok=True)
            for p in [h, *h.rglob("*")]:
                os.lchown(p, u, u)
            h.chmod(0o750)
        yield
    finally:
        for n in names:
            subprocess.run(["pkill", "-KILL", "-u", n], capture_output=True)
        for path in files.values():  # in place: the same file, these lines gone
            kept = [line for line in path.read_text().splitlines(keepends=True) if line.split(":")[0] not in names]
            with path.open("r+") as f:
                f.write("".join(kept))
                f.truncate()
        for h in homes:
            shutil.rmtree(h, ignore_errors=True)


def clusterctl_json(*args: str, **kw: Any) -> tuple[int, Any]:
    a = list(args)
    a.insert(a.index("--") if "--" in a else len(a), "--json")
    r = clusterctl(*a, **kw)
    try:
        return r.returncode, json.loads(r.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON (exit {r.returncode}):\n{r.stdout}\n{r.stderr}") from None


def why(rec: Any) -> str:
    """A run record's verdict in full, for an assertion message (pytest cuts a dict's repr to one line)."""
    keys = ("run_id", "state", "failure", "left_out", "stop_pending", "last_status")
    return json.dumps({k: rec.get(k) for k in keys} if isinstance(rec, dict) else rec, indent=1, default=str)


@contextmanager
def lab_up(tmp_path_factory: pytest.TempPathFactory, tag: str, nodes: int, offset: int,
           **up: Any) -> Iterator[tuple[lifecycle.LabState, Path]]:
    """A lab of its own (name from `tag`, subnet from `offset`) in a fresh folder `d` (the lab in d/lab);
    yields (state, d) and removes the lab at the end, whatever happened."""
    if REASON is not None:
        pytest.skip(REASON)
    d = tmp_path_factory.mktemp(tag)
    state = lifecycle.up(nodes, name=lab_name(tag), subnet=lab_subnet(offset), directory=d / "lab", **up)
    try:
        yield state, d
    finally:
        lifecycle.down(state.name, d / "lab")
        # the lab's files (venvs, checkpoints, logs) are the test's: CI's disk holds the suite only if each
        # module's lab leaves nothing behind
        shutil.rmtree(d, ignore_errors=True)


def wait_until(cond: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> float:
    """Poll `cond` until it is true; the seconds it took, or an AssertionError naming `what`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(step)
    return time.monotonic() - t0


def procs_of(run_id: str, node: str) -> list[int]:
    """Live processes whose environment carries the run and the node (as the node agent finds them)."""
    out = []
    tags = (f"CLUSTER_RUN_ID={run_id}".encode(), f"CLUSTER_NODE_NAME={node}".encode())
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = (p / "environ").read_bytes().split(b"\0")
            if (p / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except OSError:
            continue
        if tags[0] in env and tags[1] in env:
            out.append(int(p.name))
    return out


@pytest.fixture(scope="session")
def lab3(tmp_path_factory: pytest.TempPathFactory):
    with lab_up(tmp_path_factory, "a", 3, 0) as (state, _):
        yield state


def provisioned_lab(tmp_path_factory: pytest.TempPathFactory, tag: str, nodes: int, offset: int, **up: Any):
    """A lab whose nodes are provisioned with `python_env: existing` (this interpreter, through the shared
    filesystem): the verified state launch reads, in seconds. Yields (state, env); removed at the end."""
    with lab_up(tmp_path_factory, tag, nodes, offset, **up) as (state, d):
        env = {"CLUSTERCTL_HOME": str(d / "home")}
        rc, res = clusterctl_json("provision", state.inventory, "--set", f"python={sys.executable}",
                                  "--set", "vars.python_env=existing", env=env, timeout=600)
        assert rc == 0, json.dumps(res)[-2000:]
        yield state, env
