"""`clusterctl provision --slurm`: the room as a Slurm cluster (cluster.room.setup); `--undo` takes it down."""
from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from rich.markup import escape

from cluster import errors
from cluster.cli.output import bar, emit_json, notes, out, table

if TYPE_CHECKING:
    from cluster.inventory.model import Inventory
    from cluster.room.plan import Action
    from cluster.room.setup import Outcome


def cmd_room(args: argparse.Namespace, inv: Inventory) -> int:
    from cluster.room import setup

    if args.limit:
        raise errors.UsageError("--limit does not go with --slurm: the room's PCs are those its declaration names",
                                "change `slurm.ROOM.nodes` in the inventory, then run provision --slurm again")
    if args.purge_packages and not args.undo:
        raise errors.UsageError("--purge-packages goes with --undo", "clusterctl provision --slurm --undo --purge-packages")
    start = time.monotonic()
    with bar("{task.description}") as progress:
        task = progress.add_task("facts and state", total=None)

        def shown(a: Action) -> None:
            progress.update(task, description=f"{a.pc}: {a.what}")

        if args.undo:
            result = setup.undo(inv, args.room, dry_run=args.dry_run, purge=args.purge_packages, forks=args.forks,
                                on_action=shown)
        else:
            result = setup.provision(inv, args.room, dry_run=args.dry_run, forks=args.forks, log=notes(args.json),
                                     on_action=shown)
    wall = time.monotonic() - start
    if args.json:
        emit_json({**result.to_dict(), "wall_s": round(wall, 1)})
    else:
        _print(result, wall)
    return errors.EXIT_OK if result.ok else errors.EXIT_FAILED


def _print(r: Outcome, wall: float) -> None:
    if r.dry_run:
        from cluster.room.plan import dry_run_text

        out.print(dry_run_text(r.room, r.actions, r.undo), highlight=False, markup=False, end="", soft_wrap=True)
    elif not r.actions:
        out.print(f"nothing changed: room {r.room} is already " + ("taken down" if r.undo else "set up"))
    else:
        for pc, what in r.done.items():
            out.print(f"{escape(pc)}: {escape('; '.join(what))}")
    if r.sinfo:
        t = table(f"room {r.room}: sinfo on the controller", ("node", "state", "CPUs", "memory MB"))
        for row in r.sinfo:
            t.add_row(row["node"], row["state"], str(row["cpus"]), str(row["memory_mb"]))
        out.print(t)
        out.print(f"srun -N{len(r.srun)} hostname answered from: {', '.join(r.srun)}")
    for note in r.notes:
        out.print(f"note: {escape(note)}")
    if not r.dry_run:
        out.print(f"provision --slurm{' --undo' if r.undo else ''} took {wall:.0f} s")
