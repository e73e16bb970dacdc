"""Slurm's power saving for a room (inventory `slurm.ROOM.suspend_after`): what slurm.conf is told, and
what the power program's log on the controller says about the hours each PC was off.

Where wake times are recorded: `clusterctl wake` (and `launch --wake`) measures each PC's seconds from its
first magic packet to its SSH answer and keeps each PC's slowest beside its MAC, in the head's per-inventory
record (cluster.nodes.power.record_wakes: CLUSTERCTL_HOME/state/<inventory>.macs.json, `wake_s`). Slurm's
ResumeTimeout is 1.5x the slowest of the room's PCs (at least Slurm's own 60 s default: slurmd registers
some seconds after sshd answers), 300 s where none is recorded; the inventory's `resume_timeout` wins.
"""
from __future__ import annotations

import math

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
