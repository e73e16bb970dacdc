"""Who holds which PC of the room's Slurm (`clusterctl room`): every user's queued and running jobs, and each
PC's state, as the controller's squeue and sinfo say them (one SSH command; parsers tested on recorded
output, tests/fixtures/room/)."""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.errors import ClusterError
from cluster.inventory.model import RoomCluster
from cluster.transport import transport_for

QUEUE_FORMAT = "%i|%u|%j|%T|%N|%S|%l|%r"  # id, user, name (a clusterctl run's id), state, PCs, start, limit, reason
PCS_FORMAT = "%N|%T"
MARK = "@@pcs"
POWER_MARK = "@@power"
POWER_LOG = "/var/log/slurm/clusterctl-power.log"  # cluster/room/slurm_power.py's, on the controller
POWER_LINES = 20000  # a room's suspends and resumes over weeks; more is cut (its oldest)
# sinfo's state suffixes (sinfo(1) NODE STATE CODES): what each says of a PC
SUFFIXES = {"~": "powered off", "#": "powering up", "%": "powering down", "*": "not responding",
            "!": "power down pending", "$": "maintenance", "@": "reboot pending", "^": "reboot requested",
            "-": "planned"}


@dataclass(frozen=True)
class Job:
    job_id: str
    user: str
    name: str
    state: str
    pcs: str  # Slurm's node list (node[1-2]); for a pending job, its reason instead
    since: str  # its start time (expected, for a pending job; N/A when Slurm cannot say)
    time_limit: str
    reason: str


@dataclass(frozen=True)
class Pc:
    name: str
    state: str  # idle, allocated, mixed, down, drained, ...
    notes: tuple[str, ...] = ()  # what sinfo's suffix says: powered off, not responding, ...


@dataclass
class RoomView:
    room: str
    jobs: list[Job] = field(default_factory=list)
    pcs: list[Pc] = field(default_factory=list)
    power_log: list[str] = field(default_factory=list)  # the power program's JSON lines (power saving only)

    def to_dict(self) -> dict[str, Any]:
        return {"room": self.room, "jobs": [asdict(j) for j in self.jobs], "pcs": [asdict(p) for p in self.pcs]}


def command(partition: str) -> str:
    """squeue, sinfo, then the power program's log (power saving: what it switched off and woke, readable by
    every user); the exit code is sinfo's."""
    p = shlex.quote(partition)
    return (f"squeue -h -p {p} -o {shlex.quote(QUEUE_FORMAT)} && echo {MARK} && "
            f"sinfo -h -N -p {p} -o {shlex.quote(PCS_FORMAT)}; rc=$?; echo {POWER_MARK}; "
            f"tail -n {POWER_LINES} {POWER_LOG} 2>/dev/null; exit $rc")


def parse_jobs(text: str) -> list[Job]:
    out = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) == 8 and parts[0].strip():
            out.append(Job(*(x.strip() for x in parts)))
    return out


def parse_pcs(text: str) -> list[Pc]:
    """One line per PC (a PC in two partitions is listed once per partition: kept once)."""
    seen: dict[str, Pc] = {}
    for line in text.splitlines():
        name, _, raw = line.strip().partition("|")
        if not name or not raw:
            continue
        state = raw.rstrip("".join(SUFFIXES))
        notes = tuple(SUFFIXES[c] for c in raw[len(state):] if c in SUFFIXES)
        seen.setdefault(name, Pc(name, state, notes))
    return list(seen.values())


def look(room: RoomCluster) -> RoomView:
    """The controller's answer (read as its login user: squeue and sinfo need no root)."""
    with transport_for(room.controller) as t:
        r = t.run(command(room.partition), timeout=60)
    if r.exit_code != 0 or MARK not in r.stdout:
        raise ClusterError(f"squeue/sinfo on the controller of room {room.name} failed (exit {r.exit_code}): "
                           f"{(r.stderr or r.stdout).strip()[-400:]}",
                           "is the room set up? `clusterctl provision --slurm`")
    jobs, _, rest = r.stdout.partition(MARK)
    pcs, _, power = rest.partition(POWER_MARK)
    return RoomView(room.name, parse_jobs(jobs), parse_pcs(pcs), power.splitlines())

