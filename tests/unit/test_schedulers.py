"""The scheduler interface (cluster/schedulers): every target implements it, a run record names its scheduler
(records written before the field included), a launch's options are checked against their declarations,
and a Slurm job waiting for nodes is `queued` with Slurm's reason."""
from __future__ import annotations

import inspect
import json
import time

import pytest

from cluster.errors import UsageError
from cluster.runs import records
from cluster.schedulers import api, interface
from cluster.slurm import run as slurm_run
from tests.conftest import FIXTURES


def test_every_scheduler_implements_the_whole_interface() -> None:
    wanted = {n for n, v in vars(interface.Scheduler).items() if inspect.isfunction(v) and not n.startswith("_")}
    for name, sched in api.registry().items():
        assert sched.name == name
        missing = sorted(m for m in wanted if not callable(getattr(sched, m, None)))
        assert missing == [], f"{name} lacks {missing}"
        for m in wanted:  # the same parameters, by name, as the interface declares
            want = list(inspect.signature(getattr(interface.Scheduler, m)).parameters)[1:]
            assert list(inspect.signature(getattr(sched, m)).parameters) == want, (name, m)


def _old_record(target: dict | None) -> dict:
    """A run.json as clusterctl wrote it before records named their scheduler."""
    rec = records.RunRecord("r-1", "resnet50-ddp", "pytorch", "succeeded", time.time(), [],
                            {"path": "x", "name": "lab", "hosts": []}, target=target)
    d = rec.to_dict()
    del d["scheduler"]
    return d


@pytest.mark.parametrize("target, name", [(None, "ssh"), ({"kind": "slurm", "cluster": "hpc", "job_id": "7"}, "slurm")])
def test_a_record_written_before_the_scheduler_field_names_its_scheduler(target: dict | None, name: str) -> None:
    rec = records.RunRecord.from_dict(json.loads(json.dumps(_old_record(target))))
    assert rec.scheduler == name and api.of(rec).name == name
    assert records.RunRecord.from_dict(rec.to_dict()).scheduler == name  # and keeps it when saved again


def test_an_unknown_scheduler_is_refused_naming_it() -> None:
    d = _old_record(None) | {"scheduler": "kubernetes"}
    with pytest.raises(UsageError, match="scheduler 'kubernetes'"):
        api.of(records.RunRecord.from_dict(d))


def test_options_of_another_scheduler_and_those_a_scheduler_cannot_honour_are_refused() -> None:
    ssh, slurm = api.for_launch(None), api.for_launch("hpc")
    with pytest.raises(UsageError, match="--partition goes with --on NAME"):
        api.check_options(ssh, {"partition": "gpu"}, None)
    with pytest.raises(UsageError, match="--limit does not go with --on hpc"):
        api.check_options(slurm, {"limit": "node1"}, "hpc")
    api.check_options(slurm, {"partition": "gpu", "limit": None}, "hpc")  # its own: fine
    api.check_options(ssh, {"limit": "node1"}, None)


def _slurm_record() -> records.RunRecord:
    return records.RunRecord("r-2", "resnet50-ddp", "pytorch", "starting", time.time(), [],
                             {"path": "", "name": "hpc", "hosts": []}, scheduler="slurm",
                             target={"kind": "slurm", "cluster": "hpc", "job_id": None, "run_dir": "/w/runs/r-2",
                                     "state": "SUBMITTING"})


def test_a_pending_job_is_queued_with_slurms_reason_then_running_then_its_verdict() -> None:
    # squeue's own words for a job waiting behind another (tests/fixtures/slurm/squeue_pending.txt)
    reason = (FIXTURES / "slurm" / "squeue_pending.txt").read_text().split(maxsplit=2)[2].strip()
    assert reason == "(Resources)"
    r = _slurm_record()
    slurm_run._submitted(r, "4")
    assert r.state == "queued" and r.started is None
    slurm_run._apply(r, "PENDING", reason.strip("()"), "", {})
    sched = api.of(r)
    assert r.state == "queued" and sched.where(r) == "Slurm job 4 on hpc: PENDING, Resources"
    slurm_run._apply(r, "RUNNING", "None", "node[1-2]", {})
    assert r.state == "running" and r.started is not None
    tasks = {i: {"task": {"node": f"node{i + 1}"}, "exit": {"code": 0}, "log": []} for i in range(2)}
    slurm_run._apply(r, "COMPLETED", "", "node[1-2]", tasks)
    assert r.state == "succeeded" and [n.node for n in r.nodes] == ["node1", "node2"]


@pytest.mark.parametrize("verdict, code, final", [("COMPLETED", 0, "succeeded"), ("FAILED", 1, "failed")])
def test_a_job_that_ran_and_ended_between_two_looks_gets_its_verdict(verdict: str, code: int, final: str) -> None:
    """Queued at one look, ended at the next (a short program): the verdict lands, the record never stays queued."""
    r = _slurm_record()
    slurm_run._submitted(r, "7")
    slurm_run._apply(r, "PENDING", "None", "", {})
    tasks = {i: {"task": {"node": f"node{i + 1}"}, "exit": {"code": code}, "log": []} for i in range(2)}
    slurm_run._apply(r, verdict, "", "node[1-2]", tasks)
    assert r.state == final and not r.active and r.started is not None and r.ended is not None


def test_a_job_slurm_forgot_before_any_task_started_fails_after_a_bound() -> None:
    """Neither squeue nor sacct knows the job and no task left a folder: waited for FORGOTTEN_S, then failed
    saying so (a follow never waits without end)."""
    r = _slurm_record()
    slurm_run._submitted(r, "8")
    why = "neither squeue nor sacct -c knows the job (the cluster keeps no accounting)"
    slurm_run._apply(r, "UNKNOWN", why, "", {})
    assert r.active and r.target is not None and "unknown_since" in r.target
    r.target["unknown_since"] -= slurm_run.FORGOTTEN_S + 1
    slurm_run._apply(r, "UNKNOWN", why, "", {})
    assert r.state == "failed" and r.failure is not None and "no longer knows job 8" in r.failure.reason


def test_a_job_cancelled_while_queued_is_stopped_and_never_ran() -> None:
    r = _slurm_record()
    slurm_run._submitted(r, "5")
    assert r.move("stopping")
    slurm_run._stopped(r, "CANCELLED", {})
    assert r.state == "stopped" and r.nodes == [] and r.stopped_by_user


def test_a_requeued_job_waits_again_as_queued() -> None:
    r = _slurm_record()
    slurm_run._submitted(r, "6")
    slurm_run._apply(r, "RUNNING", "", "node[1-2]", {})
    tasks = {0: {"task": {"node": "node1"}, "exit": {"code": 143}, "log": []},
             1: {"task": {"node": "node2"}, "exit": None, "log": []}}
    slurm_run._apply(r, "PENDING", "BeginTime", "", tasks, down={"node2"})
    assert r.state == "queued" and r.target is not None and r.target["requeued"]["lost"] == ["node2"]
    assert any("requeued by Slurm after it lost node2" in x for x in api.of(r).details(r))
