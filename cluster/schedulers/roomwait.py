"""The head's waiter of a run queued on the room's Slurm (`launch --on ROOM`): a process of its own (started
by submit, detached from the terminal like the run's watcher) that asks squeue until Slurm gives the job its
PCs, then launches the run on exactly those PCs, as an SSH launch with the same run id, and leaves it to the
watcher. One waiter per run (a lock); `clusterctl stop` of a queued run cancels the job and the waiter ends.

    python -m cluster.schedulers.roomwait RUN_ID
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from cluster.errors import ClusterError, TransportError
from cluster.inventory import loader
from cluster.runs import jobs, launch, records
from cluster.runs.preflight import LaunchRefused
from cluster.schedulers.room import FOLLOW_S, controller_of, queue_state, release
from cluster.transport import transport_for

BUSY_S = 120.0  # the PCs' previous run is judged ended by its watcher within seconds of Slurm freeing them


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
    inv = loader.load(inv_doc["path"])
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
        while record.active and not record.nodes:  # bounded: Slurm's queue; a stop or a dead job ends it
            try:
                record = queue_state(record)
            except ClusterError as e:
                _say(str(e))
            tg = record.target or {}
            if record.active and tg.get("state") in ("RUNNING", "CONFIGURING") and tg.get("nodelist"):
                _say(f"Slurm gave job {tg.get('job_id')} the PCs {tg['nodelist']}: launching")
                try:
                    record = start_on(record, hostnames(record, tg["nodelist"]))
                except (ClusterError, TransportError, OSError) as e:
                    why = f"launch on the PCs Slurm gave ({tg['nodelist']}) failed: {e}"
                    _say(why)
                    records.update(run_id, lambda r: _failed(r, why))
                    release(records.load(run_id))
                return
            time.sleep(FOLLOW_S)
            record = records.load(run_id)
        release(record)


def _failed(r: records.RunRecord, why: str) -> None:
    if r.active:
        r.failure = records.Failure(node=(r.target or {}).get("cluster", "?"), reason=why)
        r.move("failed")


if __name__ == "__main__":
    wait(sys.argv[1])
