"""Which PCs of an inventory Slurm holds: those of a room `provision --slurm` set up (its note on the head,
removed by `--undo`). clusterctl's own SSH launches, bench, wake and poweroff leave them to Slurm."""
from __future__ import annotations

import json
from pathlib import Path

from cluster import paths
from cluster.inventory.model import Inventory

SET_UP = "set-up.json"


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
