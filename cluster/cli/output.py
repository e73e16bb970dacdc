"""What every command prints with: the two consoles, JSON, tables, progress, and the inventory it names.

Human output goes to stdout (`out`), progress and notes to stderr (`err`), `--json` to stdout only.
"""
from __future__ import annotations

import json
import os
import re
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


# --------------------------------------------------------------------------- a run's log: torchrun's known noise

NOISE_NOTES = {  # docs/code.md, "Known noise in logs"
    "hostname": "clusterctl: harmless, the run succeeded: the c10d warnings {where} (\"The hostname of the client "
                "socket cannot be retrieved. err=-3\") say that no host name was found for a peer's address (no "
                "reverse DNS in the lab or room); the connection uses the address",
    "shutdown": "clusterctl: harmless, the run succeeded: the C++ stack trace {where} (recvVector failed ... failed "
                "to shutdown the rendezvous) is torchrun's normal shutdown on a node that does not host the "
                "rendezvous: the host closed it first"}
_HOSTNAME = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved\. err=-3")
_SHUTDOWN_END = re.compile(r"dynamic_rendezvous\.py:\d+\] The node '[^']*' has failed to shutdown the rendezvous "
                           r"'[^']*' due to an error of type RendezvousConnectionError")
_SHUTDOWN_PART = re.compile(r"(\[W[^\]]* TCPStore\.cpp:\d+\] \[c10d\] recvVector failed|Exception raised from "
                            r"recvBytes |frame #\d+: |<omitting python frames>$|$)")


def noise_kind(line: str) -> str | None:
    """`hostname` for c10d's err=-3 warning, `shutdown` for the last line of torchrun's shutdown trace."""
    return "hostname" if _HOSTNAME.search(line) else "shutdown" if _SHUTDOWN_END.search(line) else None


def noise(lines: list[str]) -> dict[int, tuple[str, int]]:
    """Torchrun's known harmless blocks in a log: {first line: (kind, the line after the block)}: the first run
    of hostname warnings (one note covers the later ones), each shutdown trace, found from its last line back
    (a tail may have cut its start)."""
    found: dict[int, tuple[str, int]] = {}
    for i, line in enumerate(lines):
        kind = noise_kind(line)
        if kind == "hostname" and not any(k == "hostname" for k, _ in found.values()):  # one note says it
            end = i + 1
            while end < len(lines) and noise_kind(lines[end]) == "hostname":
                end += 1
            found[i] = (kind, end)
        elif kind == "shutdown":
            j = i
            while j and _SHUTDOWN_PART.match(lines[j - 1]):
                j -= 1
            while j < i and not lines[j].strip():
                j += 1
            found[j] = (kind, i + 1)
    return found


def with_noise_notes(lines: list[str]) -> list[str]:
    """A succeeded run's log lines, each block of known noise kept and preceded by a note that says so."""
    marks = noise(lines)
    return [x for i, line in enumerate(lines)
            for x in ((NOISE_NOTES[marks[i][0]].format(where="below"), line) if i in marks else (line,))]


def last_line(lines: list[str], succeeded: bool) -> str:
    """The last line worth a table cell: blank lines, c10d's hostname warnings and (once the node succeeded)
    torchrun's shutdown trace passed over."""
    skip = {i for start, (kind, end) in noise(lines).items() if kind == "shutdown" and succeeded
            for i in range(start, end)}
    return next((x for i, x in reversed(list(enumerate(lines)))
                 if x.strip() and i not in skip and noise_kind(x) != "hostname"), "")
