"""`clusterctl launch|runs|status|logs|stop`: start a job on its nodes and follow, list, read and stop runs."""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from rich.markup import escape
from rich.table import Table

from cluster import errors
from cluster.cli.args import (GRACE_S, NON_NEGATIVE_INT, add_forks, add_inventory_option, add_limit, add_power,
                              add_run)
from cluster.cli.output import emit_json, err, load_inventory, notes, out, styled, table

if TYPE_CHECKING:
    from cluster.runs.records import RunRecord


def configure(name: str, p: argparse.ArgumentParser) -> None:
    if name == "launch":
        _declare_launch(p)
        p.set_defaults(fn=cmd_launch)
        return
    if name == "runs":
        p.set_defaults(fn=cmd_runs)
        return
    add_run(p)
    if name == "logs":
        p.add_argument("--node", help="only this node")
        p.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
        p.add_argument("-n", "--lines", type=NON_NEGATIVE_INT, default=50, help="last lines per node (default 50)")
    if name == "stop":
        p.add_argument("--grace", type=GRACE_S, default=10.0,
                       help="seconds between SIGTERM and SIGKILL (default 10, at most 3600)")
    p.set_defaults(fn={"status": cmd_status, "logs": cmd_logs, "stop": cmd_stop}[name])


def _declare_launch(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", metavar="JOB", nargs="?",
                   help="a job name (playbooks/JOB.yaml) or a spec file (docs/jobs.md); or none and `-- python "
                        "train.py ARGS`: your own program, the current folder shipped to every node")
    p.add_argument("--launcher", choices=("torchrun", "tensorflow", "plain"),
                   help="with `-- COMMAND`: how it starts on each node (default torchrun)")
    p.add_argument("--code", metavar="DIR", help="with `-- COMMAND`: the folder shipped (default: the current one)")
    p.add_argument("--name", metavar="NAME", help="with `-- COMMAND`: the job's name (default: the folder's)")
    p.add_argument("--requirements", metavar="FILE", help="with `-- COMMAND`: a requirements file in the folder, "
                   "installed offline on every node beside the provisioned environment")
    p.add_argument("--data", metavar="PATH", help="with `-- COMMAND`: a file or folder on this PC, staged on every "
                   "node once and named to the program as $CLUSTER_DATA")
    p.add_argument("--outputs", metavar="DIR", action="append",
                   help="with `-- COMMAND`: a folder (or file) of the program's working directory that collect "
                        "brings back; repeatable (default: everything the program wrote there)")
    add_inventory_option(p)
    add_limit(p, "only these of the job's nodes (an Ansible host pattern, docs/cli.md)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a job setting, e.g. --set epochs=2 --set optimizer.lr=0.02; repeatable")
    p.add_argument("--host-set", action="append", metavar="KEY=VALUE", help="override a host field on every host")
    add_forks(p)
    p.add_argument("--dry-run", action="store_true", help="print every node's files and commands; change nothing")
    p.add_argument("--detach", action="store_true", help="start and return; don't follow the run")
    p.add_argument("--plan", action="store_true",
                   help="use `clusterctl plan JOB`'s recommended nodes and per-node batch shares")
    p.add_argument("--continue", dest="continue_run", metavar="RUN",
                   help="a new run that takes an ended RUN further from what it left on its nodes (its checkpoint): "
                        "RUN's job, settings and nodes; --set epochs=N for N epochs in all (docs/jobs.md)")
    add_power(p)
    _declare_slurm(p)


def _declare_slurm(p: argparse.ArgumentParser) -> None:
    """`launch JOB --on NAME`: the same job on a Slurm cluster of the inventory (docs/slurm.md)."""
    from cluster.cli.args import POSITIVE_INT

    g = p.add_argument_group("on a Slurm cluster (docs/slurm.md)")
    g.add_argument("--on", metavar="NAME", help="run the job on the inventory's Slurm cluster NAME (`slurm:`)")
    g.add_argument("--partition", metavar="P", help="with --on: the partition (default: the inventory's, else Slurm's)")
    g.add_argument("--account", metavar="A", help="with --on: the account charged (default: the inventory's)")
    g.add_argument("--qos", metavar="Q", help="with --on: the quality of service (default: the inventory's)")
    g.add_argument("--nodes", type=POSITIVE_INT, metavar="N",
                   help="with --on: how many nodes (default: as many as the job uses on the inventory's hosts)")
    g.add_argument("--time", metavar="T", help="with --on: the time limit, e.g. 30, 2:00:00, 1-12:00:00")
    g.add_argument("--mem", metavar="M", help="with --on: memory per node, e.g. 16G (default: Slurm's)")
    g.add_argument("--gpus-per-node", type=NON_NEGATIVE_INT, metavar="G", help="with --on: GPUs per node")
    g.add_argument("--cpus-per-task", type=POSITIVE_INT, metavar="C", help="with --on: CPUs of each node's task")


# --------------------------------------------------------------------------- a run, shown


class NodeView(Protocol):
    """What the run table reads of a node's status (launch's NodeStatus)."""

    @property
    def state(self) -> str: ...
    @property
    def epoch(self) -> int | None: ...
    @property
    def step(self) -> int | None: ...
    @property
    def loss(self) -> float | None: ...
    def to_dict(self) -> dict[str, Any]: ...


def _cell(value: Any, fmt: str = "") -> str:
    return "-" if value is None else format(value, fmt)


def run_table(record: RunRecord, statuses: Mapping[str, NodeView | dict[str, Any]]) -> Table:
    t = table(f"{record.run_id}: {styled(record.state)} ({record.job}, world size {record.world_size})",
              ("node", "state", "procs", "CPU %", "mem MB", "world", "epoch", "step", "loss", "images/s"))
    for n in record.nodes:
        s = statuses.get(n.node)
        if s is None:
            t.add_row(n.node, "?", *["-"] * 8)
            continue
        d = s if isinstance(s, dict) else s.to_dict()
        t.add_row(n.node, styled(d["state"]), str(d["processes"]), _cell(d.get("cpu_percent"), ".0f"),
                  _cell(d.get("rss_mb"), ".0f"), str(d["world"] or "-"), _cell(d["epoch"]),
                  _cell(d["step"]), _cell(d["loss"], ".4f"), _cell(d["images_per_s"], ".1f"))
    return t


def _print_details(record: RunRecord) -> None:
    """Below the table: the run it continues, its membership periods, its failure, nodes not confirmed stopped."""
    from cluster.runs import elastic

    cont = record.extra.get("continues")
    if cont:
        out.print(f"continues run {escape(cont['run'])} (from what it left on {escape(', '.join(cont['copied']))})")
    for line in elastic.describe(record):  # the membership periods of a run that lost a node and went on
        out.print(escape(line))
    f = record.failure
    if f is not None:
        out.print(f"[red]run failed[/red] on {f.node}: {escape(f.reason)}"
                  + (f" (also: {', '.join(f.also)})" if f.also else ""))
        for line in f.log:
            out.print(f"  [dim]{f.node}|[/dim] {escape(line)}")
    if record.stop_pending:
        out.print(f"[red]not confirmed stopped[/red] (unreachable): {', '.join(record.stop_pending)}; "
                  f"run `clusterctl stop {record.run_id}` when they are back"
                  + (" (the watcher stops what a dropped node left running when it answers again)"
                     if set(record.stop_pending) <= set(record.dropped) else ""))
    elif f is not None and record.stop_results:
        out.print("the other nodes were stopped")
    _print_firewall_left(record)
    if f is not None:
        out.print(f"logs and metrics stay on the nodes (`clusterctl logs {record.run_id}`)")


def _print_firewall_left(record: RunRecord) -> None:
    from cluster.runs import state

    for n, why in state.firewall_left(record).items():
        out.print(f"[red]firewall rule left open[/red] on {n} ({escape(why)}): run `clusterctl stop {record.run_id}` "
                  f"again, or remove the rules whose comment is \"clusterctl {record.run_id}\" "
                  "(`sudo nft -a list ruleset`, then `sudo nft delete rule FAMILY TABLE CHAIN handle N`)")


def _watched(record: RunRecord) -> None:
    """A run still going, or with nodes whose stop is not confirmed (a dropped node, a PC off), whose watcher
    died (killed, the head rebooted) gets a new one: nobody else would judge it, go on without a node it loses,
    or stop what a node left running (and close its firewall rule) when it answers again, while no command runs."""
    from cluster.runs import elastic

    if (record.active or record.stop_pending) and record.watcher and not elastic.alive(record.watcher.get("pid")):
        from cluster.runs import watch

        watch.spawn(record.run_id)


def _run_exit(record: RunRecord) -> int:
    if set(record.stop_pending) & set(record.members()):  # a node it dropped is retried, and said (_print_details)
        return errors.EXIT_UNREACHABLE
    return {"succeeded": errors.EXIT_OK, "running": errors.EXIT_OK, "starting": errors.EXIT_OK,
            "restarting": errors.EXIT_OK, "dry-run": errors.EXIT_OK}.get(record.state, errors.EXIT_FAILED)


# --------------------------------------------------------------------------- launch


def cmd_launch(args: argparse.Namespace) -> int:
    from cluster.runs import launch

    inv = load_inventory(args.inventory, args.host_set, args.ssh_config)
    on_slurm = args.on is not None or any(getattr(args, o) is not None for o in SLURM_OPTIONS)
    if args.continue_run and on_slurm:
        raise errors.UsageError("--continue takes a run further on the PCs that hold its checkpoints, not on Slurm",
                                "drop --on (a Slurm job requeued by Slurm resumes there on its own, docs/slurm.md)")
    if on_slurm:
        return _launch_on_slurm(args, inv)  # `--on NAME`: a Slurm cluster (cluster/slurm/, docs/slurm.md)
    spec = _spec(args, inv)  # first: it refuses --plan where there is no JOB to plan (--continue, `-- COMMAND`)
    planned = None
    if args.plan:
        from cluster.study import plans

        planned = plans.load_recommended(inv, args.job).to_dict()
    if args.poweroff_after and (args.detach or args.dry_run):
        raise errors.UsageError("--poweroff-after waits for the run's end and its collect",
                                "drop --detach (or --dry-run), or run `clusterctl collect` then `clusterctl poweroff`")
    from cluster.cli.nodes import poweroff_after, wake_first

    if not args.dry_run:
        wake_first(args, inv, launch.select_hosts(inv, spec, args.limit))
    if args.dry_run:  # the request execute would start, printed (torchx's dryrun_info)
        request = launch.prepare(inv, spec, limit=args.limit, forks=args.forks)
        if args.json:
            emit_json(request.to_dict())
        else:
            out.out(request.to_text(width=out.width), end="", highlight=False)
        return errors.EXIT_OK
    record, _ = launch.launch(inv, spec, limit=args.limit, forks=args.forks, log=notes(args.json),
                              prediction=planned)  # prepare, then execute that same request
    if not args.json:
        err.print(f"run {record.run_id} started on {len(record.nodes)} nodes (world size {record.world_size})")
        for node, why in record.left_out.items():
            err.print(f"[yellow]left out: {escape(node)} ({escape(why)}); the job's min_nodes lets it start "
                      "without[/yellow]")
    if args.detach:
        if args.json:
            emit_json(record.to_dict())
        else:
            out.print(f"detached (a watcher on this head judges it meanwhile): follow it with `clusterctl status "
                      f"{record.run_id}` or `clusterctl logs {record.run_id} -f`; stop it with "
                      f"`clusterctl stop {record.run_id}`")
        return errors.EXIT_OK
    try:
        record = _follow(record, args.json)
    except KeyboardInterrupt:
        err.print(f"detached; the run goes on (its watcher judges it). Stop it with `clusterctl stop {record.run_id}`")
        return errors.EXIT_INTERRUPTED
    _print_run_end(args, record)
    if args.poweroff_after:
        from cluster.runs import collect
        from cluster.inventory.model import Host

        collect.collect(record)  # the results on this head first: nothing a user ran is lost
        if not poweroff_after(args, [Host.from_dict(h) for h in record.inventory["hosts"]]):
            return errors.EXIT_UNREACHABLE
    return _run_exit(record)


OWN_PROGRAM_OPTIONS = ("code", "name", "launcher", "requirements", "data", "outputs")  # with `-- COMMAND` only


def _spec(args: argparse.Namespace, inv: Any) -> Any:
    """The job spec a launch runs: a named or given spec file, or the ad-hoc one of `-- COMMAND`."""
    from pathlib import Path

    from cluster.errors import UsageError
    from cluster.runs import jobs
    from cluster.study import plans

    if args.continue_run:
        from cluster.runs import carryover

        not_with = [w for w, on in (("JOB", args.job), ("`-- COMMAND`", args.command), ("--plan", args.plan),
                                    *((f"--{g}", getattr(args, g)) for g in OWN_PROGRAM_OPTIONS)) if on]
        if not_with:
            raise UsageError(f"--continue takes the job, its settings and nodes from the run it continues (a plan's "
                             f"included): drop {', '.join(not_with)}",
                             f"clusterctl launch --continue {args.continue_run} [--set epochs=N]")
        return carryover.spec_for(args.continue_run, args.set or [])
    if args.command:
        if args.job or args.plan:
            raise UsageError("give either a JOB or `-- COMMAND`, not both" if args.job else
                             "--plan plans the built-in jobs only", "e.g. clusterctl launch -- python train.py --lr 0.1")
        extra = [f"requirements={args.requirements}"] if args.requirements else []
        extra += [f"data={os.path.abspath(Path(args.data).expanduser())}"] if args.data else []  # a link stays one
        extra += [f"outputs={json.dumps(args.outputs)}"] if args.outputs else []
        return jobs.from_command(args.command, Path(args.code or "."), args.launcher or "torchrun", args.name,
                                 [*extra, *(args.set or [])])
    if not args.job:
        raise UsageError("launch needs a JOB or `-- COMMAND`",
                         "clusterctl launch resnet50-ddp, or clusterctl launch -- python train.py ARGS")
    for given in OWN_PROGRAM_OPTIONS:
        if getattr(args, given):
            raise UsageError(f"--{given} goes with `-- COMMAND`", f"set it in the job spec ({given}:) instead")
    return jobs.load(args.job, (plans.overrides_for(inv, args.job) if args.plan else []) + (args.set or []))


# --------------------------------------------------------------------------- launch --on NAME (Slurm)

SLURM_OPTIONS = ("partition", "account", "qos", "nodes", "time", "mem", "gpus_per_node", "cpus_per_task")
# launch options that pick or power the inventory's PCs: a Slurm job's nodes come from the scheduler
NOT_ON_SLURM = {"limit": "--limit picks the inventory's PCs; Slurm chooses a job's nodes (--nodes N says how many)",
                "plan": "--plan places the job on the inventory's PCs; on Slurm give --nodes N",
                "wake": "--wake wakes the inventory's PCs, not a cluster's nodes",
                "poweroff_after": "--poweroff-after powers the inventory's PCs off, not a cluster's nodes"}


def _launch_on_slurm(args: argparse.Namespace, inv: Any) -> int:
    """`launch JOB --on NAME [--partition P ...] --dry-run`: the sbatch script, as submission will send it."""
    from cluster.errors import UsageError
    from cluster.slurm import submit
    from cluster.slurm.resources import SlurmOverrides

    if args.on is None:
        given = next(o for o in SLURM_OPTIONS if getattr(args, o) is not None)
        raise UsageError(f"--{given.replace('_', '-')} goes with --on NAME (a Slurm cluster of the inventory)",
                         f"clusterctl launch JOB --on NAME --{given.replace('_', '-')} ... (docs/slurm.md)")
    for option, why in NOT_ON_SLURM.items():
        if getattr(args, option, None):
            raise UsageError(f"--{option.replace('_', '-')} does not go with --on {args.on}", why)
    spec = _spec(args, inv)
    overrides = SlurmOverrides(**{o: getattr(args, o) for o in SLURM_OPTIONS})
    request = submit.prepare(inv, spec, args.on, overrides)  # every value checked first: exit 2 names it
    if not args.dry_run:
        from cluster.cli import slurm as slurm_cli

        return slurm_cli.submit(args, request)  # sinfo's check, staging, sbatch, then Slurm's verdict
    if args.json:
        emit_json(request.to_dict())
    else:
        out.out(request.to_text(width=out.width), end="", highlight=False)
    return errors.EXIT_OK


def _follow(record: RunRecord, quiet: bool) -> RunRecord:
    """launch.follow, shown: a live table on a terminal, else one line per change of a node's state or epoch."""
    from rich.live import Live

    from cluster.runs import launch

    live = Live(console=err, transient=False, auto_refresh=False) if err.is_terminal and not quiet else None
    seen: dict[str, str] = {}

    def update(rec: RunRecord, statuses: Mapping[str, NodeView]) -> None:
        if live is not None:
            live.update(run_table(rec, statuses), refresh=True)
        elif not quiet:
            for name, s in statuses.items():
                key = f"{s.state} epoch {s.epoch}"
                if seen.get(name) != key:
                    seen[name] = key
                    err.print(f"{name}: {s.state}" + (f", epoch {s.epoch} step {s.step} loss {s.loss:.4f}"
                                                      if s.loss is not None else ""))

    if live is None:
        return launch.follow(record, on_update=update)
    with live:
        return launch.follow(record, on_update=update)


def _print_run_end(args: argparse.Namespace, record: RunRecord) -> None:
    if args.json:
        emit_json(record.to_dict())
        return
    if record.last_status:
        out.print(run_table(record, record.last_status))
    _print_details(record)
    if record.state == "succeeded":
        took = (record.ended or 0) - (record.started or 0)
        out.print(f"run {record.run_id} succeeded in {took:.0f} s; "
                  f"results stay on the nodes under runs/{record.run_id}/")


# --------------------------------------------------------------------------- runs, status, logs, stop


def cmd_runs(args: argparse.Namespace) -> int:
    from cluster.runs import records as runs

    records, damaged = runs.scan()
    if args.json:
        emit_json([{k: getattr(r, k) for k in ("run_id", "job", "state", "created", "started", "ended",
                                              "world_size", "stop_pending")}
                   | {"nodes": [n.node for n in r.nodes]} for r in records]
                  + [{"error": e.message, "fix": e.fix} for e in damaged])
        return errors.EXIT_USAGE if damaged else errors.EXIT_OK
    t = table(f"runs in {escape(str(runs.runs_dir()))}", ("run", "job", "state", "nodes", "world", "started", "took"))
    for r in records:
        took = f"{(r.ended or time.time()) - r.started:.0f}s" if r.started else "-"
        t.add_row(r.run_id, r.job, styled(r.state), ",".join(n.node for n in r.nodes), str(r.world_size),
                  time.strftime("%Y-%m-%d %H:%M", time.localtime(r.started)) if r.started else "-", took)
    out.print(t)
    for e in damaged:  # never dropped silently: the busy check refuses while one is there
        err.print(f"[red]{escape(e.message)}[/red]\n  fix: {escape(e.fix or '')}")
    if not records and not damaged:
        out.print("no runs yet: clusterctl launch resnet50-ddp")
    return errors.EXIT_USAGE if damaged else errors.EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from cluster.runs import launch, records as runs

    record = runs.load(args.run)
    if record.target is not None:  # a Slurm run: Slurm's verdict (cluster/cli/slurm.py)
        from cluster.cli import slurm as slurm_cli

        return slurm_cli.status(args, record)
    record = launch.refresh(record)
    _watched(record)
    if args.json:
        emit_json(record.to_dict())
    else:
        out.print(run_table(record, record.last_status or {}))
        _print_details(record)
    return _run_exit(record)


def cmd_logs(args: argparse.Namespace) -> int:
    from cluster.runs import launch, logstream, records as runs

    record = runs.load(args.run)
    if record.target is not None:
        from cluster.cli import slurm as slurm_cli

        return slurm_cli.logs(args, record)
    if not args.follow:
        got = launch.logs(record, args.node, lines=args.lines)
        if args.json:
            emit_json({n: text for n, (text, _) in got.items()})
        else:
            for name, (text, _) in got.items():
                out.rule(name)
                out.out(text.rstrip("\n"), highlight=False)
        return _logs_exit(got.unreachable)
    unreachable: set[str] = set()
    try:
        for name, line in logstream.follow(record, args.node, unreachable=unreachable):
            out.out(f"{name}| {line}", highlight=False)
    except KeyboardInterrupt:
        return errors.EXIT_INTERRUPTED
    return _logs_exit(unreachable)


def _logs_exit(unreachable: set[str]) -> int:
    """Exit 3 when a node's log could not be read: what was printed is not the whole story."""
    if unreachable:
        err.print(f"[red]could not reach {', '.join(sorted(unreachable))}[/red]: their logs are not shown")
        return errors.EXIT_UNREACHABLE
    return errors.EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from cluster.runs import launch, records as runs

    record = runs.load(args.run)
    if record.target is not None:
        from cluster.cli import slurm as slurm_cli

        return slurm_cli.stop(args, record)
    with err.status(f"stopping {record.run_id} on {len(record.nodes)} nodes"):
        record = launch.stop(record, grace=args.grace)
    _watched(record)
    results = record.stop_results or {}
    if args.json:
        emit_json(record.to_dict())
    else:
        for n, r in results.items():
            out.print(f"{n}: " + ("[green]nothing left running[/]" if r.get("ok") else
                                  f"[red]not confirmed stopped: {escape(str(r.get('error') or r.get('left')))}[/]")
                      + (f" (terminated {len(r.get('terminated') or [])}, killed {len(r.get('killed') or [])})"
                         if r.get("ok") else ""))
        ended = ": every node's program had ended by itself before the stop reached it" \
            if record.state == "succeeded" else ""
        out.print(f"run {record.run_id}: {record.state}{ended}; logs and metrics stay on the nodes"
                  + (f"; run `clusterctl stop {record.run_id}` again when {', '.join(record.stop_pending)} "
                     "can be reached" if record.stop_pending else ""))
        _print_firewall_left(record)
    if record.stop_pending:  # exit 3 when a node could not be reached, 1 when a reachable one kept processes
        unreachable = any(results.get(n, {}).get("status") == "unreachable" for n in record.stop_pending)
        return errors.EXIT_UNREACHABLE if unreachable else errors.EXIT_FAILED
    return errors.EXIT_OK
