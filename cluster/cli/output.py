"""What every command prints with: the two consoles, JSON, tables, progress, and the inventory it names.

Human output goes to stdout (`out`), progress and notes to stderr (`err`), `--json` to stdout only.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from rich.console import Console, OverflowMethod
from rich.markup import escape
from rich.table import Table

from cluster.inventory import context

if TYPE_CHECKING:
    from rich.progress import Progress

    from cluster.inventory.model import Inventory

# Piped output is read by people later (logs, CI): don't squeeze it into 80 columns.
_WIDE = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
out = Console(highlight=False, width=_WIDE)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # messages stay whole: grep-able, copy-able

# How a run's (or a node's) state is coloured wherever it is shown.
RUN_STYLE = {"running": "yellow", "starting": "yellow", "queued": "cyan", "restarting": "yellow", "succeeded": "green", "failed": "red",
             "stopped": "magenta", "stopping": "magenta", "vanished": "red", "unreachable": "red", "missing": "red",
             "not started": "dim"}


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def table(title: str, columns: Iterable[str], overflow: OverflowMethod = "ellipsis") -> Table:
    t = Table(title=title)
    for col in columns:
        t.add_column(col, overflow=overflow)
    return t


def styled(state: str, default: str = "white") -> str:
    """A state word in its colour (rich markup)."""
    return f"[{RUN_STYLE.get(state, default)}]{state}[/]"


def error_line(tag: str, who: str, message: str, fix: str | None = None) -> str:
    """`error node: message` with its fix on the next line, as every command reports a node's failure."""
    return f"[red]{tag}[/red] {who}: {escape(message)}" + (f"\n    fix: {escape(fix)}" if fix else "")


def notes(quiet: bool) -> Callable[[str], None]:
    """The library's progress messages: dim lines on stderr, none with --json."""
    def log(message: str) -> None:
        if not quiet:
            err.print(f"[dim]{escape(message)}[/dim]")
    return log


def bar(label: str) -> Progress:
    """A transient progress bar on stderr, shown only on a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True, disable=not err.is_terminal)


def load_inventory(given: str | None, overrides: list[str] | None = None,
                   ssh_config: str | None = None) -> Inventory:
    """The inventory named on the command line, else the current context's (said on stderr); `ssh_config`
    (-F FILE) is the field on every host, as --set ssh_config=FILE would make it."""
    if ssh_config:  # as `ssh -F`: relative to the current folder (in an inventory: to the inventory's)
        cfg = ssh_config if ssh_config == "none" else str(Path(ssh_config).expanduser().resolve())
        overrides = [*(overrides or []), f"ssh_config={cfg}"]
    from cluster.inventory import loader

    path, why = context.resolve(given)
    if why != "given":
        err.print(f"[dim]inventory: {escape(str(path))} ({why})[/dim]")
    inv = loader.load(path, overrides=overrides or ())
    for note in inv.notes:
        err.print(f"[yellow]note[/yellow]: {escape(note)}")
    return inv
