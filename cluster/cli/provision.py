"""`clusterctl provision`: the same verified training environment on every node (cluster.provision.apply)."""
from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from cluster import errors
from cluster.cli.args import POSITIVE_FLOAT, add_inventory_args
from cluster.cli.context import switch
from cluster.cli.output import emit_json, err, error_line, load_inventory, notes, out, table

if TYPE_CHECKING:
    from rich.progress import TaskID

    from cluster.provision.compat import BuildChoice
    from cluster.provision.playbook import StepResult
    from cluster.provision.apply import ProvisionReport
    from cluster.relay.distribute import NodeProgress


def configure(name: str, p: argparse.ArgumentParser) -> None:
    add_inventory_args(p)
    p.add_argument("--dry-run", action="store_true", help="show the builds chosen and what would change; change nothing")
    p.add_argument("--verify", action="store_true",
                   help="repeat the imports and the all-reduce even when nothing changed since the last run")
    p.add_argument("--slurm", action="store_true",
                   help="make the room a Slurm cluster: munge and Slurm on the PCs the inventory's `slurm.ROOM` "
                        "declares (a controller and a group of nodes), verified with sinfo and srun")
    p.add_argument("--room", metavar="NAME", help="with --slurm: which room of the inventory (default: its only one)")
    p.add_argument("--undo", action="store_true",
                   help="with --slurm: stop and disable munge and Slurm, remove the files provision --slurm wrote")
    p.add_argument("--purge-packages", action="store_true", help="with --slurm --undo: remove the packages too")
    p.add_argument("--drain-timeout", type=POSITIVE_FLOAT, default=600.0, metavar="S",
                   help="PCs a room's Slurm holds are drained first: how long to wait for its jobs there to end "
                        "(default 600 s); they are resumed afterwards")
    p.set_defaults(fn=cmd_provision)


class _Live:
    """One spinner line per node: its current step, or the wheels it has received."""

    def __init__(self, quiet: bool) -> None:
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                                 transient=True, disable=not err.is_terminal or quiet)
        self.tasks: dict[str, TaskID] = {}
        self.sent: dict[str, int] = {}
        self.relaying: set[str] = set()

    def _show(self, host: str, text: str) -> None:
        if host not in self.tasks:
            self.tasks[host] = self.progress.add_task(host)
        self.progress.update(self.tasks[host], description=f"{host}: {text}")

    def on_step(self, host: str, r: StepResult) -> None:
        self._show(host, f"{r.name} [{r.status}]")

    def on_bytes(self, host: str, n: int) -> None:
        self.sent[host] = self.sent.get(host, 0) + n
        if host not in self.relaying:  # while the relay runs, its own line says more (of how much, from whom)
            self._show(host, f"wheels {self.sent[host] / 2**20:.0f} MiB received")

    def on_relay(self, p: NodeProgress) -> None:
        if p.state in ("waiting", "receiving"):
            self.relaying.add(p.node)
        else:  # done or failed: what the playbook's wheels step sends afterwards shows again
            self.relaying.discard(p.node)
        self._show(p.node, f"wheels {p.line()}")


def cmd_provision(args: argparse.Namespace) -> int:
    from cluster.provision import apply
    from cluster.room import drain

    if not args.slurm and (args.room or args.undo or args.purge_packages):
        raise errors.UsageError("--room, --undo and --purge-packages go with --slurm", "clusterctl provision --slurm --undo")
    inv = load_inventory(args.inventory_pos or args.inventory, args.set, args.ssh_config)
    if args.slurm:
        from cluster.cli.room import cmd_room

        return cmd_room(args, inv)
    hosts = inv.select(args.limit)
    live = _Live(args.json)
    start = time.monotonic()
    with live.progress:
        request = apply.prepare(inv, hosts, forks=args.forks, log=notes(args.json))
        with drain.drained(inv, [h.name for h in hosts], args.drain_timeout, notes(args.json),
                           dry_run=args.dry_run) as drained:  # Slurm's PCs: its jobs there end first
            report = apply.execute(request, dry_run=args.dry_run, verify_all=args.verify, forks=args.forks,
                                   log=notes(args.json), on_step=live.on_step, on_bytes=live.on_bytes,
                                   on_relay=live.on_relay)
    if not args.dry_run and any(n.status == "ok" for n in report.nodes.values()):
        switch(inv.path)  # says so on stderr when the current context changes
    wall = time.monotonic() - start  # what the user waited: wheels downloaded and sent included
    if args.json:
        emit_json({**report.to_dict(), "wall_s": round(wall, 1), "slurm_drained": drained})
    else:
        _print_report(report)
        for room, pcs in drained.items():
            out.print(f"room {escape(room)}: {escape(', '.join(pcs))} " + (
                "would be drained in its Slurm first, then resumed" if args.dry_run else
                "drained in its Slurm for the provision (its jobs there ended first), then resumed"))
        out.print(f"{'dry run' if args.dry_run else 'provision'} took {wall:.0f} s in all (the table's steps s: "
                  "each node's own steps, after its wheels arrived)")
    statuses = {n.status for n in report.nodes.values()}
    if "unreachable" in statuses:
        return errors.EXIT_UNREACHABLE
    return errors.EXIT_OK if report.ok else errors.EXIT_FAILED


def _print_builds(choice: BuildChoice) -> None:
    t = table(f"builds: torch {choice.torch}, TensorFlow {choice.tensorflow}, backend {choice.backend}",
              ("node", "GPU", "cc", "driver", "torch", "TensorFlow", "AMP", "notes"), overflow="fold")
    for name, b in choice.builds.items():
        t.add_row(name, b.gpu or "none", b.compute_capability or "-", b.driver or "-",
                  b.torch_label, f"{b.tensorflow} ({'GPU' if b.tf_on_gpu else 'CPU'})",
                  "on" if b.amp else "off", "; ".join(b.notes + b.pins))
    out.print(t)


def _print_nodes(report: ProvisionReport) -> None:
    t = table("dry run: what provision would do" if report.dry_run else "provision",
              ("node", "status", "changed", "unchanged", "steps s", "torch", "TensorFlow", "all-reduce"), overflow="fold")
    style = {"ok": "green", "failed": "red", "unreachable": "red", "refused": "red"}
    for n in report.nodes.values():
        fp = n.fingerprint or {}
        ar = n.allreduce or {}
        t.add_row(n.host, f"[{style.get(n.status, 'yellow')}]{n.status}[/]", str(n.changed), str(n.unchanged),
                  f"{n.duration:.1f}s", fp.get("torch") or "-", fp.get("tensorflow") or "-",
                  f"{ar['busbw_MBps']:.0f} MB/s" if ar.get("busbw_MBps") is not None else "-")
    out.print(t)
    if report.dry_run:
        for n in report.nodes.values():
            for s in n.steps:
                out.print(f"  {n.host}: {s.name}: [{'yellow' if s.status == 'would change' else 'dim'}]{s.status}[/]"
                          + (f" — {escape(s.detail)}" if s.detail else ""))


def _print_report(report: ProvisionReport) -> None:
    if report.choice is not None:
        _print_builds(report.choice)
    for line in (report.distribution or {}).get("lines", []):
        out.print(f"wheels: {escape(line)}")
    _print_nodes(report)
    for line in report.fingerprint_diff:
        out.print(f"[red]fingerprint differs[/red] {escape(line)}")
    for n in report.nodes.values():
        if n.error:
            out.print(error_line("error", n.host, n.error, n.fix))
    for note in report.notes:
        out.print(f"note: {escape(note)}")
    if not report.dry_run and report.nothing_to_do:
        out.print("nothing to do: every step was already done and every environment is as verified")
