"""`launch --on ROOM`'s pure parts: the Slurm job's batch script (run for real by sh: it holds the PCs until the
run's program ended on its PC, and never on a PC outside the room), the sbatch line, and what `status` says
of a queued run."""
from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

from cluster.inventory.model import Host, RoomCluster
from cluster.runs.records import RunNode, RunRecord
from cluster.schedulers.room import SCHEDULER, RoomRequest
from tests.conftest import FIXTURES

ROOM = RoomCluster(name="room", controller=Host(name="controller", address="10.0.0.1"), nodes=("pc1", "pc2"))


def request(workdir: str, name: str = "pc1", time_limit: str | None = None) -> RoomRequest:
    hosts = [{"name": name, "workdir": workdir}, {"name": "pc2", "workdir": "/srv/cluster"}]
    return RoomRequest("job-1", ROOM, 2, time_limit, None, {"path": "inv.yaml", "hosts": hosts})  # type: ignore[arg-type]


def test_the_batch_script_ends_once_the_run_ended_on_its_pc(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "job-1"
    run.mkdir(parents=True)
    (run / "exit.json").write_text('{"code": 0}')
    script = request(str(tmp_path), name=socket.gethostname()).batch_script()
    r = subprocess.run(["sh", "-c", script], timeout=20, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # a PC the room does not know (a hostname not in the inventory) holds nothing
    r = subprocess.run(["sh", "-c", request(str(tmp_path), name="elsewhere").batch_script()], timeout=20)
    assert r.returncode == 0


def test_the_batch_script_waits_while_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "runs" / "job-1").mkdir(parents=True)
    script = request(str(tmp_path), name=socket.gethostname()).batch_script()
    p = subprocess.Popen(["sh", "-c", script])
    try:
        try:
            p.wait(timeout=3)
            raise AssertionError("the batch script ended while the run had no exit.json")
        except subprocess.TimeoutExpired:
            pass
        (tmp_path / "runs" / "job-1" / "exit.json").write_text("{}")
        assert p.wait(timeout=15) == 0
    finally:
        p.kill()


def test_the_sbatch_line_asks_whole_pcs_of_the_rooms_partition() -> None:
    assert request("/srv/cluster").sbatch() == ("sbatch --parsable --job-name=job-1 --partition=room --nodes=2 "
                                                "--exclusive --requeue --output=/dev/null")
    assert request("/srv/cluster", time_limit="1:00:00").sbatch().endswith(" --time=1:00:00")


def _record(state: str, target: dict[str, Any], nodes: bool = False) -> RunRecord:
    rec = RunRecord(run_id="job-1", job="resnet50-ddp", framework="torch", state=state, created=0.0, clusterctl="x",
                    settings={}, spec_file="", world_size=2, scheduler="room", target=target, inventory={},
                    nodes=[RunNode("pc1", 0, 1, "/srv/cluster/runs/job-1")] if nodes else [])
    return rec


def test_status_says_where_a_queued_run_stands() -> None:
    base = {"cluster": "room", "job_id": "12"}
    assert SCHEDULER.where(_record("queued", {**base, "state": "PENDING", "reason": "Resources", "position": 2})) == \
        "Slurm job 12 on room room: queued (Resources), 2nd in the queue"
    assert SCHEDULER.where(_record("queued", {**base, "state": "RUNNING", "nodelist": "pc[1-2]"})) == \
        "Slurm job 12 on room room: Slurm gave it pc[1-2], starting there"
    assert SCHEDULER.where(_record("running", {**base, "state": "RUNNING"}, nodes=True)) == "Slurm job 12 on room room"
    assert SCHEDULER.where(_record("queued", {**base, "state": "CONFIGURING", "nodelist": "pc[1-2]"})) == \
        "Slurm job 12 on room room: Slurm gave it pc[1-2], waking them"  # the room's power saving


def test_a_run_its_waiter_is_starting_is_left_to_that_launch(tmp_path: Path, monkeypatch: Any) -> None:
    """Between the waiter's record of the PCs and the run's folders on them, only the launch judges the run
    (another process's status or follow read `no run folder` as a failure); a waiter dead midway: judged."""
    from cluster.runs import records
    from cluster.schedulers.room import _waiting

    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    rec = _record("starting", {"cluster": "room", "job_id": "12", "state": "RUNNING"}, nodes=True)
    records.run_path(rec.run_id).mkdir(parents=True)
    with records.file_lock(records.run_path(rec.run_id) / ".roomwait.lock", "the waiter", wait=0):
        assert _waiting(rec)
    assert not _waiting(rec)  # no waiter holds it: the SSH scheduler judges what is on the PCs
    assert _waiting(_record("queued", {"cluster": "room", "job_id": "12", "state": "PENDING"}))


def test_a_run_of_another_student_is_found_in_slurm_by_its_name() -> None:
    from cluster.schedulers.room import parse_owner

    assert parse_owner((FIXTURES / "room" / "squeue-by-name.txt").read_text()) == ("2", "alice", "RUNNING",
                                                                                   "node[1-2]")
    assert parse_owner("") is None  # no job of that name: not a room's run
    # scancel's refusal, as Slurm said it, with whose job it is
    from cluster.schedulers.room import OthersJob

    answer = (FIXTURES / "room" / "scancel-denied.txt").read_text().strip()
    said = OthersJob("room", "2", "alice", "RUNNING", "node[1-2]", False, answer).refusal("resnet50-ddp-1")
    assert said == ("run resnet50-ddp-1 is Slurm job 2 of user alice on room room (running, on node[1-2]), not "
                    "yours: Slurm refused to cancel it: scancel: error: Kill job error on job id 2: "
                    "Access/permission denied")
