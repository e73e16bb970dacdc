"""The command line: parse, call the library, render with rich, map errors to exit codes.

Human output goes to stdout, progress and notes to stderr, `--json` to stdout only.
Exit codes: docs/cli.md (cluster.errors.EXIT_*).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from cluster import __version__, context, errors
from cluster import inventory as inventory_mod

# Piped output is read by people later (logs, CI): don't squeeze it into 80 columns.
_WIDE = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
out = Console(highlight=False, width=_WIDE)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # messages stay whole: grep-able, copy-able


# --------------------------------------------------------------------------- helpers


def _emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _load_inventory(args: argparse.Namespace) -> inventory_mod.Inventory:
    given = getattr(args, "inventory_pos", None) or getattr(args, "inventory", None)
    path, why = context.resolve(given)
    if why != "given":
        err.print(f"[dim]inventory: {escape(str(path))} ({why})[/dim]")
    return inventory_mod.load(path, overrides=getattr(args, "set", None) or ())


def _progress(label: str) -> Progress:
    return Progress(SpinnerColumn(), TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True, disable=not err.is_terminal)


def _number(kind: Callable[[str], float], minimum: float, strict: bool) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` >= minimum (> with `strict`); anything else is exit 2, said so."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'whole ' if kind is int else ''}number, got {text!r}") \
                from None
        if value != value or value in (float("inf"), float("-inf")) or value < minimum \
                or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"expected a number {'>' if strict else '>='} {minimum:g}, got {text!r}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


POSITIVE_INT, POSITIVE_FLOAT = _number(int, 0, strict=True), _number(float, 0, strict=True)
NON_NEGATIVE_INT, NON_NEGATIVE_FLOAT = _number(int, 0, strict=False), _number(float, 0, strict=False)


def _add_inventory_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        p.add_argument("inventory_pos", nargs="?", metavar="INVENTORY",
                       help="inventory YAML (default: the current context, see `clusterctl context`)")
    p.add_argument("-i", "--inventory", metavar="INVENTORY", help="inventory YAML (same as the positional)")
    p.add_argument("--limit", metavar="HOSTS", help="comma-separated host names, group names or globs")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a host field on every host (e.g. --set user=student); repeatable")
    p.add_argument("--forks", type=POSITIVE_INT, default=32, help="nodes contacted at once (default 32)")


# --------------------------------------------------------------------------- lab


def cmd_lab_up(args: argparse.Namespace) -> int:
    from cluster import lab

    with err.status(f"starting a {args.nodes}-node lab '{args.name}' on {args.subnet}"):
        try:
            quotas = [float(x) for x in args.cpu_quota.split(",")] if args.cpu_quota else None
        except ValueError:
            raise errors.UsageError(f"--cpu-quota {args.cpu_quota!r}: expected numbers", "e.g. --cpu-quota 1,0.35") from None
        state = lab.up(args.nodes, name=args.name, subnet=args.subnet, bandwidth=args.bandwidth, cpu_quotas=quotas,
                       directory=Path(args.dir) if args.dir else None, uplink=args.uplink)
    context.set_current(Path(state.inventory))
    if args.json:
        _emit_json({"name": state.name, "inventory": state.inventory, "subnet": state.subnet,
                    "nodes": [{"name": n.name, "address": n.address, "netns": n.netns} for n in state.nodes]})
        return errors.EXIT_OK
    t = Table(title=f"lab {state.name} ({state.subnet})")
    for col in ("node", "address", "netns", "sshd pid", "cpu"):
        t.add_column(col)
    for n in state.nodes:
        t.add_row(n.name, n.address, n.netns, str(n.pid),
                  f"core {n.cpu}, {n.cpu_quota:g} of it" if n.cpu_quota is not None else "shared")
    out.print(t)
    if state.bandwidth:
        out.print(f"links shaped to {state.bandwidth} in both directions")
    if state.uplink:
        out.print(f"the head's uplink: {state.uplink} in each direction, shared by all nodes")
    out.print(f"inventory: {escape(state.inventory)} (now the current context)")
    return errors.EXIT_OK


def cmd_lab_down(args: argparse.Namespace) -> int:
    from cluster import lab

    directory = Path(args.dir) if args.dir else None
    state = lab.load_state(args.name, directory)
    removed = lab.down(args.name, directory, purge=args.purge)
    if state is not None and context.current() == Path(state.inventory):
        context.clear()  # don't leave the current context pointing at nodes that are gone
    if args.json:
        _emit_json({"name": args.name, "removed": removed})
    else:
        out.print(f"lab {args.name}: removed {len(removed)} pieces" + (f" ({', '.join(removed)})" if removed else
                                                                       " (nothing was running)"))
    return errors.EXIT_OK


def cmd_lab_status(args: argparse.Namespace) -> int:
    from cluster import lab

    state, rows = lab.status(args.name, Path(args.dir) if args.dir else None)
    if args.json:
        _emit_json({"name": args.name, "up": state is not None,
                    "inventory": state.inventory if state else None, "nodes": [vars(r) for r in rows]})
    elif state is None:
        out.print(f"lab {args.name} is not up (start it with `clusterctl lab up 3 --name {args.name}`)")
    else:
        t = Table(title=f"lab {state.name} ({state.subnet})")
        for col in ("node", "address", "netns", "sshd", "port 22"):
            t.add_column(col)
        for r in rows:
            t.add_row(r.name, r.address, *(("[green]yes[/]" if x else "[red]no[/]") for x in (r.netns, r.sshd, r.port_open)))
        out.print(t)
        out.print(f"inventory: {escape(state.inventory)}")
    healthy = state is not None and all(r.netns and r.sshd and r.port_open for r in rows)
    return errors.EXIT_OK if healthy else errors.EXIT_FAILED


# --------------------------------------------------------------------------- trust


def cmd_trust(args: argparse.Namespace) -> int:
    from cluster import hostkeys

    inv = _load_inventory(args)
    hosts = inv.select(args.limit)
    with err.status(f"contacting {len(hosts)} nodes for their host keys"):
        offers = hostkeys.survey(hosts, args.forks)
    new = [o for o in offers if o.status == "new"]
    if not args.json:
        # Plain lines, not a table: a fingerprint must never be cut to fit the terminal.
        style = {"new": "yellow", "known": "green", "changed": "bold red", "unreachable": "red", "local": "dim"}
        for o in offers:
            key = f"{o.key.get_name()} {o.fingerprint}" if o.key else "-"
            out.print(f"{o.host.name:<12} {o.host.host_key_name:<22} [{style[o.status]}]{o.status:<11}[/] {key}")
        for o in offers:
            if o.message:
                err.print(f"[red]{escape(o.message)}[/red]")
    recorded: list[str] = []
    if new:
        if not args.yes:
            if not sys.stdin.isatty():
                err.print("[yellow]not recording: compare the fingerprints above with `ssh-keygen -lf "
                          "/etc/ssh/ssh_host_ed25519_key.pub` on each node, then re-run with --yes[/yellow]")
            elif err.input(f"Record {len(new)} new host key(s)? Compare the fingerprints on the nodes first. [y/N] ")\
                    .strip().lower() in ("y", "yes"):
                args.yes = True
        if args.yes:
            for o in new:
                assert o.key is not None
                hostkeys.record(o.host, o.key)
                recorded.append(o.host.name)
            if not args.json:
                out.print(f"recorded {len(recorded)} key(s) in "
                          f"{', '.join(sorted({str(o.host.known_hosts_path) for o in new}))}")
    if args.json:
        _emit_json({"nodes": [{**o.to_dict(), "recorded": o.host.name in recorded} for o in offers]})
    if any(o.status == "changed" for o in offers):
        return errors.EXIT_UNREACHABLE
    if any(o.status == "unreachable" for o in offers) or (new and not recorded):
        return errors.EXIT_UNREACHABLE
    return errors.EXIT_OK


# --------------------------------------------------------------------------- check


def _fmt_facts(f: dict[str, Any]) -> list[str]:
    os_ = f.get("os") or {}
    py = f.get("python")
    mem = f.get("memory") or {}
    disk = f.get("disk")
    gpus = (f.get("gpus") or {}).get("gpus") or []
    gpu_txt = ", ".join(f"{g['name'].replace('NVIDIA ', '').replace('GeForce ', '')} "
                        f"(cc {g['compute_capability']}, {g['driver']})" for g in gpus) or "none"
    return [
        f"{os_.get('id') or '?'} {os_.get('version') or ''}".strip(),
        py["version"] if py else "[red]missing[/]",
        str((f.get("cpu") or {}).get("usable") or "?"),
        f"{(mem.get('total_mib') or 0) / 1024:.0f}G",
        f"{disk['free_gib']:.0f}G" if disk else "?",
        gpu_txt,
        f.get("address_nic") or "-",
        f"{f['clock_offset_s']:+.3f}" if f.get("clock_offset_s") is not None else "?",
    ]


def cmd_check(args: argparse.Namespace) -> int:
    from cluster import check
    from cluster.fanout import Group

    inv = _load_inventory(args)
    hosts = inv.select(args.limit)
    with Group(hosts, forks=args.forks) as group, _progress("gathering facts") as prog:
        task = prog.add_task("facts", total=len(hosts))
        report = check.run(group, on_done=lambda r: prog.advance(task))
    if args.json:
        _emit_json({"inventory": str(inv.path), **report.to_dict()})
    else:
        t = Table(title=f"{inv.name}: {len(report.healthy)}/{len(hosts)} nodes healthy")
        for col in ("node", "address", "state", "os", "python", "cpus", "ram", "disk", "gpus", "nic",
                    "clock s"):
            t.add_column(col, overflow="fold")
        blocked = {p.host for p in report.blocking}
        for h in hosts:
            r = report.results[h.name]
            state = "[red]unreachable[/]" if r.status == "unreachable" else (
                "[red]problem[/]" if h.name in blocked else "[green]ok[/]")
            cells = _fmt_facts(r.value.to_dict()) if r.ok else ["-"] * 8
            t.add_row(h.name, h.address, state, *cells)
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


# --------------------------------------------------------------------------- exec


def cmd_exec(args: argparse.Namespace) -> int:
    from cluster.fanout import Group

    if not args.command:
        raise errors.UsageError("no command given", "put it after --: clusterctl exec [INVENTORY] -- uptime")
    command = " ".join(args.command)  # like ssh: the words are joined and read by the node's shell
    inv = _load_inventory(args)
    hosts = inv.select(args.limit)
    start = time.monotonic()
    with Group(hosts, forks=args.forks) as group:
        results = group.run(command, timeout=args.timeout)
    wall = time.monotonic() - start
    if args.json:
        _emit_json({"command": command, "wall_s": round(wall, 3),
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


# --------------------------------------------------------------------------- provision


def cmd_provision(args: argparse.Namespace) -> int:
    from cluster import provision

    inv = _load_inventory(args)
    hosts = inv.select(args.limit)
    live = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                    transient=True, disable=not err.is_terminal or args.json)
    tasks: dict[str, Any] = {}
    sent: dict[str, int] = {}

    def log(msg: str) -> None:
        if not args.json:
            err.print(f"[dim]{escape(msg)}[/dim]")

    def on_step(host: str, r: Any) -> None:
        if host not in tasks:
            tasks[host] = live.add_task(host)
        live.update(tasks[host], description=f"{host}: {r.name} [{r.status}]")

    def on_bytes(host: str, n: int) -> None:
        sent[host] = sent.get(host, 0) + n
        if host not in tasks:
            tasks[host] = live.add_task(host)
        live.update(tasks[host], description=f"{host}: wheels {sent[host] / 2**20:.0f} MiB received and verified")

    with live:
        report = provision.run(inv, hosts, dry_run=args.dry_run, verify=args.verify, forks=args.forks, log=log, on_step=on_step,
                               on_bytes=on_bytes)
    if not args.dry_run and any(n.status == "ok" for n in report.nodes.values()):
        context.set_current(inv.path)
    if args.json:
        _emit_json(report.to_dict())
    else:
        _print_provision(report)
    statuses = {n.status for n in report.nodes.values()}
    if "unreachable" in statuses:
        return errors.EXIT_UNREACHABLE
    return errors.EXIT_OK if report.ok else errors.EXIT_FAILED


def _print_provision(report: Any) -> None:
    plan = report.plan
    if plan is not None:
        t = Table(title=f"plan: torch {plan.torch}, TensorFlow {plan.tensorflow}, backend {plan.backend}")
        for col in ("node", "GPU", "cc", "driver", "torch", "TensorFlow", "AMP", "notes"):
            t.add_column(col, overflow="fold")
        for name, b in plan.builds.items():
            t.add_row(name, b.gpu or "none", b.compute_capability or "-", b.driver or "-",
                      b.torch_label, f"{b.tensorflow} ({'GPU' if b.tf_on_gpu else 'CPU'})",
                      "on" if b.amp else "off", "; ".join(b.notes + b.pins))
        out.print(t)
    for line in (report.distribution or {}).get("lines", []):
        out.print(f"wheels: {escape(line)}")
    title = "dry run: what provision would do" if report.dry_run else "provision"
    t = Table(title=title)
    for col in ("node", "status", "changed", "unchanged", "time", "torch", "TensorFlow", "all-reduce"):
        t.add_column(col, overflow="fold")
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
    for line in report.fingerprint_diff:
        out.print(f"[red]fingerprint differs[/red] {escape(line)}")
    for n in report.nodes.values():
        if n.error:
            out.print(f"[red]error[/red] {n.host}: {escape(n.error)}" + (f"\n    fix: {escape(n.fix)}" if n.fix else ""))
    for note in report.notes:
        out.print(f"note: {escape(note)}")
    if not report.dry_run and report.nothing_to_do:
        out.print("nothing to do: every step was already done and every environment is as verified")


# --------------------------------------------------------------------------- launch and runs

_RUN_STYLE = {"running": "yellow", "starting": "yellow", "succeeded": "green", "failed": "red", "stopped": "magenta",
              "stopping": "magenta", "vanished": "red", "unreachable": "red", "missing": "red", "not started": "dim"}


def _run_table(record: Any, statuses: dict[str, Any]) -> Table:
    state = record.state
    t = Table(title=f"{record.run_id}: [{_RUN_STYLE.get(state, 'white')}]{state}[/] "
                    f"({record.job}, world size {record.world_size})")
    for col in ("node", "state", "procs", "world", "epoch", "step", "loss", "images/s"):
        t.add_column(col)
    for n in record.nodes:
        s = statuses.get(n.node)
        if s is None:
            t.add_row(n.node, "?", *["-"] * 6)
            continue
        d = s if isinstance(s, dict) else s.to_dict()
        t.add_row(n.node, f"[{_RUN_STYLE.get(d['state'], 'white')}]{d['state']}[/]", str(d["processes"]),
                  str(d["world"] or "-"), str(d["epoch"] if d["epoch"] is not None else "-"),
                  str(d["step"] if d["step"] is not None else "-"),
                  f"{d['loss']:.4f}" if d["loss"] is not None else "-",
                  f"{d['images_per_s']:.1f}" if d["images_per_s"] is not None else "-")
    return t


def _print_failure(record: Any) -> None:
    f = record.failure
    if f is not None:
        out.print(f"[red]run failed[/red] on {f.node}: {escape(f.reason)}"
                  + (f" (also: {', '.join(f.also)})" if f.also else ""))
        for line in f.log:
            out.print(f"  [dim]{f.node}|[/dim] {escape(line)}")
    if record.stop_pending:
        out.print(f"[red]not confirmed stopped[/red] (unreachable): {', '.join(record.stop_pending)}; "
                  f"run `clusterctl stop {record.run_id}` when they are back")
    elif f is not None and record.stop_results:
        out.print("the other nodes were stopped")
    if f is not None:
        out.print(f"logs and metrics stay on the nodes (`clusterctl logs {record.run_id}`)")


def _run_exit(record: Any) -> int:
    if record.stop_pending:
        return errors.EXIT_UNREACHABLE
    return {"succeeded": errors.EXIT_OK, "running": errors.EXIT_OK, "starting": errors.EXIT_OK,
            "dry-run": errors.EXIT_OK}.get(record.state, errors.EXIT_FAILED)


def cmd_launch(args: argparse.Namespace) -> int:
    from rich.live import Live

    from cluster import jobs, launch

    inv = _load_inventory(argparse.Namespace(inventory=args.inventory, set=args.host_set))
    planned = None
    if args.plan:
        from cluster import placement

        planned = placement.load_recommended(inv, args.job).to_dict()
    spec = jobs.load(args.job, (placement.overrides_for(inv, args.job) if args.plan else []) + (args.set or []))
    if args.dry_run:
        record, plan = launch.dry_run(inv, spec, limit=args.limit, forks=args.forks)
        if args.json:
            _emit_json({**plan.to_dict(), "files": {n.node: n.files for n in plan.nodes}})
            return errors.EXIT_OK
        for n in plan.nodes:
            for name, content in n.files.items():
                out.rule(f"{n.node}: {n.run_dir}/{name}")
                out.out(content.rstrip("\n"), highlight=False)
            out.print(f"[bold]{n.node}[/] starts with: {escape(n.start_command)}")
        out.print(f"dry run: {len(plan.nodes)} nodes, world size {plan.world_size}; nothing was changed "
                  f"(the port is picked when the run starts unless the job sets `port:`)")
        return errors.EXIT_OK
    record, plan = launch.launch(inv, spec, limit=args.limit, forks=args.forks,
                                 log=lambda m: None if args.json else err.print(f"[dim]{escape(m)}[/dim]"),
                                 prediction=planned)
    if not args.json:
        err.print(f"run {record.run_id} started on {len(record.nodes)} nodes "
                  f"(world size {record.world_size})")
    if args.detach:
        if args.json:
            _emit_json(record.to_dict())
        else:
            out.print(f"detached (a watcher on this head judges it meanwhile): follow it with `clusterctl status "
                      f"{record.run_id}` or `clusterctl logs {record.run_id} -f`; stop it with "
                      f"`clusterctl stop {record.run_id}`")
        return errors.EXIT_OK
    live = Live(console=err, transient=False, auto_refresh=False) if err.is_terminal and not args.json else None
    seen: dict[str, str] = {}

    def update(rec: Any, statuses: dict[str, Any]) -> None:
        if live is not None:
            live.update(_run_table(rec, statuses), refresh=True)
        elif not args.json:  # piped: one line per change of a node's state or epoch
            for name, s in statuses.items():
                key = f"{s.state} epoch {s.epoch}"
                if seen.get(name) != key:
                    seen[name] = key
                    err.print(f"{name}: {s.state}" + (f", epoch {s.epoch} step {s.step} loss {s.loss:.4f}"
                                                      if s.loss is not None else ""))

    try:
        if live is not None:
            with live:
                record = launch.follow(record, on_update=update)
        else:
            record = launch.follow(record, on_update=update)
    except KeyboardInterrupt:
        err.print(f"detached; the run goes on (its watcher judges it). Stop it with `clusterctl stop {record.run_id}`")
        return 130
    _print_run_end(args, record)
    return _run_exit(record)


def _print_run_end(args: argparse.Namespace, record: Any) -> None:
    if args.json:
        _emit_json(record.to_dict())
        return
    if record.last_status:
        out.print(_run_table(record, record.last_status))
    _print_failure(record)
    if record.state == "succeeded":
        took = (record.ended or 0) - (record.started or 0)
        out.print(f"run {record.run_id} succeeded in {took:.0f} s; "
                  f"results stay on the nodes under runs/{record.run_id}/")


def cmd_runs(args: argparse.Namespace) -> int:
    from cluster import runs

    records, damaged = runs.scan()
    if args.json:
        _emit_json([{k: getattr(r, k) for k in ("run_id", "job", "state", "created", "started", "ended",
                                               "world_size", "stop_pending")}
                    | {"nodes": [n.node for n in r.nodes]} for r in records]
                   + [{"error": e.message, "fix": e.fix} for e in damaged])
        return errors.EXIT_USAGE if damaged else errors.EXIT_OK
    t = Table(title=f"runs in {escape(str(runs.runs_dir()))}")
    for col in ("run", "job", "state", "nodes", "world", "started", "took"):
        t.add_column(col)
    for r in records:
        took = f"{(r.ended or time.time()) - r.started:.0f}s" if r.started else "-"
        t.add_row(r.run_id, r.job, f"[{_RUN_STYLE.get(r.state, 'white')}]{r.state}[/]",
                  ",".join(n.node for n in r.nodes), str(r.world_size),
                  time.strftime("%Y-%m-%d %H:%M", time.localtime(r.started)) if r.started else "-", took)
    out.print(t)
    for e in damaged:  # never dropped silently: the busy check refuses while one is there
        err.print(f"[red]{escape(e.message)}[/red]\n  fix: {escape(e.fix or '')}")
    if not records and not damaged:
        out.print("no runs yet: clusterctl launch resnet50-ddp")
    return errors.EXIT_USAGE if damaged else errors.EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from cluster import launch, runs

    record = launch.refresh(runs.load(args.run))
    if args.json:
        _emit_json(record.to_dict())
    else:
        out.print(_run_table(record, record.last_status or {}))
        _print_failure(record)
    return _run_exit(record)


def cmd_logs(args: argparse.Namespace) -> int:
    from cluster import launch, runs

    record = runs.load(args.run)
    if not args.follow:
        got = launch.logs(record, args.node, lines=args.lines)
        if args.json:
            _emit_json({n: text for n, (text, _) in got.items()})
        for name, (text, _) in got.items():
            if not args.json:
                out.rule(name)
                out.out(text.rstrip("\n"), highlight=False)
        return errors.EXIT_OK
    offsets: dict[str, int] = {}
    try:
        while True:
            got = launch.logs(record, args.node, offsets=offsets)
            for name, (text, size) in got.items():
                offsets[name] = size
                for line in text.splitlines():
                    out.out(f"{name}| {line}", highlight=False)
            if not record.active:
                return errors.EXIT_OK
            record = launch.refresh(record)
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 130


def cmd_stop(args: argparse.Namespace) -> int:
    from cluster import launch, runs

    record = runs.load(args.run)
    with err.status(f"stopping {record.run_id} on {len(record.nodes)} nodes"):
        record = launch.stop(record, grace=args.grace)
    results = record.stop_results or {}
    if args.json:
        _emit_json(record.to_dict())
    else:
        for n, r in results.items():
            out.print(f"{n}: " + ("[green]nothing left running[/]" if r.get("ok") else
                                  f"[red]not confirmed stopped: {escape(str(r.get('error') or r.get('left')))}[/]")
                      + (f" (terminated {len(r.get('terminated') or [])}, killed {len(r.get('killed') or [])})"
                         if r.get("ok") else ""))
        out.print(f"run {record.run_id}: {record.state}; logs and metrics stay on the nodes"
                  + (f"; run `clusterctl stop {record.run_id}` again when {', '.join(record.stop_pending)} "
                     "can be reached" if record.stop_pending else ""))
    if record.stop_pending:  # exit 3 when a node could not be reached, 1 when a reachable one kept processes
        unreachable = any(results.get(n, {}).get("status") == "unreachable" for n in record.stop_pending)
        return errors.EXIT_UNREACHABLE if unreachable else errors.EXIT_FAILED
    return errors.EXIT_OK


# --------------------------------------------------------------------------- collect


def cmd_collect(args: argparse.Namespace) -> int:
    from rich.progress import DownloadColumn, TransferSpeedColumn

    from cluster import collect, runs

    if args.all and args.run:
        raise errors.UsageError("give a RUN or --all, not both", "clusterctl collect --all")
    records = [r for r in runs.list_runs() if r.state != "dry-run"] if args.all else [runs.load(args.run)]
    override = None
    if args.inventory:
        override = inventory_mod.load(args.inventory).hosts
    worst = errors.EXIT_OK
    summary = []
    for record in records:
        prog = Progress(TextColumn("{task.description}"), DownloadColumn(), TransferSpeedColumn(), console=err,
                        transient=True, disable=not err.is_terminal or args.json)
        tasks = {n.node: prog.add_task(f"{record.run_id} {n.node}", total=None) for n in record.nodes}
        with prog:
            result = collect.collect(record, checkpoints=args.with_checkpoints, forks=args.forks,
                                     on_bytes=lambda node, n: prog.advance(tasks[node], n), inventory_hosts=override)
        summary.append({"run_id": record.run_id, "folder": str(runs.run_path(record.run_id)),
                        "nodes": [c.to_dict() for c in result.values()]})
        if any(c.status == "unreachable" for c in result.values()):
            worst = max(worst, errors.EXIT_UNREACHABLE)
        elif any(c.status != "ok" or c.refused for c in result.values()):
            worst = max(worst, errors.EXIT_FAILED)
        if args.json:
            continue
        t = Table(title=f"collect {record.run_id} -> {escape(str(runs.run_path(record.run_id)))}")
        for col in ("node", "status", "files", "fetched", "transferred", "node total", "skipped", "refused", "time"):
            t.add_column(col)
        for c in result.values():
            t.add_row(c.node, f"[{'green' if c.status == 'ok' else 'red'}]{c.status}[/]", str(c.files),
                      str(c.fetched), f"{c.bytes / 2**20:.2f} MiB", f"{c.total_bytes / 2**20:.2f} MiB",
                      str(len(c.skipped)), str(len(c.refused)), f"{c.duration:.1f}s")
        out.print(t)
        for c in result.values():
            if c.error:
                out.print(f"[red]error[/red] {c.node}: {escape(c.error)}" + (f"\n    fix: {escape(c.fix)}" if c.fix else ""))
            for x in c.refused:
                out.print(f"[red]refused[/red] {c.node}: {escape(x['reason'])}")
            for x in c.skipped:
                out.print(f"[yellow]skipped[/yellow] {c.node}: {escape(x['path'])} ({escape(x['reason'])})")
    if args.json:
        _emit_json(summary if args.all else summary[0])
    return worst


def cmd_report(args: argparse.Namespace) -> int:
    from cluster import paths, report, runs

    ids = args.runs or [runs.load().run_id]
    figs = report.build(ids, price_kwh=args.price_kwh)
    images = report.plots(figs)
    html_path = Path(args.html) if args.html else None
    if html_path is None and not args.markdown:
        html_path = (runs.run_path(figs[0].run_id) / "report.html" if len(figs) == 1 else
                     paths.home() / "reports" / f"report-{time.strftime('%Y%m%d-%H%M%S')}.html")
    written = []
    if html_path is not None:
        html_path.parent.mkdir(parents=True, exist_ok=True)
        html_path.write_text(report.html_page(figs, images, args.price_kwh))
        written.append(str(html_path.resolve()))
    if args.markdown:
        md = Path(args.markdown)
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(report.markdown_page(figs, md.parent / f"{md.stem}-plots", images))
        written.append(str(md.resolve()))
    if args.json:
        _emit_json({"runs": [f.to_dict() for f in figs], "written": written})
        return errors.EXIT_OK
    head, rows = report.summary_rows(figs)
    # the terminal gets the columns a comparison needs; the pages have them all
    keep = [head.index(h) for h in ("run", "framework", "nodes", "images/s", "epoch s", "final val acc",
                                     "best val acc", "scaling eff.", "energy kWh")]
    t = Table(title="ResNet50 study")
    for i in keep:
        t.add_column(head[i], overflow="fold")
    for r in rows:
        t.add_row(*(r[i] for i in keep))
    out.print(t)
    for w in written:
        out.print(f"written: {escape(w)}")
    return errors.EXIT_OK


def cmd_study(args: argparse.Namespace) -> int:
    from cluster import study

    inv = _load_inventory(argparse.Namespace(inventory=args.inventory, set=None))
    try:
        sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        raise errors.UsageError(f"--nodes {args.nodes!r}: expected node counts separated by commas",
                                "e.g. --nodes 1,2,4") from None
    sid, cells, page = study.run(inv, args.jobs, sizes, args.set or [], args.price_kwh,
                                 log=lambda m: None if args.json else err.print(f"[dim]{escape(m)}[/dim]"))
    if args.json:
        _emit_json({"study": sid, "cells": [dict(c.__dict__) for c in cells], "report": str(page) if page else None})
    else:
        t = Table(title=f"{sid} ({escape(str(inv.path))})")
        for col in ("job", "nodes", "run", "state", "note"):
            t.add_column(col)
        for c in cells:
            t.add_row(c.job, str(c.nodes), c.run_id or "-", f"[{_RUN_STYLE.get(c.state, 'red')}]{c.state}[/]",
                      "done before" if c.skipped else escape(c.error or ""))
        out.print(t)
        if page:
            out.print(f"report: {escape(str(page))}")
    return errors.EXIT_OK if all(c.state == "succeeded" for c in cells) else errors.EXIT_FAILED


# --------------------------------------------------------------------------- bench and plan


def cmd_bench(args: argparse.Namespace) -> int:
    from cluster import bench

    inv = _load_inventory(argparse.Namespace(inventory=args.inventory, set=None))
    res = bench.run(inv, args.jobs.split(","), steps=args.steps, overrides=args.set or [], parallel=args.parallel,
                    log=lambda m: None if args.json else err.print(f"[dim]{escape(m)}[/dim]")).to_dict()
    if args.json:
        _emit_json(res)
    else:
        t = Table(title=f"bench {inv.name}: each node alone (images/s at the job's size and batch)")
        t.add_column("node")
        for fw in res["compute"]:
            t.add_column(f"{fw} images/s")
            t.add_column(f"{fw} step s")
        for h in inv.ordered(inv.hosts.values()):
            cells = []
            for fw, c in res["compute"].items():
                r = c["nodes"].get(h.name)
                cells += [f"{r['images_per_s']:.1f}", f"{r['step_s']:.3f}"] if r else ["-", "-"]
            t.add_row(h.name, *cells)
        out.print(t)
        net = res["network"]
        if net:
            out.print(f"network ({net['nodes']} nodes): all-reduce bus bandwidth {net['busbw_MBps']:.0f} MB/s "
                      f"(slowest node), model all-reduce {net['model_allreduce_s']:.3f} s, latency "
                      f"{net['latency_s'] * 1000:.2f} ms")
        for k, v in res["errors"].items():
            out.print(f"[red]error[/red] {k}: {escape(str(v))}")
        out.print(f"saved for `clusterctl plan`: {escape(str(bench.bench_path(inv)))}")
    if res.get("unreachable"):  # a node lost during its benchmark
        return errors.EXIT_UNREACHABLE
    return errors.EXIT_FAILED if res["errors"] else errors.EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from cluster import placement

    inv = _load_inventory(argparse.Namespace(inventory=args.inventory, set=None))
    doc = placement.choose(inv, args.job, args.set or []).to_dict()
    if args.json:
        _emit_json(doc)
        return errors.EXIT_OK
    t = Table(title=f"plan {doc['job']} on {inv.name} (model: docs/planning.md)")
    for col in ("nodes", "global batch", "even split img/s", "planned split img/s", "step s", "all-reduce s",
                "epoch s", "shares"):
        t.add_column(col, overflow="fold")
    rec = doc["recommended"]
    for c in doc["candidates"]:
        mark = " [green](recommended)[/]" if c["nodes"] == rec["nodes"] else ""
        t.add_row(",".join(c["nodes"]) + mark, str(c["global_batch"]), f"{c['even_images_per_s']:.1f}",
                  f"{c['planned_images_per_s']:.1f}", f"{c['step_s']:.3f}", f"{c['comm_s']:.3f}",
                  f"{c['epoch_s']:.0f}" if c["epoch_s"] else "-",
                  ", ".join(f"{n}={b}" for n, b in c["shares"].items()))
    out.print(t)
    out.print(f"apply it: clusterctl launch {doc['job']} --plan")
    return errors.EXIT_OK


# --------------------------------------------------------------------------- context


def cmd_context(args: argparse.Namespace) -> int:
    if args.inventory_pos:
        inv = inventory_mod.load(args.inventory_pos)
        path = context.set_current(inv.path)
        msg = f"current inventory: {path} ({len(inv.hosts)} hosts)"
    else:
        path = context.current()
        msg = f"current inventory: {path}" if path else "no current inventory (commands use inventory/local.yaml)"
    if args.json:
        _emit_json({"inventory": str(path) if path else None})
    else:
        out.print(msg)
    return errors.EXIT_OK


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clusterctl", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--version", action="version", version=f"clusterctl {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str, json_flag: bool = True):
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        if json_flag:
            sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        return sp

    lab = sub.add_parser("lab", help="a simulated lab of SSH nodes in network namespaces (root)",
                         description="A simulated lab: one network namespace per node with its own sshd.")
    lsub = lab.add_subparsers(dest="lab_cmd", required=True, metavar="ACTION")
    for name, fn, help in (("up", cmd_lab_up, "start a lab and make it the current context"),
                           ("down", cmd_lab_down, "remove the lab's namespaces, links and processes"),
                           ("status", cmd_lab_status, "show the lab's nodes and whether sshd answers")):
        sp = lsub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        if name == "down":
            sp.add_argument("--purge", action="store_true",
                            help="also delete the lab directory: keys and every node's /srv/cluster (venvs, runs)")
        if name == "up":
            sp.add_argument("nodes", type=POSITIVE_INT, metavar="N", help="number of nodes")
            sp.add_argument("--subnet", default="10.77.0.0/24", help="IPv4 subnet of the lab (default 10.77.0.0/24)")
            sp.add_argument("--bandwidth", metavar="RATE", help="shape each node's link, e.g. 1gbit (tc tbf)")
            sp.add_argument("--uplink", metavar="RATE",
                            help="the head's NIC: one limit shared by all head<->node traffic, e.g. 1gbit")
            sp.add_argument("--cpu-quota", metavar="Q1,Q2,...",
                            help="heterogeneous nodes: pin node i to one core and let it use Qi of it "
                                 "(cgroup CPU bandwidth), e.g. 1,0.35")
        sp.add_argument("--name", default="lab", help="lab name, 1-8 lowercase letters/digits (default lab)")
        sp.add_argument("--dir", help="lab directory (default $CLUSTERCTL_HOME/labs/NAME)")
        sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")

    sp = add("trust", cmd_trust, "record the nodes' SSH host keys at first contact, showing fingerprints")
    _add_inventory_args(sp)
    sp.add_argument("--yes", action="store_true", help="record new keys without asking (after checking them)")

    sp = add("check", cmd_check, "reach every node, gather facts, list problems with their fixes")
    _add_inventory_args(sp)

    sp = add("exec", cmd_exec, "run a shell command on every node: clusterctl exec [INVENTORY] -- CMD")
    _add_inventory_args(sp)
    sp.add_argument("--timeout", type=POSITIVE_FLOAT, help="per-node command timeout in seconds")

    sp = add("provision", cmd_provision, "install and verify an identical training environment on every node")
    _add_inventory_args(sp)
    sp.add_argument("--dry-run", action="store_true", help="show the plan and what would change; change nothing")
    sp.add_argument("--verify", action="store_true",
                    help="repeat the imports and the all-reduce even when nothing changed since the last run")

    sp = add("launch", cmd_launch, "start a job on every node at once and follow it: clusterctl launch resnet50-ddp")
    sp.add_argument("job", metavar="JOB", help="a job name (playbooks/JOB.yaml) or a spec file; see docs/jobs.md")
    sp.add_argument("-i", "--inventory", metavar="INVENTORY", help="inventory YAML (default: the current context)")
    sp.add_argument("--limit", metavar="HOSTS", help="only these of the job's nodes (names, groups, globs)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a job setting, e.g. --set epochs=2 --set optimizer.lr=0.02; repeatable")
    sp.add_argument("--host-set", action="append", metavar="KEY=VALUE", help="override a host field on every host")
    sp.add_argument("--forks", type=POSITIVE_INT, default=32, help="nodes contacted at once (default 32)")
    sp.add_argument("--dry-run", action="store_true", help="print every node's files and commands; change nothing")
    sp.add_argument("--detach", action="store_true", help="start and return; don't follow the run")
    sp.add_argument("--plan", action="store_true",
                    help="use `clusterctl plan JOB`'s recommended nodes and per-node batch shares")

    sp = add("runs", cmd_runs, "list the runs recorded on this head node")
    for name, fn, help in (("status", cmd_status, "a run's state on every node (default: the latest run)"),
                           ("logs", cmd_logs, "a run's output on each node (default: the latest run)"),
                           ("stop", cmd_stop, "stop a run on every node, leaving nothing running (default: latest)")):
        sp = add(name, fn, help)
        sp.add_argument("run", nargs="?", metavar="RUN", help="run id or a unique prefix (default: the latest)")
        if name == "logs":
            sp.add_argument("--node", help="only this node")
            sp.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
            sp.add_argument("-n", "--lines", type=NON_NEGATIVE_INT, default=50, help="last lines per node (default 50)")
        if name == "stop":
            sp.add_argument("--grace", type=NON_NEGATIVE_FLOAT, default=10.0,
                            help="seconds between SIGTERM and SIGKILL (default 10)")

    sp = add("collect", cmd_collect, "bring a run's logs, metrics, facts and state from every node to the head")
    sp.add_argument("run", nargs="?", metavar="RUN", help="run id or a unique prefix (default: the latest)")
    sp.add_argument("--all", action="store_true", help="every recorded run")
    sp.add_argument("-i", "--inventory", metavar="INVENTORY",
                    help="reach the nodes as this inventory says (default: as recorded when the run started)")
    sp.add_argument("--with-checkpoints", action="store_true", help="also the checkpoints (large)")
    sp.add_argument("--forks", type=POSITIVE_INT, default=32, help="nodes contacted at once (default 32)")

    sp = add("report", cmd_report, "tables and plots comparing collected runs (HTML, Markdown, JSON)")
    sp.add_argument("runs", nargs="*", metavar="RUN", help="run ids or prefixes (default: the latest run)")
    sp.add_argument("--html", metavar="FILE", help="the HTML page (default: runs/<run>/report.html, or "
                    "reports/report-<time>.html for several runs)")
    sp.add_argument("--markdown", metavar="FILE", help="also (or only) a Markdown page, plots next to it")
    sp.add_argument("--price-kwh", type=NON_NEGATIVE_FLOAT, metavar="PRICE", help="electricity price per kWh, for the cost column")

    sp = add("study", cmd_study, "run each job on 1, 2, ... N nodes, collect every run and write one report")
    sp.add_argument("jobs", nargs="+", metavar="JOB", help="job names or spec files, e.g. resnet50-ddp resnet50-tf")
    sp.add_argument("--nodes", default="1,2", help="node counts, comma-separated (default 1,2); the first N nodes")
    sp.add_argument("-i", "--inventory", metavar="INVENTORY", help="inventory YAML (default: the current context)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="job setting for every run; repeatable")
    sp.add_argument("--price-kwh", type=NON_NEGATIVE_FLOAT, metavar="PRICE", help="electricity price per kWh, for the cost column")

    sp = add("bench", cmd_bench, "measure each node alone (training images/s) and the network (all-reduce)")
    sp.add_argument("-i", "--inventory", metavar="INVENTORY", help="inventory YAML (default: the current context)")
    sp.add_argument("--jobs", default="resnet50-ddp,resnet50-tf", help="jobs whose program, size and batch to "
                    "measure, comma-separated (default both frameworks)")
    sp.add_argument("--steps", type=POSITIVE_INT, default=8, help="training steps per node (the first 2 are warm-up)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="job setting, e.g. --set batch=16")
    sp.add_argument("--parallel", action="store_true",
                    help="all nodes at once (faster; only where nodes share no CPU, i.e. real PCs)")

    sp = add("plan", cmd_plan, "predict a job's throughput per node set from `bench`; pick nodes and batch shares")
    sp.add_argument("job", metavar="JOB")
    sp.add_argument("-i", "--inventory", metavar="INVENTORY", help="inventory YAML (default: the current context)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="job setting, e.g. --set batch=16")

    sp = add("context", cmd_context, "show or set the current inventory used when none is given")
    sp.add_argument("inventory_pos", nargs="?", metavar="INVENTORY")
    return p


DEBUG_ENV = "CLUSTERCTL_DEBUG"  # set to 1: an internal error shows its Python traceback


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit code (docs/cli.md); never lets an exception through.

    A ClusterError is the user's to fix: its message and fix, its exit code. Anything else is a bug
    in clusterctl: one line, exit 70 (EX_SOFTWARE), the traceback only with CLUSTERCTL_DEBUG=1.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # exits 2 on bad arguments, 0 for --help and --version
        args.command = command
        if command and args.cmd != "exec":
            parser.error("`--` and a command only go with `clusterctl exec`")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else errors.EXIT_USAGE
    try:
        return args.fn(args)
    except errors.ClusterError as e:
        err.print(f"[red]error:[/red] {escape(e.message)}")
        if e.fix:
            err.print(f"  fix: {escape(e.fix)}")
        return e.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        return errors.EXIT_INTERRUPTED
    except BrokenPipeError:  # `clusterctl runs | head`: the reader left; nothing more to say
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        except OSError:
            pass
        return errors.EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - the last line of defence: a bug, said in one line
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            err.print_exception()
        first = (str(e).splitlines() or [""])[0][:300]
        err.print(f"[red]internal error:[/red] {escape(type(e).__name__)}: {escape(first)}")
        err.print(f"  this is a bug in clusterctl {__version__}; please report it with the command you ran "
                  f"(re-run with {DEBUG_ENV}=1 to see the traceback)")
        return errors.EXIT_INTERNAL


if __name__ == "__main__":
    raise SystemExit(main())
