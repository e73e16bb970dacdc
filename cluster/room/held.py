"""Which PCs of an inventory Slurm holds: those of a room `provision --slurm` set up (its note on the head,
removed by `--undo`), or, on a head without the note (a student's: the note is the admin's), those the
room's own Slurm knows, asked on its controller. clusterctl's own SSH launches, bench, wake and poweroff
leave them to Slurm."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

from cluster import paths
from cluster.errors import ClusterError, UsageError
from cluster.inventory.model import Inventory

SET_UP = "set-up.json"
OVERRIDE = "--outside-slurm"


class SlurmHolds(UsageError):
    """A command of clusterctl's own on PCs the room's Slurm holds: one refusal for all of them (a study stops
    at it rather than failing each cell)."""


def folder(inv: Inventory, room: str) -> Path:
    """The head's folder of a room (its munge key, its set-up note): per inventory name and room name."""
    return paths.home() / "rooms" / inv.name / room


def held(inv: Inventory) -> dict[str, str]:
    """PC name -> the set-up room that holds it (as the note says; a room the inventory no longer declares,
    or whose note is unreadable, holds nothing)."""
    out: dict[str, str] = {}
    for name, room in inv.rooms.items():
        note = folder(inv, name) / SET_UP
        try:
            nodes = json.loads(note.read_text()).get("nodes", [])
        except (OSError, ValueError, AttributeError):
            continue
        out.update({n: name for n in nodes if n in room.nodes})
    return out


def asked(inv: Inventory, names: list[str], log: Callable[[str], None] = lambda s: None) -> dict[str, str]:
    """PC name -> room, for the PCs of `names` in a declared room this head has no note of, that the room's
    Slurm knows (`sinfo` on its controller, which never runs jobs). A controller that does not answer, or runs
    no Slurm (a room not set up yet, or undone), holds nothing."""
    from cluster.transport import transport_for  # only where a room lacks its note

    out: dict[str, str] = {}
    for name, room in inv.rooms.items():
        mine = [n for n in names if n in room.nodes]
        if not mine or (folder(inv, name) / SET_UP).exists():
            continue
        try:
            with transport_for(room.controller) as t:
                r = t.run("sinfo -h -N -o %N 2>/dev/null", timeout=15)
        except ClusterError as e:
            log(f"room {name}: its controller did not say whether Slurm holds {', '.join(mine)} ({e.message})")
            continue
        known = set(r.stdout.split()) if r.exit_code == 0 else set()
        out.update({n: name for n in mine if n in known})
    return out


def guard(inv: Inventory, names: Iterable[str], refusal: str, fix: str, outside: bool = False,
          log: Callable[[str], None] = lambda s: None) -> None:
    """Refuse `names` that a room's Slurm holds, before anything contacts them: Slurm gives them to its jobs,
    and clusterctl's own use would run beside them unseen (`refusal` and `fix` may say `{them}`, `fix` also
    `{room}`). With `outside` (the admin's --outside-slurm) it only says so through `log`."""
    names = list(names)
    holds = {**asked(inv, names, log), **held(inv)}
    mine = [n for n in names if n in holds]
    if not mine:
        return
    rooms = sorted({holds[n] for n in mine})
    them = "it" if len(mine) == 1 else "them"
    who = f"{', '.join(mine)} {'is' if len(mine) == 1 else 'are'} Slurm's: room {', '.join(rooms)} holds {them} " \
          "(provision --slurm)"
    if outside:
        log(f"{who}; {OVERRIDE}: this runs beside Slurm's jobs there")
        return
    raise SlurmHolds(f"{who}: {refusal.format(them=them)}",
                     f"{fix.format(room=rooms[0], them=them)}; or add {OVERRIDE} to run beside Slurm's jobs (admin)")
