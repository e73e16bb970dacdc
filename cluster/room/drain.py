"""`provision` on PCs a room's Slurm holds: drain them on the room's controller (Slurm starts no new job there),
wait, bounded, until the jobs running there have ended, let the caller provision, then resume them, whatever
happened meanwhile (a failed or interrupted provision included): a PC is never left drained by clusterctl."""
from __future__ import annotations

import contextlib
import shlex
import time
from typing import Callable, Iterator

from cluster.errors import ClusterError
from cluster.inventory.model import Inventory, RoomCluster
from cluster.room import held
from cluster.room.state import root
from cluster.transport import transport_for

REASON = "clusterctl_provision"
DRAIN_TIMEOUT_S = 600.0
JOB_FORMAT = "%i|%u|%j|%N"  # squeue's id, user, name and nodes of each job

Log = Callable[[str], None]


def drain_command(room: RoomCluster, pcs: list[str]) -> str:
    return (f"{root(room.controller)}scontrol update {shlex.quote('NodeName=' + ','.join(pcs))} State=DRAIN "
            f"Reason={REASON}")


def resume_command(room: RoomCluster, pcs: list[str]) -> str:
    return f"{root(room.controller)}scontrol update {shlex.quote('NodeName=' + ','.join(pcs))} State=RESUME"


def jobs_command(pcs: list[str]) -> str:
    """The jobs Slurm runs on `pcs` (a pending job has no PC yet: it is not listed)."""
    return f"squeue -h -w {shlex.quote(','.join(pcs))} -o {shlex.quote(JOB_FORMAT)}"


def parse_jobs(out: str) -> list[tuple[str, str]]:
    """squeue's lines -> (job id, how it is said: `job 12 (resnet50-ddp of student, on node1,node2)`)."""
    jobs = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            jobs.append((parts[0], f"job {parts[0]} ({parts[2]} of {parts[1]}, on {parts[3]})"))
    return jobs


def rooms_of(inv: Inventory, names: list[str]) -> dict[str, list[str]]:
    """room name -> the PCs of `names` that room's Slurm holds, in the order given."""
    holds = held.held(inv)
    rooms: dict[str, list[str]] = {}
    for n in names:
        if n in holds:
            rooms.setdefault(holds[n], []).append(n)
    return rooms


def _scontrol(room: RoomCluster, command: str, what: str) -> None:
    with transport_for(room.controller) as t:
        r = t.run(command, timeout=60)
    if not r.ok:
        raise ClusterError(f"room {room.name}: {what} refused on its controller {room.controller.address} "
                           f"(exit {r.exit_code}): {(r.stderr or r.stdout).strip()[-300:]}",
                           f"run `{command}` there by hand")


def wait_idle(room: RoomCluster, pcs: list[str], timeout: float, log: Log, poll: float = 2.0) -> None:
    """Until Slurm runs no job on `pcs`; past `timeout` s, refuse naming the jobs still there."""
    deadline, said = time.monotonic() + timeout, None
    with transport_for(room.controller) as t:
        while True:
            r = t.run(jobs_command(pcs), timeout=60)
            if not r.ok:
                raise ClusterError(f"room {room.name}: squeue failed on {room.controller.address} (exit "
                                   f"{r.exit_code}): {(r.stderr or r.stdout).strip()[-300:]}",
                                   "check the room's Slurm with `clusterctl provision --slurm`")
            jobs = parse_jobs(r.stdout)
            if not jobs:
                return
            if jobs != said:
                log(f"waiting (at most {timeout:g} s) for Slurm's jobs on them to end: "
                    + "; ".join(s for _, s in jobs))
                said = jobs
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"room {room.name}: Slurm's jobs still run on {', '.join(pcs)} after {timeout:g} s: "
                    + "; ".join(s for _, s in jobs) + "; provision changed nothing",
                    f"wait for them to end and provision again (or a longer --drain-timeout), or cancel them "
                    f"on {room.controller.address}: scancel {' '.join(j for j, _ in jobs)}")
            time.sleep(poll)


@contextlib.contextmanager
def _drained_one(room: RoomCluster, pcs: list[str], timeout: float, log: Log, poll: float) -> Iterator[None]:
    _scontrol(room, drain_command(room, pcs), "drain")
    log(f"drained {', '.join(pcs)} in room {room.name}'s Slurm (reason {REASON}): it starts no new job there")
    try:
        wait_idle(room, pcs, timeout, log, poll)
        yield
    finally:
        _scontrol(room, resume_command(room, pcs), "resume")
        log(f"resumed {', '.join(pcs)} in room {room.name}'s Slurm: its jobs may run there again")


@contextlib.contextmanager
def drained(inv: Inventory, names: list[str], timeout: float = DRAIN_TIMEOUT_S, log: Log = lambda s: None,
            dry_run: bool = False, poll: float = 2.0) -> Iterator[dict[str, list[str]]]:
    """The PCs of `names` a room's Slurm holds, drained and idle while the body runs, resumed after it (each
    room in turn); yields room -> its PCs. `dry_run`: only says what it would do, contacts nothing."""
    rooms = rooms_of(inv, names)
    if dry_run:
        for name, pcs in rooms.items():
            log(f"would drain {', '.join(pcs)} in room {name}'s Slurm, wait for its jobs there to end, provision, "
                "then resume them")
        yield rooms
        return
    with contextlib.ExitStack() as stack:
        for name, pcs in rooms.items():
            stack.enter_context(_drained_one(inv.rooms[name], pcs, timeout, log, poll))
        yield rooms
