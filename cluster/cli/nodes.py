"""`clusterctl trust|check|exec|hosts|wake|poweroff`: first contact, the nodes' facts and problems, a command
everywhere, what a host pattern selects (no contact), and the room's power."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from cluster import errors
from cluster.cli.args import TIMEOUT_S, WAKE_S, add_inventory_args, add_inventory_option, add_outside_slurm
from cluster.cli.output import bar, emit_json, err, load_inventory, out, table

if TYPE_CHECKING:
    from cluster.inventory.model import Host, Inventory
    from cluster.nodes.power import PowerResult


def configure(name: str, p: argparse.ArgumentParser) -> None:
    if name == "hosts":
        p.add_argument("pattern", nargs="?", default="all", metavar="PATTERN",
                       help="an Ansible host pattern, as --limit takes (default all; docs/cli.md, Host patterns)")
        add_inventory_option(p)
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a host field on every host, as the node commands do; repeatable")
        p.set_defaults(fn=cmd_hosts)
        return
    if name in ("wake", "poweroff"):
        add_inventory_args(p, "inventory YAML (default: the current context); a name that is no file is read as a "
                              "host PATTERN instead, as in `clusterctl poweroff -i INVENTORY node2`")
        p.add_argument("--timeout", type=WAKE_S, default=None, metavar="S",
                       help="how long to wait for the nodes (default 180 s to wake, 120 s to power off)")
        add_outside_slurm(p)
        p.set_defaults(fn=cmd_wake if name == "wake" else cmd_poweroff)
        return
    add_inventory_args(p)
    if name == "trust":
        p.add_argument("--yes", action="store_true", help="record new keys without asking (after checking them)")
        p.set_defaults(fn=cmd_trust)
    elif name == "check":
        p.set_defaults(fn=cmd_check)
    else:
        p.add_argument("--timeout", type=TIMEOUT_S, help="per-node command timeout in seconds (at most 86400)")
        p.set_defaults(fn=cmd_exec)


# --------------------------------------------------------------------------- hosts


def cmd_hosts(args: argparse.Namespace) -> int:
    """What a pattern selects and how each host would be reached; nothing is contacted."""
    inv = load_inventory(args.inventory, args.set, args.ssh_config)
    hosts = inv.select(args.pattern, option="PATTERN")
    if args.json:
        emit_json({"inventory": str(inv.path), "pattern": args.pattern, "matcher": inv.matcher, "hosts": [
            {"name": h.name, "address": h.address, "port": h.port, "user": h.user, "identity_file": h.identity_file,
             "connection": h.connection, "groups": list(h.groups), "route": h.route} for h in hosts]})
        return errors.EXIT_OK
    hops = any(h.jumps or h.proxy_command for h in hosts)  # the route column only where a node is behind a hop
    t = table(f"{inv.name}: {len(hosts)} of {len(inv.hosts)} hosts match {args.pattern!r}",
              ("host", "address", "port", "user", "key file", "connection", "groups", *(["route"] if hops else [])),
              overflow="fold")
    for h in hosts:
        t.add_row(escape(h.name), escape(h.address), str(h.port), escape(h.user), escape(h.identity_file or "-"),
                  h.connection, escape(", ".join(h.groups) or "-"), *([escape(h.route)] if hops else []))
    out.print(t)
    err.print(f"[dim]patterns matched by {escape(inv.matcher)}; nothing was contacted[/dim]")
    return errors.EXIT_OK


# --------------------------------------------------------------------------- trust

_KEY_STYLE = {"new": "yellow", "known": "green", "changed": "bold red", "revoked": "bold red", "unreachable": "red",
              "blocked": "yellow",
              "local": "dim"}


def _confirmed(args: argparse.Namespace, count: int) -> bool:
    """--yes, or a yes typed at the terminal; without a terminal, say how to check and record."""
    if args.yes:
        return True
    if not sys.stdin.isatty():
        err.print("[yellow]not recording: compare the fingerprints above with `ssh-keygen -lf "
                  "/etc/ssh/ssh_host_ed25519_key.pub` on each node, then re-run with --yes[/yellow]")
        return False
    answer = err.input(f"Record {count} new host key(s)? Compare the fingerprints on the nodes first. [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def cmd_trust(args: argparse.Namespace) -> int:
    from cluster.inventory import hostkeys
    from cluster.transport import firstcontact

    inv = load_inventory(args.inventory_pos or args.inventory, args.set, args.ssh_config)
    hosts = inv.select(args.limit)
    final: dict[str, firstcontact.Offer] = {}
    recorded: list[str] = []
    declined = False
    todo = hosts
    # Round after round: a node behind jump hosts can be scanned once their keys are recorded (`blocked` before).
    for _ in range(1 + max((len(h.jumps) for h in hosts), default=0)):
        with err.status(f"contacting {len(todo)} nodes for their host keys"):
            offers = [o for o in firstcontact.survey(todo, args.forks) if o.host.name not in final or not o.jump]
        new = [o for o in offers if o.status == "new"]
        if not args.json:
            # Plain lines, not a table: a fingerprint must never be cut to fit the terminal.
            for o in offers:
                key = f"{o.key.get_name()} {o.fingerprint}" if o.key else "-"
                out.print(f"{escape(o.host.name):<12} {o.host.host_key_name:<22} [{_KEY_STYLE[o.status]}]"
                          f"{o.status:<11}[/] {key}")
            for o in offers:
                if o.message:
                    err.print(f"[red]{escape(o.message)}[/red]")
        final.update({o.host.name: o for o in offers})
        if new and _confirmed(args, len(new)):
            for o in new:
                assert o.key is not None
                hostkeys.record(o.host, o.key)
                recorded.append(o.host.name)
            if not args.json:
                out.print(f"recorded {len(new)} key(s) in "
                          f"{', '.join(sorted({str(o.host.known_hosts_path) for o in new}))}")
        elif new:
            declined = True
        blocked = [h for h in hosts if final[h.name].status == "blocked"]
        if not blocked or not new or declined:
            break
        todo = blocked
    if args.json:
        emit_json({"nodes": [{**o.to_dict(), "recorded": o.host.name in recorded} for o in final.values()]})
    if any(o.status in ("changed", "revoked", "unreachable", "blocked") for o in final.values()) or declined:
        return errors.EXIT_UNREACHABLE
    return errors.EXIT_OK


# --------------------------------------------------------------------------- check


def cmd_check(args: argparse.Namespace) -> int:
    from cluster.nodes import check, facts
    from cluster.nodes.fanout import Group

    inv = load_inventory(args.inventory_pos or args.inventory, args.set, args.ssh_config)
    hosts = inv.select(args.limit)
    with Group(hosts, forks=args.forks) as group, bar("gathering facts") as prog:
        task = prog.add_task("facts", total=len(hosts))
        report = check.run(group, on_done=lambda r: prog.advance(task))
    from cluster.nodes import power

    power.record(inv, report.facts)  # for `wake`, once these PCs are off
    if args.json:
        emit_json({"inventory": str(inv.path), **report.to_dict()})
    else:
        t = table(f"{inv.name}: {len(report.healthy)}/{len(hosts)} nodes healthy",
                  ("node", "address", "state", *facts.SUMMARY_COLUMNS), overflow="fold")
        blocked = {p.host for p in report.blocking}
        for h in hosts:
            r = report.results[h.name]
            state = "[red]unreachable[/]" if r.status == "unreachable" else (
                "[red]problem[/]" if h.name in blocked else "[green]ok[/]")
            cells = facts.summary(r.value.to_dict()) if r.ok else ["-"] * len(facts.SUMMARY_COLUMNS)
            t.add_row(h.name, h.address, state, *(escape(c) if c is not None else "[red]missing[/]" for c in cells))
        out.print(t)
        for p in report.problems:
            tag = "[red]error[/]" if p.blocking else "[yellow]warning[/]"
            out.print(f"{tag} {p.host}: {escape(p.message)}\n    fix: {escape(p.fix)}")
        if not report.problems:
            out.print("no problems found")
    if report.results.unreachable:  # unreachable, or its host key unknown or changed
        return errors.EXIT_UNREACHABLE
    if any(p.blocking for p in report.problems):
        return errors.EXIT_FAILED
    return errors.EXIT_OK


# --------------------------------------------------------------------------- wake, poweroff

_POWER_STYLE = {"up": "green", "woke": "green", "off": "green"}


def _power_hosts(args: argparse.Namespace) -> tuple[Inventory, list[Host]]:
    """[INVENTORY] and --limit, as every node command takes them; a positional that is no file or folder is a
    host pattern (`poweroff -i INVENTORY node2`), never beside --limit."""
    given, shape = args.inventory_pos, f"clusterctl {args.cmd} INVENTORY --limit PATTERN"
    if given is None or Path(given).exists():
        if given and args.inventory and Path(given).resolve() != Path(args.inventory).resolve():
            raise errors.UsageError(f"two inventories given: {given} and -i {args.inventory}", f"give one: {shape}")
        inv = load_inventory(given or args.inventory, args.set, args.ssh_config)
        return inv, inv.select(args.limit)
    if "/" in given or Path(given).suffix in (".yaml", ".yml", ".ini", ".json"):
        raise errors.UsageError(f"{given}: no such inventory file", f"name an existing inventory: {shape}")
    if args.limit:
        raise errors.UsageError(f"{given!r} is no inventory file, and --limit {args.limit!r} names the hosts too",
                                f"name the inventory and the hosts once: {shape}")
    inv = load_inventory(args.inventory, args.set, args.ssh_config)
    return inv, inv.select(given, option="PATTERN")


def _power_report(args: argparse.Namespace, what: str, inv: Inventory, rs: list[PowerResult]) -> int:
    if args.json:
        emit_json({"inventory": str(inv.path), what: [r.to_dict() for r in rs],
                   "ok": sum(r.ok for r in rs), "total": len(rs)})
    else:
        t = table(f"{what}: {sum(r.ok for r in rs)}/{len(rs)} nodes "
                  f"{'answer SSH' if what == 'wake' else 'off'}", ("node", "status", "after s", "MAC", "sent from"),
                  overflow="fold")
        for r in rs:
            t.add_row(escape(r.host), f"[{_POWER_STYLE.get(r.status, 'red')}]{r.status}[/]",
                      f"{r.seconds:g}" if r.seconds else "-", escape(r.mac or "-"), escape(r.sent_from or "-"))
        out.print(t)
        for r in rs:
            if not r.ok:
                err.print(f"[red]{escape(r.host)}: {escape(r.error or r.status)}[/red]\n    fix: {escape(r.fix or '-')}")
    if all(r.ok for r in rs):
        return errors.EXIT_OK
    return errors.EXIT_USAGE if any(r.status == "no-mac" for r in rs) and what == "wake" else errors.EXIT_UNREACHABLE


def slurm_powers(args: argparse.Namespace, inv: Inventory, hosts: list[Host]) -> None:
    """wake and poweroff (their own, and launch's or study's --wake and --poweroff-after) leave the PCs a
    room's Slurm holds to it, unless --outside-slurm."""
    from cluster.room import held

    held.guard(inv, [h.name for h in hosts], "the room's Slurm powers {them}",
               "leave the power of {them} to room {room}'s Slurm", args.outside_slurm,
               log=lambda s: err.print(f"[yellow]{escape(s)}[/yellow]"))


def cmd_wake(args: argparse.Namespace) -> int:
    """Magic packets to the nodes that do not answer SSH, then wait (bounded) until they do."""
    from cluster.nodes import power

    inv, hosts = _power_hosts(args)
    slurm_powers(args, inv, hosts)
    with err.status(f"waking {len(hosts)} nodes"):
        results = power.wake(inv, hosts, timeout=args.timeout or power.WAKE_TIMEOUT_S, forks=args.forks,
                             log=lambda s: err.print(f"[dim]{escape(s)}[/dim]"))
    return _power_report(args, "wake", inv, results)


def cmd_poweroff(args: argparse.Namespace) -> int:
    """Power the nodes off (through sudo -n with become) and wait until none answers SSH."""
    from cluster.nodes import power

    inv, hosts = _power_hosts(args)
    slurm_powers(args, inv, hosts)
    with err.status(f"powering off {len(hosts)} nodes"):
        results = power.poweroff(hosts, timeout=args.timeout or power.POWEROFF_TIMEOUT_S, forks=args.forks,
                                 log=lambda s: err.print(f"[dim]{escape(s)}[/dim]"))
    return _power_report(args, "poweroff", inv, results)


def wake_first(args: argparse.Namespace, inv: Inventory, hosts: list[Host]) -> None:
    """launch/study --wake: wake the nodes that are off; those that do not come are the launch's to judge
    (the job's min_nodes), said here with the reason."""
    from cluster.nodes import power

    if not args.wake:
        return
    slurm_powers(args, inv, hosts)
    with err.status(f"waking {len(hosts)} nodes"):
        results = power.wake(inv, hosts, timeout=args.wake_timeout, forks=args.forks,
                             log=(lambda s: None) if args.json else lambda s: err.print(f"[dim]{escape(s)}[/dim]"))
    for r in results:
        if not args.json and r.status == "woke":
            err.print(f"{escape(r.host)}: woke, answers SSH after {r.seconds:g} s")
        elif not r.ok:
            err.print(f"[yellow]{escape(r.host)}: did not wake ({escape(r.error or r.status)})[/yellow]")


def poweroff_after(args: argparse.Namespace, inv: Inventory, hosts: list[Host]) -> bool:
    """--poweroff-after, once the results are on the head: True when every node is off."""
    from cluster.nodes import power

    if not args.poweroff_after:
        return True
    slurm_powers(args, inv, hosts)
    with err.status(f"powering off {len(hosts)} nodes"):
        results = power.poweroff(hosts, forks=args.forks)
    for r in results:
        if not r.ok:
            err.print(f"[red]{escape(r.host)}: not powered off: {escape(r.error or r.status)}[/red]\n"
                      f"    fix: {escape(r.fix or '-')}")
    if not args.json:
        err.print(f"powered off {sum(r.ok for r in results)} of {len(results)} nodes")
    return all(r.ok for r in results)


# --------------------------------------------------------------------------- exec


def cmd_exec(args: argparse.Namespace) -> int:
    from cluster.nodes.fanout import Group

    if not args.command:
        raise errors.UsageError("no command given", "put it after --: clusterctl exec [INVENTORY] -- uptime")
    command = " ".join(args.command)  # like ssh: the words are joined and read by the node's shell
    inv = load_inventory(args.inventory_pos or args.inventory, args.set, args.ssh_config)
    hosts = inv.select(args.limit)
    start = time.monotonic()
    with Group(hosts, forks=args.forks) as group:
        results = group.run(command, timeout=args.timeout)
    wall = time.monotonic() - start
    if args.json:
        emit_json({"command": command, "wall_s": round(wall, 3),
                   "nodes": [results[h.name].to_dict() for h in hosts]})
    else:
        for h in hosts:
            r = results[h.name]
            colour = {"ok": "green", "failed": "red", "unreachable": "red"}[r.status]
            extra = f"exit {r.exit_code}" if r.exit_code is not None else (r.problem or "")
            out.print(f"[bold]── {h.name}[/] ({h.address}) [{colour}]{r.status}[/] {extra} {r.duration:.2f}s")
            if r.stdout:
                out.out(r.stdout.rstrip("\n"), highlight=False)
            if r.stderr:
                out.print(f"[dim]{escape(r.stderr.rstrip())}[/dim]")
            if r.error:
                out.print(f"[red]{escape(r.error)}[/red]" + (f"\n  fix: {escape(r.fix)}" if r.fix else ""))
        out.print(f"{len(results.succeeded)} ok, {len(results.failed)} failed, "
                  f"{len(results.unreachable)} unreachable in {wall:.2f}s")
    if results.unreachable:
        return errors.EXIT_UNREACHABLE
    return errors.EXIT_OK if results.ok else errors.EXIT_FAILED
