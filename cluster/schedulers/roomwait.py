"""The head's waiter of a run queued on the room's Slurm (`launch --on ROOM`): a process of its own (started
by submit, detached from the terminal like the run's watcher) that asks squeue until Slurm gives the job its
PCs, then launches the run on exactly those PCs, as an SSH launch with the same run id (the run's watcher
judges it). Then it keeps the run within its job: a job Slurm ends while the run goes on (its time limit, an
admin's scancel) stops the run, since Slurm gives those PCs to the next job. One waiter per run (a lock);
`clusterctl stop` of a queued run cancels the job and the waiter ends.

    python -m cluster.schedulers.roomwait RUN_ID
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from cluster.errors import ClusterError, TransportError
from cluster.inventory import loader
from cluster.runs import jobs, launch, records, state as runstate
from cluster.runs.preflight import LaunchRefused
from cluster.schedulers.room import FOLLOW_S, controller_of, queue_state, release
from cluster.slurm.run import LIVE, job_state
from cluster.transport import transport_for

BUSY_S = 120.0  # the PCs' previous run is judged ended by its watcher within seconds of Slurm freeing them
GUARD_S = 5.0  # between two looks at the job while its run goes on


def _say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def hostnames(record: records.RunRecord, nodelist: str) -> list[str]:
    """Slurm's node list (`node[1-2]`) as names, by the controller's own `scontrol show hostnames`."""
    with transport_for(controller_of(record)) as t:
        r = t.run(f"scontrol show hostnames {nodelist}", timeout=60)
    if r.exit_code != 0:
        raise ClusterError(f"scontrol show hostnames {nodelist} failed: {r.stderr.strip()[-300:]}")
    return r.stdout.split()


def start_on(record: records.RunRecord, names: list[str]) -> records.RunRecord:
    """The run's SSH launch on the PCs Slurm gave, with the run id and the Slurm job kept in its record."""
    tg: dict[str, Any] = dict(record.target or {})
    inv_doc = tg.get("inventory") or {}
    inv = loader.load(inv_doc["path"], inv_doc.get("overrides", ()))  # --host-set and -F, as the launch had them
    spec = jobs.from_run(record.spec_file, record.settings)
    deadline = time.monotonic() + BUSY_S
    while True:
        try:
            request = launch.prepare(inv, spec, limit=",".join(names), run_id=record.run_id, log=_say)
            request.scheduler, request.target = record.scheduler, {**tg, "nodes_given": names}
            return launch.execute(request, log=_say, watch=True)
        except LaunchRefused as e:  # bounded: BUSY_S
            if "still" not in e.message or time.monotonic() > deadline:
                raise
            _say(f"{e.message}: asking again")
            time.sleep(5)


def wait(run_id: str) -> None:
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(records.file_lock(records.run_path(run_id) / ".roomwait.lock",
                                                 f"waiter of {run_id}", wait=0))
        except ClusterError:
            return  # another waiter has it
        record = records.load(run_id)
        if record.active and record.nodes:  # a waiter that died while the run went on: guard it again
            guard(run_id)
            return
        said = None
        while record.active and not record.nodes:  # bounded: Slurm's queue; a stop or a dead job ends it
            try:
                record = queue_state(record)
            except ClusterError as e:
                _say(str(e))
            tg = record.target or {}
            if record.active and tg.get("state") == "CONFIGURING" and tg.get("state") != said:
                _say(f"Slurm gave job {tg.get('job_id')} the PCs {tg.get('nodelist')}: it waits for them to power up")
            said = tg.get("state")
            # RUNNING: every PC answers (CONFIGURING: Slurm's power saving still wakes some, bounded by ResumeTimeout)
            if record.active and tg.get("state") == "RUNNING" and tg.get("nodelist"):
                _say(f"Slurm gave job {tg.get('job_id')} the PCs {tg['nodelist']}: launching")
                try:
                    record = start_on(record, hostnames(record, tg["nodelist"]))
                except (ClusterError, TransportError, OSError) as e:
                    why = f"launch on the PCs Slurm gave ({tg['nodelist']}) failed: {e}"
                    _say(why)
                    records.update(run_id, lambda r: _failed(r, why))
                    release(records.load(run_id))
                    return
                guard(run_id)
                return
            time.sleep(FOLLOW_S)
            record = records.load(run_id)
        release(record)


def guard(run_id: str) -> None:
    """While the run goes on (bounded by its own end), its Slurm job must too; once it ended, its PCs given back."""
    while True:
        record = records.load(run_id)
        if not record.active:
            release(record)
            return
        job = str((record.target or {}).get("job_id"))
        try:
            with transport_for(controller_of(record)) as t:
                state, reason, _ = job_state(t, job)
        except (TransportError, ClusterError):
            state = "RUNNING"  # the controller does not answer: nothing known, nothing done
        if state not in LIVE and state != "UNKNOWN":
            why = f"Slurm ended job {job} ({state}{', ' + reason if reason else ''}) while the run went on: its PCs " \
                  "are Slurm's again"
            _say(f"{why}: stopping the run")
            records.update(run_id, lambda r: _ended_by_slurm(r, why))
            runstate.stop(records.load(run_id))
            return
        time.sleep(GUARD_S)


def _ended_by_slurm(r: records.RunRecord, why: str) -> None:
    r.failure = records.Failure(node=(r.target or {}).get("cluster", "?"), reason=why)
    (r.target or {})["ended_by_slurm"] = why


def _failed(r: records.RunRecord, why: str) -> None:
    if r.active:
        r.failure = records.Failure(node=(r.target or {}).get("cluster", "?"), reason=why)
        r.move("failed")


if __name__ == "__main__":
    wait(sys.argv[1])
