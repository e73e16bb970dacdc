"""`clusterctl runs`: the runs recorded on this head (one's own: records live in one's own ~/.clusterctl);
with --all, also every user's queued and running jobs in the inventory's rooms (cluster.cli.room's view)."""
from __future__ import annotations

import argparse
import time

from rich.markup import escape

from cluster import errors
from cluster.cli.args import add_inventory_option
from cluster.cli.output import emit_json, err, out, styled, table


def configure(name: str, p: argparse.ArgumentParser) -> None:
    p.add_argument("--all", action="store_true",
                   help="also every user's queued and running jobs in the inventory's rooms (their Slurm's queue), "
                        "with user, PCs and time limit, and each PC's state")
    add_inventory_option(p, "with --all: the inventory whose rooms are shown (default: the current context)")
    p.set_defaults(fn=cmd_runs)


def cmd_runs(args: argparse.Namespace) -> int:
    from cluster.runs import records as runs
    from cluster.schedulers import api

    records, damaged = runs.scan()
    where = {r.run_id: api.of(r).where(r) for r in records}  # as last seen: `runs` asks no node
    if args.json:
        rows = [{k: getattr(r, k) for k in ("run_id", "job", "state", "scheduler", "created", "started", "ended",
                                            "world_size", "stop_pending")}
                | {"nodes": [n.node for n in r.nodes], "where": where[r.run_id]} for r in records] \
            + [{"error": e.message, "fix": e.fix} for e in damaged]
        if args.all:
            from cluster.cli.room import room_views

            emit_json({"runs": rows, "rooms": {v.room: v.to_dict() for v in room_views(args)}})
        else:
            emit_json(rows)
        return errors.EXIT_USAGE if damaged else errors.EXIT_OK
    t = table(f"runs in {escape(str(runs.runs_dir()))}", ("run", "job", "state", "nodes", "world", "started", "took",
                                                          *(("where",) if any(where.values()) else ())))
    for r in records:
        took = f"{(r.ended or time.time()) - r.started:.0f}s" if r.started else "-"
        t.add_row(r.run_id, r.job, styled(r.state), ",".join(n.node for n in r.nodes), str(r.world_size),
                  time.strftime("%Y-%m-%d %H:%M", time.localtime(r.started)) if r.started else "-", took,
                  *((escape(where[r.run_id]),) if any(where.values()) else ()))
    out.print(t)
    for e in damaged:  # never dropped silently: the busy check refuses while one is there
        err.print(f"[red]{escape(e.message)}[/red]\n  fix: {escape(e.fix or '')}")
    if not records and not damaged:
        out.print("no runs yet: clusterctl launch resnet50-ddp")
    if args.all:
        from cluster.cli.room import print_view, room_views

        for v in room_views(args):
            print_view(v)
    return errors.EXIT_USAGE if damaged else errors.EXIT_OK
