"""The node agent, run for real on this machine: detached start, status, stop of a whole process tree."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

AGENT = ROOT / "cluster" / "agent" / "nodeagent.py"


def agent(*args: str) -> dict:
    r = subprocess.run([sys.executable, str(AGENT), *args], capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout)


def make_run(tmp_path: Path, script: str, run_id: str = "r1") -> Path:
    d = tmp_path / run_id
    (d / "out").mkdir(parents=True)
    (d / "job.json").write_text(json.dumps({"run_id": run_id, "node": "n1"}))
    (d / "launch.sh").write_text(f"CLUSTER_RUN_ID={run_id} CLUSTER_NODE_NAME=n1\n"
                                 f"export CLUSTER_RUN_ID CLUSTER_NODE_NAME\n{script}")
    return d


def wait_state(d: Path, want: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = agent("status", str(d))
        if st["state"] == want:
            return st
        time.sleep(0.1)
    raise AssertionError(f"state {st['state']}, wanted {want}")


def test_start_returns_at_once_and_stop_ends_every_process(tmp_path: Path) -> None:
    # a child in its own session (as torchrun's workers are) must be found and stopped too
    d = make_run(tmp_path, "echo started\nsleep 300 &\nsetsid sleep 301 &\n"
                           "echo '{\"type\": \"step\", \"step\": 3, \"loss\": 1.5}' > out/metrics-rank0.jsonl\nwait\n")
    t0 = time.monotonic()
    started = agent("start", str(d))
    assert started["ok"] and time.monotonic() - t0 < 5
    st = wait_state(d, "running")
    assert len(st["processes"]) >= 4
    assert st["metrics"]["0"]["step"]["step"] == 3
    stopped = agent("stop", str(d), "5")
    assert stopped["ok"] and stopped["left"] == []
    st = agent("status", str(d))
    assert st["state"] == "stopped" and st["processes"] == [] and "started" in st["log"]
    assert agent("start", str(d))["ok"] is False  # a run folder starts once


def test_exit_codes_become_succeeded_or_failed(tmp_path: Path) -> None:
    ok, bad = make_run(tmp_path, "exit 0\n", "ok"), make_run(tmp_path, "echo boom >&2; exit 3\n", "bad")
    agent("start", str(ok))
    agent("start", str(bad))
    assert wait_state(ok, "succeeded")["exit"]["code"] == 0
    st = wait_state(bad, "failed")
    assert st["exit"]["code"] == 3 and st["log"] == ["boom"]


def test_a_leader_killed_without_an_exit_record_is_vanished(tmp_path: Path) -> None:
    d = make_run(tmp_path, "sleep 300\n")
    pgid = agent("start", str(d))["pgid"]
    wait_state(d, "running")
    subprocess.run(["kill", "-9", "--", f"-{pgid}"], check=True)
    wait_state(d, "vanished")


def test_a_reused_process_group_number_is_not_taken_for_the_run(tmp_path: Path) -> None:
    """After a reboot (or once the leader is gone) the recorded pgid may belong to a stranger: status must
    not call it running and stop must not signal it."""
    d = make_run(tmp_path, "exit 0\n")
    stranger = subprocess.Popen(["setsid", "sleep", "300"])  # a process group that is not the run's
    try:
        time.sleep(0.2)
        pgid = int(Path(f"/proc/{stranger.pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
        for doc in ({"pgid": pgid, "launcher_pid": pgid, "started": 1.0},  # written by an older agent
                    {"pgid": pgid, "launcher_pid": pgid, "started": 1.0, "boot_id": "another-boot",
                     "leader_start": 1},
                    {"pgid": pgid, "launcher_pid": pgid, "started": 1.0,
                     "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(), "leader_start": 1}):
            (d / "pid.json").write_text(json.dumps(doc))
            st = agent("status", str(d))
            assert st["state"] == "vanished" and st["processes"] == []
            assert agent("stop", str(d), "1")["terminated"] == []
            assert stranger.poll() is None  # still alive: never signalled
            (d / "stop.json").unlink()
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.parametrize("arg", ["", "bogus"])
def test_usage(arg: str) -> None:
    r = subprocess.run([sys.executable, str(AGENT), *([arg] if arg else [])], capture_output=True, text=True)
    assert r.returncode == 2 and "start" in r.stderr


def test_stop_where_the_run_never_started_is_confirmed_and_the_start_never_comes(tmp_path: Path) -> None:
    """A node the run never reached has nothing to stop: its stop is done, not pending forever. The stop
    request stays in the folder, so an upload and a start still on their way (a launch in `starting`
    when `clusterctl stop` came) start nothing."""
    r = subprocess.run([sys.executable, str(AGENT), "stop", str(tmp_path / "never"), "1"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True and json.loads(r.stdout)["left"] == []
    assert agent("status", str(tmp_path / "never"))["state"] == "stopped"
    make_run(tmp_path, "touch started\nsleep 300\n", "never")  # the late upload
    refused = agent("start", str(tmp_path / "never"))
    assert refused["ok"] is False and refused["stop_requested"] is True
    time.sleep(0.3)
    st = agent("status", str(tmp_path / "never"))
    assert st["state"] == "stopped" and st["processes"] == [] and not (tmp_path / "never" / "started").exists()


def test_a_stop_before_the_start_wins_and_a_start_never_holds_the_lock(tmp_path: Path) -> None:
    """stop after upload, before start: the start refuses. And a started run's leader does not keep the
    agent's lock (a stop right after a start answers at once, not after the lock's 10 s)."""
    d = make_run(tmp_path, "sleep 300\n", "early")
    assert agent("stop", str(d), "1")["ok"] is True
    assert agent("start", str(d))["stop_requested"] is True
    assert agent("status", str(d))["state"] == "stopped"
    late = make_run(tmp_path, "sleep 300\n", "late")
    assert agent("start", str(late))["ok"] is True
    t0 = time.monotonic()
    stopped = agent("stop", str(late), "2")
    assert stopped["ok"] is True and stopped["terminated"] and time.monotonic() - t0 < 5
    assert agent("status", str(late))["state"] == "stopped"
    assert not list(late.glob(".*")), "the lock leaves no file in the run folder (collect copies all of it)"


def test_a_leader_that_ends_while_status_looks_is_succeeded_not_vanished(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader writes exit.json, then exits. A status that lists the processes while that happens must
    still find the record: it reads exit.json after the processes (read before, such a run 'vanished' and a
    launch that had succeeded exited 1)."""
    from cluster.agent import nodeagent

    d = make_run(tmp_path, "exit 0\n")
    (d / "pid.json").write_text(json.dumps({"pgid": 999999, "launcher_pid": 999999, "started": time.time()}))

    def leader_ends_now(run_dir: Path) -> list[int]:  # the leader records its exit and is gone, mid-status
        (run_dir / "exit.json").write_text(json.dumps({"code": 0, "ended": time.time()}))
        return []

    monkeypatch.setattr(nodeagent, "run_processes", leader_ends_now)
    assert nodeagent.status(d)["state"] == "succeeded"


def test_a_launcher_that_outlives_its_workers_is_stopped_on_the_node(tmp_path: Path) -> None:
    """torchrun's agent blocked on an unreachable store after its worker ended: the node agent's leader
    stops it by itself once no worker has lived for the bound (2 s here), and the run fails."""
    d = make_run(tmp_path, "LOCAL_RANK=0 sleep 3 &\nsleep 300\n")
    r = subprocess.run([sys.executable, str(AGENT), "start", str(d)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "CLUSTERCTL_ORPHAN_AGENT_S": "2"})
    assert json.loads(r.stdout)["ok"]
    st = wait_state(d, "failed", timeout=40)
    assert st["processes"] == [] and any("outlived its last worker" in x for x in st["log"])


def test_a_run_without_torchrun_workers_is_never_cut(tmp_path: Path) -> None:
    d = make_run(tmp_path, "sleep 5\n")
    r = subprocess.run([sys.executable, str(AGENT), "start", str(d)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "CLUSTERCTL_ORPHAN_AGENT_S": "0.5"})
    assert json.loads(r.stdout)["ok"]
    assert wait_state(d, "succeeded", timeout=40)["exit"]["code"] == 0


def test_a_failed_runs_status_names_the_ranks_and_the_programs_traceback() -> None:
    """Recorded: node.log of a torchrun run (--tee 3, rank prefixes) whose two ranks raised; the program's
    traceback is found under torchrun's own (ChildFailedError), the ranks read from torchrun's summary."""
    from cluster.agent import runfiles

    got = runfiles.failure(ROOT / "tests" / "fixtures" / "launch" / "torchrun-failed-node.log")
    assert got["failed_ranks"] == [0, 1]
    assert got["traceback"][0] == "Traceback (most recent call last):"
    assert got["traceback"][-1] == "RuntimeError: deliberate failure on group rank 0"
    assert not any("torch/distributed" in x for x in got["traceback"])


def test_restart_for_a_new_period_after_the_heads_stop_and_never_after_the_users(tmp_path: Path) -> None:
    """The head re-forms a run (cluster/runs/elastic.py): `stop ... reform`, then `restart DIR 2 NOTE`. The
    last period's files are kept, the log says why; a lost reply asked again gets the same start; a running
    run is never restarted; the user's stop (even after the head's) refuses every later restart."""
    d = make_run(tmp_path, "echo \"period ${CLUSTER_PERIOD:-1}\"\nsleep 300\n")
    assert agent("start", str(d))["ok"]
    wait_state(d, "running")
    assert agent("restart", str(d), "2", "x")["ok"] is False  # still running: stop first
    assert agent("stop", str(d), "5", "reform")["ok"]
    (d / "launch.sh").write_text((d / "launch.sh").read_text().replace("${CLUSTER_PERIOD:-1}", "2"))
    first = agent("restart", str(d), "2", "period 2: n1 goes on without n2")
    assert first["ok"] and first["period"] == 2
    again = agent("restart", str(d), "2", "period 2: n1 goes on without n2")
    assert again["ok"] and again["already"] and again["pgid"] == first["pgid"]
    st = wait_state(d, "running")
    assert (d / "attempts" / "period-1" / "pid.json").exists() and (d / "attempts" / "period-1" / "stop.json").exists()
    log = (d / "node.log").read_text()
    assert "---- clusterctl: period 2: n1 goes on without n2 ----" in log and "period 2" in st["log"][-1]
    assert agent("stop", str(d), "5", "reform")["ok"]
    assert agent("stop", str(d), "5")["ok"]  # the user's stop replaces the head's request
    refused = agent("restart", str(d), "3", "x")
    assert refused["ok"] is False and refused["stop_requested"]
    assert agent("status", str(d))["state"] == "stopped"


def test_a_stop_asked_after_the_launcher_ended_leaves_it_succeeded(tmp_path: Path) -> None:
    """A stop that comes between the launcher's end and its exit record (the leader closes the firewall and
    writes the record) finds no record and writes its own: the run had ended by itself, exit 0, and must be
    reported so, not as stopped. A stop asked before the end still stops it, whatever the exit code."""
    d = make_run(tmp_path, "exit 0\n")
    agent("start", str(d))
    ended = wait_state(d, "succeeded")["exit"]["ended"]
    (d / "stop.json").write_text(json.dumps({"time": ended + 0.01}))  # as `stop` writes it, just after the end
    assert agent("status", str(d))["state"] == "succeeded"
    (d / "stop.json").write_text(json.dumps({"time": ended - 0.01}))  # asked before the launcher ended
    assert agent("status", str(d))["state"] == "stopped"
    (d / "stop.json").write_text("{")  # a stop record that cannot be read still says a stop was asked
    assert agent("status", str(d))["state"] == "stopped"


def test_the_exit_record_keeps_the_launchers_end_not_the_records_time(tmp_path: Path) -> None:
    """The exit record's `ended` is when the launcher returned, taken before the firewall is closed (an nft
    call on a node with a firewall opened for the run) and the record written, so a stop asked meanwhile is
    later than it."""
    d = make_run(tmp_path, "exit 0\n")
    t0 = time.time()
    agent("start", str(d))
    st = wait_state(d, "succeeded")
    assert t0 < st["exit"]["ended"] <= (d / "exit.json").stat().st_mtime


def test_the_programs_tmpdir_is_the_runs_own_and_goes_when_the_launch_ends(tmp_path: Path) -> None:
    """What a program leaves in TMPDIR (a stopped TensorFlow's autograph modules, torchrun's torchelastic_*
    folders) goes with the launch, ended or stopped, instead of piling up in the PC's /tmp; never collected."""
    script = ('echo "$TMPDIR" > out/tmpdir\npython3 -c "import tempfile; print(tempfile.mkdtemp())" > out/made\n'
              "touch \"$TMPDIR/left\"\n")
    ended, stopped = make_run(tmp_path, script + "exit 0\n", "ended"), make_run(tmp_path, script + "sleep 300\n", "stop")
    for d in (ended, stopped):
        agent("start", str(d))
    wait_state(ended, "succeeded")
    deadline = time.monotonic() + 20
    while not (stopped / ".tmp" / "left").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [x["path"] for x in agent("manifest", str(stopped))["files"] if x["path"].startswith(".tmp")] == []
    agent("stop", str(stopped), "5")
    wait_state(stopped, "stopped")
    for d in (ended, stopped):
        tmp = d / ".tmp"
        assert (d / "out" / "tmpdir").read_text().strip() == str(tmp)
        assert Path((d / "out" / "made").read_text().strip()).parent == tmp
        assert not tmp.exists()


def test_a_run_whose_tmpdir_cannot_be_made_still_starts_with_the_nodes_own(tmp_path: Path) -> None:
    d = make_run(tmp_path, 'echo "${TMPDIR:-unset}" > out/tmpdir\nexit 0\n')
    (d / ".tmp").write_text("a file where the folder would go")
    agent("start", str(d))
    wait_state(d, "succeeded")
    assert (d / "out" / "tmpdir").read_text().strip() == os.environ.get("TMPDIR", "unset")
    assert "the programs keep the node's TMPDIR" in (d / "node.log").read_text()
