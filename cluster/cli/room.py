"""`clusterctl provision --slurm`: the room as a Slurm cluster (cluster.room.setup); `--undo` takes it down.
`clusterctl room`: who holds which PC of it (cluster.room.view)."""
from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from cluster import errors
from cluster.cli.args import POSITIVE_FLOAT, add_inventory_option
from cluster.cli.output import bar, emit_json, err, load_inventory, out, styled, table

if TYPE_CHECKING:
    from cluster.inventory.model import Inventory
    from cluster.room.plan import Action
    from cluster.room.view import RoomView
    from cluster.room.setup import Outcome


def configure(name: str, p: argparse.ArgumentParser) -> None:
    p.add_argument("inventory_pos", nargs="?", metavar="INVENTORY",
                   help="inventory YAML (default: the current context)")
    add_inventory_option(p, "inventory YAML (same as the positional)")
    p.add_argument("--room", metavar="NAME", help="which room of the inventory (default: its only one)")
    p.add_argument("--hours", type=POSITIVE_FLOAT, default=24.0, metavar="H",
                   help="power saving: each PC's hours off and the energy saved over the last H hours (default 24)")
    p.set_defaults(fn=cmd_view)


def cmd_view(args: argparse.Namespace) -> int:
    """Every user's jobs in the room's queue and each PC's state, from its controller."""
    from cluster.room import view
    from cluster.room.setup import room_of

    inv = load_inventory(args.inventory_pos or args.inventory, None, args.ssh_config)
    seen = view.look(room_of(inv, args.room))
    saved = power_saved(seen, args.hours)
    if args.json:
        emit_json({**seen.to_dict(), "power_saving": saved})
        return errors.EXIT_OK
    print_view(seen)
    if saved is not None:
        t = table(f"room {seen.room}: power saving over the last {args.hours:g} h (Slurm switched idle PCs off)",
                  ("PC", "hours off", "energy saved kWh", "idle W"))
        for row in saved["pcs"]:
            t.add_row(row["node"], f"{row['hours']:.2f}", f"{row['kwh_saved']:.3f}",
                      f"{row['idle_w']:g} ({row['idle_w_source']})")
        out.print(t)
    return errors.EXIT_OK


def power_saved(seen: RoomView, hours: float) -> dict[str, Any] | None:
    """Hours off and energy saved (cluster.room.power), at the report's idle estimate."""
    from cluster.room import power
    from cluster.study.node_figures import IDLE_W

    return power.saved_over(seen.power_log, [pc.name for pc in seen.pcs], hours, IDLE_W)


def print_view(seen: RoomView) -> None:
    t = table(f"room {seen.room}: its Slurm's queue", ("job", "user", "run", "state", "PCs or reason", "since",
                                                       "time limit"))
    for j in seen.jobs:
        t.add_row(j.job_id, j.user, j.name, styled(j.state.lower()),
                  j.pcs if j.state == "RUNNING" else (j.reason or j.pcs), j.since, j.time_limit)
    out.print(t if seen.jobs else f"room {seen.room}: no job queued or running")
    t = table(f"room {seen.room}: its PCs", ("PC", "state", "notes"))
    for pc in seen.pcs:
        t.add_row(pc.name, pc.state, ", ".join(pc.notes))
    out.print(t)


def room_views(args: argparse.Namespace) -> list[RoomView]:
    """`runs --all`: each room of the inventory as its controller sees it (none declared: said, none shown)."""
    from cluster.room import view

    inv = load_inventory(args.inventory, None, args.ssh_config)
    if not inv.rooms:
        err.print(f"note: {escape(str(inv.path))} declares no room: only this head's runs are shown")
    return [view.look(room) for room in inv.rooms.values()]


def stop_others(args: argparse.Namespace, unknown: errors.UsageError) -> int:
    """`stop RUN` of a run this head has no record of: its job in the inventory's rooms' Slurm, by name,
    cancelled as this user, or Slurm's refusal said as Slurm said it (exit 1); `unknown` where no room has it."""
    from cluster.schedulers import api

    try:
        inv = load_inventory(args.inventory, None, args.ssh_config)
    except errors.ClusterError:
        raise unknown from None
    found = api.stop_unrecorded(inv, args.run)
    if found is None:
        raise unknown
    if args.json:
        emit_json({"run_id": args.run, "slurm": found.to_dict()})
    elif found.cancelled:
        out.print(f"run {escape(args.run)}: Slurm job {found.job_id} of {escape(found.user)} on room {found.room} "
                  "cancelled (this head has no record of it: its logs and metrics stay on its PCs)")
    else:
        err.print(escape(found.refusal(args.run)))
    return errors.EXIT_OK if found.cancelled else errors.EXIT_FAILED



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
            result = setup.provision(inv, args.room, dry_run=args.dry_run, forks=args.forks, on_action=shown)
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
