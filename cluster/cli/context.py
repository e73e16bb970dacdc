"""`clusterctl context`: show or set the inventory commands use when none is given (cluster.inventory.context)."""
from __future__ import annotations

import argparse
from pathlib import Path

from cluster import errors
from cluster.inventory import context, loader
from cluster.cli.output import emit_json, out


def configure(name: str, p: argparse.ArgumentParser) -> None:
    p.add_argument("inventory_pos", nargs="?", metavar="INVENTORY")
    p.set_defaults(fn=cmd_context)


def cmd_context(args: argparse.Namespace) -> int:
    path: Path | None
    if args.inventory_pos:
        inv = loader.load(args.inventory_pos)
        path = context.set_current(inv.path)
        msg = f"current inventory: {path} ({len(inv.hosts)} hosts)"
    else:
        path = context.current()
        msg = f"current inventory: {path}" if path else "no current inventory (commands use inventory/local.yaml)"
    if args.json:
        emit_json({"inventory": str(path) if path else None})
    else:
        out.print(msg)
    return errors.EXIT_OK
