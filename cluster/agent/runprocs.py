"""Which live processes are a run's on this node (stdlib only, beside nodeagent.py), found three ways
because torchrun puts its workers in sessions of their own: the process group the agent started (trusted only
while its leader is provably the same process: same boot, same start time), the descendants of that leader,
and any process whose environment carries the run's CLUSTER_RUN_ID and this node's CLUSTER_NODE_NAME (set by
launch.sh). pid.json keeps the boot id and the leader's start time (/proc/PID/stat field 22): after a reboot, or
once the leader is gone and its number could have been handed out again, only processes that carry the run's
identity in their environment count, so `status` never calls a stranger running and `stop` never signals it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:  # in the package (tests, type checks)
    from cluster.agent.runfiles import read_json
else:  # on the node: beside this file
    from runfiles import read_json

if TYPE_CHECKING:  # the node's system Python may be older than the head's: aliases for mypy only
    Doc = dict[str, Any]  # one JSON object: a file of the run folder, or a reply


def _env_tags(run_dir: Path) -> tuple[bytes, bytes]:
    job = read_json(run_dir / "job.json") or {}
    return (f"CLUSTER_RUN_ID={job.get('run_id', '')}".encode(), f"CLUSTER_NODE_NAME={job.get('node', '')}".encode())


def _live() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, pgid, start time in clock ticks since boot) for every live process we can see."""
    out: dict[int, tuple[int, int, int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            out[int(d)] = (int(fields[1]), int(fields[2]), int(fields[19]))
    return out


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _leader_is_ours(pid_doc: Doc, procs: dict[int, tuple[int, int, int]]) -> bool:
    """The recorded session leader is still the process we started: same boot, same start time."""
    leader = pid_doc.get("pgid")
    if not isinstance(leader, int) or leader not in procs:
        return False
    return pid_doc.get("boot_id") == boot_id() and pid_doc.get("leader_start") == procs[leader][2]


def run_processes(run_dir: Path) -> list[int]:
    """Every live process of this run on this node (see the module docstring)."""
    pid_doc = read_json(run_dir / "pid.json") or {}
    tags = _env_tags(run_dir)
    procs = _live()
    leader = pid_doc.get("pgid") if _leader_is_ours(pid_doc, procs) else None
    found = {p for p, (_, pgid, _) in procs.items() if leader and pgid == leader}
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(p)
    stack = list(found)
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in found:
                found.add(c)
                stack.append(c)
    if tags[0] != b"CLUSTER_RUN_ID=":
        for p in procs:
            if p in found:
                continue
            try:
                env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if tags[0] in env and tags[1] in env:
                found.add(p)
    found.discard(os.getpid())
    return sorted(found)
