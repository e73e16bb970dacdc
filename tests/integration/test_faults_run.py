"""Fault injection on a real 2-node lab, one test per fault: the run's verdict, its time, what is left.

Each test prints a row (fault, stage, time to verdict, outcome) and the module prints the table at the end,
for docs/reliability.md. The lab's nodes share this machine's process table (only their network and mounts
are their own), so the tests look for a run's processes directly in /proc, without any clusterctl command
that could itself judge the run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.runs import state as runstate
from tests.conftest import ROOT
from tests.integration.conftest import (clusterctl, clusterctl_json, procs_of, provisioned_lab,  # noqa: F401
                                        pytestmark, wait_until)

LONG = ["--set", "epochs=200", "--set", "threads=1", "--set", "log_every=1", "--set", "batch=8"]
ROWS: list[tuple[str, str, str, str]] = []


@pytest.fixture(scope="module")
def flab(tmp_path_factory: pytest.TempPathFactory):
    yield from provisioned_lab(tmp_path_factory, "f", 2, 9)
    print("\n| fault | stage | time to verdict | outcome |\n|---|---|---|---|")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")


def saved(env: dict[str, str], run_id: str) -> dict:
    return json.loads((Path(env["CLUSTERCTL_HOME"]) / "runs" / run_id / "run.json").read_text())


def start_detached(env: dict[str, str], state) -> str:
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "--detach", *LONG, env=env, timeout=300)
    assert rc == 0 and rec["state"] == "running", rec
    wait_for(lambda: all(_stepped(state, rec["run_id"], i) for i in range(2)), 300, "a step on every node")
    return rec["run_id"]


def _stepped(state, run_id: str, i: int) -> bool:
    out = Path(state.nodes[i].dir) / "srv" / "runs" / run_id / "out"
    return any('"step"' in f.read_text() for f in out.glob("metrics-rank*.jsonl"))


def wait_for(cond, timeout: float, what: str) -> float:
    return wait_until(cond, timeout, what, step=0.5)  # each look scans /proc: not too often


def link(state, node: int, up: bool) -> None:
    subprocess.run(["ip", "link", "set", state.nodes[node].veth, "up" if up else "down"], check=True)


def cleanup(env: dict[str, str], state, run_id: str) -> None:
    link(state, 1, True)
    clusterctl("stop", run_id, env=env, timeout=120)
    for n in ("node1", "node2"):
        for p in procs_of(run_id, n):
            os.kill(p, signal.SIGKILL)


def test_a_cut_link_fails_a_detached_run_with_nobody_watching(flab) -> None:
    """node2's link goes down mid-training; no clusterctl command runs. The run's watcher declares it
    failed and stops node1; the next morning `status` names node2 with its last log lines."""
    state, env = flab
    run_id = start_detached(env, state)
    assert saved(env, run_id)["watcher"]["pid"] > 0
    try:
        link(state, 1, False)
        gone = wait_for(lambda: not procs_of(run_id, "node1"), 180, "node1's training processes gone")
        judged = wait_for(lambda: saved(env, run_id)["state"] == "failed" and saved(env, run_id)["stop_results"],
                          90, "the verdict and the stop results in run.json")
        rec = saved(env, run_id)
        assert rec["failure"]["node"] == "node2" and "unreachable" in rec["failure"]["reason"]
        assert rec["failure"]["log"], "node2's last known log lines are kept"
        assert rec["stop_pending"] == ["node2"]
        r = clusterctl("status", run_id, env=env, timeout=120)
        assert r.returncode == 3, r.stdout + r.stderr  # failed, and node2 still cannot be reached
        assert "run failed on node2" in " ".join(r.stdout.split()) and "node2|" in r.stdout
        assert "not confirmed stopped" in " ".join(r.stdout.split())
        ROWS.append(("node2's link cut, detached, nobody watching", "training",
                     f"{gone:.0f} s to node1 stopped (+{judged:.0f} s)", "failed, names node2, its last log lines"))
        # the node comes back: the next status finishes the stop there
        link(state, 1, True)
        rc, st = clusterctl_json("status", run_id, env=env, timeout=120)
        assert rc == 1 and st["stop_pending"] == [] and st["state"] == "failed"
        assert wait_for(lambda: not procs_of(run_id, "node2"), 30, "node2 stopped once reachable") >= 0
    finally:
        cleanup(env, state, run_id)


def test_stop_while_a_node_is_unreachable_is_not_called_done(flab) -> None:
    state, env = flab
    run_id = start_detached(env, state)
    try:
        link(state, 1, False)
        t0 = time.monotonic()
        rc, rec = clusterctl_json("stop", run_id, env=env, timeout=180)
        took = time.monotonic() - t0
        assert rc == 3 and rec["state"] == "stopping" and rec["stop_pending"] == ["node2"], rec
        assert not procs_of(run_id, "node1") and procs_of(run_id, "node2")
        r = clusterctl("logs", run_id, env=env, timeout=120)  # node1's log is shown, node2's cannot be
        assert r.returncode == 3 and "[unreachable:" in r.stdout and "could not reach node2" in r.stderr, r
        r = clusterctl("launch", "resnet50-ddp", "--limit", "node1", *LONG, env=env, timeout=180)
        assert r.returncode == 1 and f"run {run_id} is still stopping" in r.stderr, r.stderr
        link(state, 1, True)
        # nobody runs a command: the run's watcher retries the stop as node2 comes back
        back = wait_for(lambda: saved(env, run_id)["state"] == "stopped", 120, "the watcher's stop on node2")
        assert saved(env, run_id)["stop_pending"] == [] and not procs_of(run_id, "node2")
        rc, rec = clusterctl_json("stop", run_id, env=env, timeout=180)
        assert rc == 0 and rec["state"] == "stopped" and rec["stop_pending"] == [], rec
        ROWS.append(("`stop` while node2 is unreachable", "stop", f"{took:.0f} s",
                     f"exit 3, stopping, launch refused; the watcher stopped node2 {back:.0f} s after it came "
                     "back, with no command run"))
    finally:
        cleanup(env, state, run_id)


def test_a_rebooted_node_fails_the_run_and_a_stranger_in_its_old_group_is_spared(flab) -> None:
    """node2 'reboots': every process of the run there dies at once and another program gets the old
    process-group number. The run fails naming node2; the stranger is never signalled."""
    state, env = flab
    run_id = start_detached(env, state)
    stranger = subprocess.Popen(["setsid", "sleep", "600"])
    try:
        pid_file = Path(state.nodes[1].dir) / "srv" / "runs" / run_id / "pid.json"
        doc = json.loads(pid_file.read_text())
        for p in procs_of(run_id, "node2"):
            os.kill(p, signal.SIGKILL)
        time.sleep(0.5)
        pid_file.write_text(json.dumps({**doc, "pgid": stranger.pid}))  # the old number, someone else's now
        t0 = time.monotonic()
        judged = wait_for(lambda: saved(env, run_id)["state"] == "failed", 120, "the verdict")
        rc, st = clusterctl_json("status", run_id, env=env, timeout=120)
        assert rc == 1 and st["state"] == "failed", st
        assert "node2" in [st["failure"]["node"], *st["failure"]["also"]], st["failure"]
        assert st["last_status"]["node2"]["state"] in ("vanished", "failed")
        assert wait_for(lambda: not procs_of(run_id, "node1"), 60, "node1 stopped") >= 0
        assert stranger.poll() is None, "a process that is not the run's was signalled"
        ROWS.append(("node2 rebooted (its processes gone, a stranger in the old group)", "training",
                     f"{time.monotonic() - t0 + judged:.0f} s", "failed, node1 stopped, stranger untouched"))
    finally:
        stranger.kill()
        stranger.wait()
        cleanup(env, state, run_id)


def test_two_launches_at_once_start_one_run(flab) -> None:
    state, env = flab
    procs = [subprocess.Popen([sys.executable, "-m", "cluster", "launch", "resnet50-ddp", "--detach", "--json", *LONG],
                              cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    t0 = time.monotonic()
    outs = [p.communicate(timeout=300) for p in procs]
    took = time.monotonic() - t0
    codes = sorted(p.returncode for p in procs)
    started = [json.loads(o) for (o, _), p in zip(outs, procs) if p.returncode == 0]
    refused = [e for (_, e), p in zip(outs, procs) if p.returncode != 0]
    try:
        assert codes == [0, 1], outs
        assert "is still starting" in refused[0] or "is still running" in refused[0], refused[0]
        rc, listed = clusterctl_json("runs", env=env)
        assert [r["run_id"] for r in listed if r["state"] in ("starting", "running")] == [started[0]["run_id"]]
        ROWS.append(("two `launch` at once on the same nodes", "launch", f"{took:.0f} s",
                     "one run started, the other refused (exit 1)"))
    finally:
        for s in started:
            cleanup(env, state, s["run_id"])


def test_a_frozen_sshd_costs_a_timeout_at_launch_not_a_hang(flab) -> None:
    state, env = flab
    ns = state.nodes[1].netns
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    sshd = [int(p) for p in pids if "sshd" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    assert sshd
    for p in sshd:
        os.kill(p, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = clusterctl("launch", "resnet50-ddp", *LONG, env=env, timeout=300)
        took = time.monotonic() - t0
        assert r.returncode == 3 and "node2" in r.stderr, r.stderr
        assert took < 60, f"launch took {took:.0f} s against a frozen node"
        ROWS.append(("node2's sshd frozen (SIGSTOP)", "launch", f"{took:.0f} s", "exit 3 naming node2"))
    finally:
        for p in sshd:
            os.kill(p, signal.SIGCONT)
    assert runstate.UNREACHABLE_GRACE_S <= 60


# --------------------------------------------------------------------------- faults in the start phase


def agent_wrapper(tmp_path: Path, fault: str) -> tuple[str, Path]:
    """A node interpreter that runs `fault` (shell) when node2's agent is asked to start a run, then the
    real agent: a slow PC or a lost reply at that moment, made on purpose. Returns (path, marker prefix)."""
    mark = tmp_path / "mark"
    w = tmp_path / "python-wrapper"
    w.write_text(f"""#!/bin/sh
if [ "$(hostname)" = node2 ] && [ "$2" = start ]; then
  touch {mark}.entered
  {fault}
fi
exec {sys.executable} "$@"
""")
    w.chmod(0o755)
    return str(w), mark


# Ctrl-C reaches a clusterctl started from a terminal, where SIGINT is not ignored. A suite started in the
# background (`cmd &` in a script, `nohup`) ignores SIGINT, every child inherits that (POSIX: an ignored
# signal stays ignored across exec) and Python then installs no KeyboardInterrupt: the launcher is started
# through this, with SIGINT at its default, as a user's shell would.
AS_FROM_A_TERMINAL = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]


def launch_in_background(env: dict[str, str], python: str) -> subprocess.Popen[str]:
    # PYTHONFAULTHANDLER: where a launcher does not end in time, SIGABRT makes it print every thread's stack
    return subprocess.Popen([*AS_FROM_A_TERMINAL, "-m", "cluster", "launch", "resnet50-ddp", "--host-set",
                             f"python={python}", *LONG], cwd=ROOT, env={**os.environ, **env, "PYTHONFAULTHANDLER": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def signals_of(pid: int) -> str:
    """The process's signal masks (/proc): pending, blocked, ignored, caught."""
    try:
        return " ".join(x.strip() for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if x.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))
    except OSError as e:
        return str(e)


def ended(launcher: subprocess.Popen[str], timeout: float) -> str:
    """The launcher's stderr once it ends within `timeout`; else an AssertionError with every thread's stack
    (faulthandler, on SIGABRT) and its signal masks: where it waited."""
    try:
        return launcher.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        masks = signals_of(launcher.pid)
        launcher.send_signal(signal.SIGABRT)
        _, errs = launcher.communicate(timeout=30)
        raise AssertionError(f"the launcher did not end within {timeout:g} s ({masks}):\n{errs}") from None


def starting_run(env: dict[str, str]) -> str:
    rc, listed = clusterctl_json("runs", env=env)
    ids = [r["run_id"] for r in listed if r["state"] == "starting"]
    assert rc == 0 and len(ids) == 1, listed
    return ids[0]


def nothing_left(run_id: str) -> float:
    return wait_for(lambda: not procs_of(run_id, "node1") and not procs_of(run_id, "node2"), 30,
                    "no process of the run on either node")


def a_new_launch_works(env: dict[str, str], state) -> None:
    run_id = start_detached(env, state)
    cleanup(env, state, run_id)


def test_stop_while_starting_wins(flab, tmp_path: Path) -> None:
    """`clusterctl stop` while node2's start is on its way (a slow PC): the stop is confirmed, node2's start
    arrives after it and is refused, the launcher stops what it started and returns at once, exit 1."""
    state, env = flab
    python, mark = agent_wrapper(tmp_path, "sleep 8")
    launcher = launch_in_background(env, python)
    try:
        wait_for(lambda: Path(f"{mark}.entered").exists(), 240, "node2's start under way")
        run_id = starting_run(env)
        t0 = time.monotonic()
        rc, rec = clusterctl_json("stop", run_id, env=env, timeout=120)
        assert rc == 0 and rec["state"] == "stopped" and rec["stop_pending"] == [], rec
        errs = ended(launcher, 60)
        took = time.monotonic() - t0
        assert launcher.returncode == 1, errs
        assert "stopped while it was starting" in " ".join(errs.split()), errs
        left = nothing_left(run_id)
        rc, st = clusterctl_json("status", run_id, env=env, timeout=120)
        assert rc == 1 and st["state"] == "stopped" and st["stop_pending"] == [], st
        assert st["last_status"] is None or all(s["state"] in ("stopped", "not started", "missing")
                                                for s in st["last_status"].values()), st["last_status"]
        node2 = Path(state.nodes[1].dir) / "srv" / "runs" / run_id
        assert not (node2 / "pid.json").exists(), "node2's late start was refused"
        ROWS.append(("`stop` while node2's start is slow (8 s)", "starting", f"{took:.0f} s to launch's exit 1",
                     f"stopped on both, node2's late start refused, nothing left ({left:.0f} s)"))
        a_new_launch_works(env, state)
    finally:
        launcher.kill()
        launcher.wait()


def test_ctrl_c_while_starting_cancels_the_launch(flab, tmp_path: Path) -> None:
    state, env = flab
    # node2's start held 20 s (under launch's 30-s limit on a start command): the Ctrl-C below lands while the
    # run is starting even when this machine is so busy that `clusterctl runs` takes seconds (held 8 s, a
    # loaded CI once saw the run running first)
    python, mark = agent_wrapper(tmp_path, f"sleep 20; touch {tmp_path / 'mark'}.slept")
    launcher = launch_in_background(env, python)
    run_id = None
    try:
        wait_for(lambda: Path(f"{mark}.entered").exists(), 240, "node2's start under way")
        run_id = starting_run(env)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        errs = ended(launcher, 60)
        took = time.monotonic() - t0
        assert launcher.returncode == 130, errs
        assert "interrupted while it was starting" in " ".join(errs.split()) and "nothing of it runs on" in errs
        wait_for(lambda: Path(f"{mark}.slept").exists(), 60, "node2's late start")
        time.sleep(3)  # node2's start arrives after the cancel and is refused
        left = nothing_left(run_id)
        rc, st = clusterctl_json("status", run_id, env=env, timeout=120)
        assert rc == 1 and st["state"] == "stopped" and st["stop_pending"] == [] and st["stopped_by_user"], st
        ROWS.append(("Ctrl-C while node2's start is slow (20 s)", "starting", f"{took:.0f} s to exit 130",
                     f"stopped on both, nothing left ({left:.0f} s after node2's late start)"))
        a_new_launch_works(env, state)
    finally:
        launcher.kill()
        launcher.wait()
        if run_id is not None:  # where it failed, the next test finds the nodes free
            cleanup(env, state, run_id)


def test_a_lost_start_reply_is_stopped_or_kept_pending(flab, tmp_path: Path) -> None:
    """node2 starts the run, then its link goes down before the reply: launch stops node1, keeps node2 in
    stop_pending (exit 3, saying which); once the link is back the run's watcher stops node2 by itself."""
    state, env = flab
    python, mark = agent_wrapper(tmp_path, f'{sys.executable} "$@" > {tmp_path}/reply; touch {tmp_path}/mark.started; '
                                           'sleep 120; exit 0')
    launcher = launch_in_background(env, python)
    run_id = None
    try:
        wait_for(lambda: Path(f"{mark}.started").exists(), 240, "node2 started")
        run_id = starting_run(env)
        link(state, 1, False)
        t0 = time.monotonic()
        _, errs = launcher.communicate(timeout=180)
        took = time.monotonic() - t0
        flat = " ".join(errs.split())
        assert launcher.returncode == 3, errs
        assert "no start reply from node2" in flat and "nothing of it runs on node1" in flat, errs
        assert "NOT confirmed stopped on node2" in flat, errs
        assert procs_of(run_id, "node2") and not procs_of(run_id, "node1")
        rec = saved(env, run_id)
        assert rec["state"] == "failed" and rec["stop_pending"] == ["node2"] and rec["failure"]["node"] == "node2"
        link(state, 1, True)
        back = wait_for(lambda: not saved(env, run_id)["stop_pending"], 120, "the watcher's stop on node2")
        left = nothing_left(run_id)
        rc, st = clusterctl_json("status", run_id, env=env, timeout=120)
        assert rc == 1 and st["state"] == "failed" and st["stop_pending"] == [], st
        ROWS.append(("node2's start reply lost (link cut after it started)", "starting",
                     f"{took:.0f} s to exit 3", f"node1 stopped, node2 pending; its watcher stopped it {back:.0f} s "
                                                f"after the link came back, nothing left ({left:.0f} s)"))
        a_new_launch_works(env, state)
    finally:
        link(state, 1, True)
        launcher.kill()
        launcher.wait()
        if run_id:
            cleanup(env, state, run_id)
