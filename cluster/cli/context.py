"""`clusterctl context`: show or set the inventory commands use when none is given (cluster.inventory.context).

Which inventory a command uses: `-i` (or the positional) > $CLUSTERCTL_INVENTORY > the current context
saved here > the embedded inventory/local.yaml (docs/cli.md, "Which inventory").
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.markup import escape

from cluster import errors
from cluster.inventory import context, loader
from cluster.cli.output import emit_json, err, out


def configure(name: str, p: argparse.ArgumentParser) -> None:
    p.add_argument("inventory_pos", nargs="?", metavar="INVENTORY")
    p.add_argument("--clear", action="store_true",
                   help="forget the current context (commands then use inventory/local.yaml)")
    p.set_defaults(fn=cmd_context)


def cmd_context(args: argparse.Namespace) -> int:
    path: Path | None
    if args.clear and args.inventory_pos:
        raise errors.UsageError("INVENTORY and --clear together", "set one (clusterctl context INVENTORY) or clear")
    if args.clear:
        context.clear()
        path, msg = None, "no current inventory (commands use inventory/local.yaml)"
    elif args.inventory_pos:
        inv = loader.load(args.inventory_pos)
        path = context.set_current(inv.path)
        msg = f"current inventory: {path} ({len(inv.hosts)} hosts)"
    else:
        path = context.current()
        msg = f"current inventory: {path}" if path else "no current inventory (commands use inventory/local.yaml)"
    env = os.environ.get(context.ENV)
    if args.json:
        emit_json({"inventory": str(path) if path else None, **({"environment": env} if env else {})})
    else:
        out.print(escape(msg))
        if env:
            out.print(f"{context.ENV}={escape(env)} is set: commands without -i use it, not the context")
    return errors.EXIT_OK


def switch(inventory: Path) -> Path:
    """Make `inventory` the current context; when that changes it, one line on stderr says so and how to
    switch back (`provision` and `lab up` call this). Returns the path saved."""
    before = context.current()
    now = context.set_current(inventory)
    if before != now:
        back = f"clusterctl context {before}" if before else "clusterctl context --clear"
        line = f"current context is now {now} (was {before or 'none: inventory/local.yaml'}; switch back: {back})"
        env = os.environ.get(context.ENV)
        if env:
            line += f"; {context.ENV}={env} still comes first in this shell"
        err.print(f"[dim]{escape(line)}[/dim]")
    return now
