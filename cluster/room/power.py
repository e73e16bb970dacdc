"""Slurm's power saving for a room (inventory `slurm.ROOM.suspend_after`): what slurm.conf is told, and
what the power program's log on the controller (cluster/room/slurm_power.py) says about the hours each PC
was off and the energy that saved.

Where wake times are recorded: `clusterctl wake` (and `launch --wake`) measures each PC's seconds from its
first magic packet to its SSH answer and keeps each PC's slowest beside its MAC, in the head's per-inventory
record (cluster.nodes.power.record_wakes: CLUSTERCTL_HOME/state/<inventory>.macs.json, `wake_s`). Slurm's
ResumeTimeout is 1.5x the slowest of the room's PCs (at least Slurm's own 60 s default: slurmd registers
some seconds after sshd answers), 300 s where none is recorded; the inventory's `resume_timeout` wins.
"""
from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from cluster.inventory.model import Inventory, RoomCluster
from cluster.nodes import power as nodepower
from cluster.room.conf import Power

DEFAULT_RESUME_S = 300
MIN_RESUME_S = 60  # Slurm's ResumeTimeout default
WAKE_MARGIN = 1.5


def settings(inv: Inventory, room: RoomCluster) -> Power | None:
    """The room's power saving for slurm.conf; None where it has no `suspend_after` (its PCs stay on)."""
    if room.suspend_after is None:
        return None
    if room.resume_timeout is not None:
        return Power(room.suspend_after, room.resume_timeout, "the inventory's resume_timeout")
    record = nodepower.recorded(inv)
    wakes = {n: float(record[n]["wake_s"]) for n in room.nodes
             if isinstance((record.get(n) or {}).get("wake_s"), (int, float))}
    if not wakes:
        return Power(room.suspend_after, DEFAULT_RESUME_S, f"{DEFAULT_RESUME_S} s: no wake of these PCs is recorded "
                     "yet (`clusterctl wake` records each one's; provision --slurm again then)")
    slowest = max(wakes, key=lambda n: (wakes[n], n))
    seconds = max(MIN_RESUME_S, math.ceil(WAKE_MARGIN * wakes[slowest]))
    return Power(room.suspend_after, seconds, f"{WAKE_MARGIN:g}x the slowest recorded wake ({slowest}: "
                 f"{wakes[slowest]:g} s, by `clusterctl wake`), at least {MIN_RESUME_S} s")


def pcs_json(inv: Inventory, room: RoomCluster) -> dict[str, object]:
    """What the power program reads on the controller (its pcs.json): each PC's address, SSH port and login
    user (whose authorized_keys entry may run only poweroff), its MAC (the inventory's, else the one facts
    recorded; None: not known yet, so it cannot be woken) and the gateway that sends its packet where the
    controller has no address on its network (its last jump host, unless that is the controller)."""
    nodes: dict[str, object] = {}
    for name in room.nodes:
        h = inv.hosts[name]
        gw = h.jumps[-1] if h.jumps and h.jumps[-1].address != room.controller.address else None
        mac = nodepower.mac_of(inv, h)
        nodes[name] = {"address": h.address, "port": h.port, "user": h.user, "mac": mac[0] if mac else None,
                       "gateway": {"address": gw.address, "port": gw.port, "user": gw.user} if gw else None}
    return {"room": room.name, "wol_port": 9, "nodes": nodes}


@dataclass(frozen=True)
class OffTime:
    """One PC's hours off in a period and the energy that saved: hours x its idle watts."""

    node: str
    hours: float
    idle_w: float
    idle_w_source: str  # "facts" or "estimate" (the report's, where no facts give the PC's idle draw)

    @property
    def kwh_saved(self) -> float:
        return self.hours * self.idle_w / 1000.0


def _events(lines: Iterable[str]) -> list[tuple[dt.datetime, str, bool]]:
    """(time, node, off) for each PC the program switched off (suspend) or woke (resume), in time order; a
    failed call, a resume-fail (the PC did not come up: still off) and a line that is not the program's
    change nothing."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
            when = dt.datetime.fromisoformat(rec["time"])
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(rec, dict) and rec.get("ok") is True and rec.get("action") in ("suspend", "resume") \
                and when.tzinfo is not None:
            out.append((when, str(rec["node"]), rec["action"] == "suspend"))
    return sorted(out, key=lambda e: e[0])


def off_times(lines: Iterable[str], start: dt.datetime, end: dt.datetime, nodes: Iterable[str],
              idle_w: Mapping[str, float], estimate_w: float) -> list[OffTime]:
    """Each PC's hours off within [start, end) from the power log's JSON lines: off from a successful
    suspend to the next successful resume; a PC off at `start` counts from `start`, one still off at `end`
    counts to `end`. `idle_w`: the PCs' idle watts from their facts, where known; else `estimate_w` (the
    report's estimate, cluster.study.node_figures.IDLE_W, which this layer does not import)."""
    if end <= start:
        raise ValueError(f"the period ends ({end.isoformat()}) before it starts ({start.isoformat()})")
    off_since: dict[str, dt.datetime | None] = {n: None for n in nodes}
    seconds = dict.fromkeys(off_since, 0.0)
    for when, node, off in _events(lines):
        if node not in off_since or when >= end:
            continue
        since = off_since[node]
        if off and since is None:
            off_since[node] = max(when, start)
        elif not off and since is not None:
            seconds[node] += max(0.0, (when - since).total_seconds()) if when > start else 0.0
            off_since[node] = None
    for node, since in off_since.items():
        if since is not None:
            seconds[node] += (end - since).total_seconds()
    return [OffTime(n, seconds[n] / 3600.0, idle_w.get(n, estimate_w),
                    "facts" if n in idle_w else "estimate") for n in off_since]
