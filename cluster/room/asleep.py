"""PCs a room's Slurm switched off (power saving, `suspend_after`), and waking them through Slurm: a job of the
user's own that holds them a moment (`srun -w PCS true`), which Slurm's power saving wakes them for, as for any
job. No root needed, and a PC another job holds is awake already (it is only waited for)."""
from __future__ import annotations

import shlex
from typing import Callable

from cluster.errors import ClusterError, TransportError
from cluster.inventory.model import Host
from cluster.room import view
from cluster.transport import transport_for

ASLEEP = {"powered off", "powering down", "powering up", "power down pending"}  # sinfo's ~ % # ! said in words
WAKE_TIMEOUT_S = 600.0  # bounded: Slurm's ResumeTimeout (300 s unless recorded wakes say otherwise) and a queue's wait


def asleep(listing: str) -> list[str]:
    """sinfo's `%N|%T` lines -> the PCs that are off or on their way (view.parse_pcs says the suffixes)."""
    return [pc.name for pc in view.parse_pcs(listing) if ASLEEP & set(pc.notes)]


def wake(controller: Host, partition: str, names: list[str], log: Callable[[str], None] = lambda s: None,
         timeout: float = WAKE_TIMEOUT_S) -> list[str]:
    """Wake the PCs of `names` that Slurm switched off, through Slurm, and wait (bounded) until they answer;
    returns those it woke ([] where none sleeps, or the controller does not answer: the caller's own error
    then names the PCs)."""
    q = shlex.quote
    try:
        with transport_for(controller) as t:
            r = t.run(f"sinfo -h -N -p {q(partition)} -n {q(','.join(names))} -o '%N|%T'", timeout=60)
            sleeping = asleep(r.stdout) if r.ok else []
            if not sleeping:
                return []
            log(f"{', '.join(sleeping)}: switched off by the room's Slurm (power saving): waking them through it "
                f"(srun -w, at most {timeout:.0f} s)")
            w = t.run(f"srun -p {q(partition)} -N{len(sleeping)} -w {q(','.join(sleeping))} --exclusive true",
                      timeout=timeout)
    except TransportError:
        return []
    if not w.ok:
        raise ClusterError(f"the room's Slurm did not wake {', '.join(sleeping)} (srun exit {w.exit_code}): "
                           f"{(w.stderr or w.stdout).strip()[-400:]}",
                           "see `clusterctl room` for their state; a PC marked down did not wake (its reason says why)")
    return sleeping
