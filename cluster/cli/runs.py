"""`clusterctl launch|runs|status|logs|stop`: start a job on its nodes and follow, list, read and stop runs."""
from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from cluster import errors
from cluster.cli.args import (GRACE_S, NON_NEGATIVE_INT, add_forks, add_inventory_option, add_limit, add_power,
                              add_run)
from cluster.cli.output import (NOISE_NOTES, emit_json, err, last_line, load_inventory, noise_kind, notes, out,
                                styled, table, with_noise_notes)

if TYPE_CHECKING:
    from cluster.runs.records import RunRecord


def configure(name: str, p: argparse.ArgumentParser) -> None:
    if name == "launch":
        _declare_launch(p)
        p.set_defaults(fn=cmd_launch)
        return
    add_run(p)
    if name == "logs":
        p.add_argument("--node", help="only this node")
        p.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
        p.add_argument("-n", "--lines", type=NON_NEGATIVE_INT, default=50, help="last lines per node (default 50)")
    if name == "stop":
        p.add_argument("--grace", type=GRACE_S, default=10.0,
                       help="seconds between SIGTERM and SIGKILL (default 10, at most 3600)")
        add_inventory_option(p, "a run this head has no record of is looked up in this inventory's rooms' Slurm "
                                "by name (default: the current context)")
    p.set_defaults(fn={"status": cmd_status, "logs": cmd_logs, "stop": cmd_stop}[name])


def _declare_launch(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", metavar="JOB", nargs="?",
                   help="a job name (jobs/JOB.yaml) or a spec file (docs/jobs.md); or none and `-- python "
                        "train.py ARGS`: your own program, the current folder shipped to every node")
    p.add_argument("--launcher", choices=("torchrun", "tensorflow", "plain"),
                   help="with `-- COMMAND`: how it starts on each node (default torchrun)")
    p.add_argument("--code", metavar="DIR", help="with `-- COMMAND`: the folder shipped (default: the current one)")
    p.add_argument("--name", metavar="NAME", help="with `-- COMMAND`: the job's name (default: the folder's)")
    p.add_argument("--requirements", metavar="FILE", help="with `-- COMMAND`: a requirements file in the folder, "
                   "installed offline on every node beside the provisioned environment (default: the folder's "
                   "requirements.txt, if it has one; `none`: no requirements)")
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
    _declare_schedulers(p)


def _declare_schedulers(p: argparse.ArgumentParser) -> None:
    """`--on NAME` and each scheduler's own options, as the schedulers declare them (cluster/schedulers)."""
    from cluster.cli.args import NON_NEGATIVE_INT, POSITIVE_INT
    from cluster.schedulers import api

    p.add_argument("--on", metavar="NAME", help="run the job on the inventory's cluster NAME (`slurm:`, docs/slurm.md) "
                   "instead of its PCs, or through the room's own Slurm (a room `provision --slurm` set up)")
    kinds: dict[str, Callable[[str], Any]] = {"text": str, "positive": POSITIVE_INT, "count": NON_NEGATIVE_INT}
    seen: set[str] = set()  # an option two schedulers share (--nodes, --time) is one flag
    for sched in api.registry().values():
        g = p.add_argument_group(sched.title)
        for o in (o for o in sched.options if o.name not in seen):
            g.add_argument(o.flag, dest=o.name, metavar=o.metavar, type=kinds[o.kind], help=o.help)
            seen.add(o.name)


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


METRICS = (("procs", "processes", ""), ("CPU %", "cpu_percent", ".0f"), ("mem MB", "rss_mb", ".0f"),
           ("world", "world", ""), ("epoch", "epoch", ""), ("step", "step", ""), ("loss", "loss", ".4f"),
           ("images/s", "images_per_s", ".1f"), ("exit", "exit_code", ""))


def _last_line(d: dict[str, Any]) -> str:
    """A node's last line: a Slurm task's; a node agent's where the program writes no metrics (nor
    $CLUSTER_METRICS' step, epoch or loss), its program's own output as it goes."""
    if d.get("log_tail"):
        return last_line([x for x in d["log_tail"] if isinstance(x, str)], d.get("state") == "succeeded")
    if any(d.get(k) is not None for k in ("step", "epoch", "loss")) or not isinstance(d.get("log"), list):
        return ""
    return last_line([x for x in d["log"] if isinstance(x, str)], d.get("state") == "succeeded")


def run_table(record: RunRecord, statuses: Mapping[str, NodeView | dict[str, Any]], where: str = "") -> Table:
    """One row per node: the columns its scheduler's statuses carry (an SSH run's agents give processes, CPU
    and training metrics, or a program's last line where it writes none; a Slurm run's tasks an exit code and
    their last line)."""
    rows = {n: (s if isinstance(s, dict) else s.to_dict()) for n, s in statuses.items()}
    cols = [c for c in METRICS if any(c[1] in d for d in rows.values())]
    lasts = {n: _last_line(d) for n, d in rows.items()}
    tails = any(lasts.values())
    t = table(f"{record.run_id}: {styled(record.state)} ({record.job}, world size {record.world_size}"
              + (f"; {escape(where)}" if where else "") + ")",
              ("node", "state", *(c[0] for c in cols), *(("last line",) if tails else ())),
              overflow="fold" if tails else "ellipsis")
    names = [n.node for n in record.nodes] or list(rows)
    for name in names:
        d = rows.get(name)
        if d is None:
            t.add_row(escape(name), "?", *["-"] * (len(cols) + tails))
            continue
        cells = [_cell(d.get(key), fmt) for _, key, fmt in cols]
        t.add_row(escape(name), styled(str(d.get("state"))), *cells,  # Text: a program's "[rank0]:train:" as written
                  *((Text(lasts[name][:160]),) if tails else ()))
    return t


def _print_details(record: RunRecord) -> None:
    """Below the table: the run's failure, then what its scheduler has to say (cluster/schedulers)."""
    from cluster.schedulers import api

    f = record.failure
    if f is not None:
        out.print(f"[red]run failed[/red] on {escape(f.node)}: {escape(f.reason)}"
                  + (f" (also: {', '.join(f.also)})" if f.also else ""))
        for line in f.log:
            out.print(f"  [dim]{escape(f.node)}|[/dim] {escape(line)}")
        fix = f.fix(((record.extra.get("targets") or {}).get(f.node) or {}).get("gpus"))
        if fix:
            out.print(f"  fix: {escape(fix)}", soft_wrap=True)
    for line in api.of(record).details(record):
        out.print(escape(line))


def _run_exit(record: RunRecord) -> int:
    if set(record.stop_pending) & set(record.members()):  # a node it dropped is retried, and said (_print_details)
        return errors.EXIT_UNREACHABLE
    return {"succeeded": errors.EXIT_OK, "running": errors.EXIT_OK, "starting": errors.EXIT_OK, "queued": errors.EXIT_OK,
            "restarting": errors.EXIT_OK, "dry-run": errors.EXIT_OK}.get(record.state, errors.EXIT_FAILED)


# --------------------------------------------------------------------------- launch


def cmd_launch(args: argparse.Namespace) -> int:
    from cluster.schedulers import api

    inv = load_inventory(args.inventory, args.host_set, args.ssh_config)
    sched = api.for_launch(args.on, inv)
    api.check_options(sched, vars(args), args.on)
    spec = _spec(args, inv)  # first: it refuses --plan where there is no JOB to plan (--continue, `-- COMMAND`)
    planned = None
    if args.plan:
        from cluster.planner import plans

        planned = plans.load_recommended(inv, args.job).to_dict()
    if args.poweroff_after and (args.detach or args.dry_run):
        raise errors.UsageError("--poweroff-after waits for the run's end and its collect",
                                "drop --detach (or --dry-run), or run `clusterctl collect` then `clusterctl poweroff`")
    sub = api.Submission(inv, spec, on=args.on, limit=args.limit, forks=args.forks, outside_slurm=args.outside_slurm,
                         options={o.name: getattr(args, o.name) for o in sched.options})
    if args.dry_run:  # the request submit would run, printed (torchx's dryrun_info)
        request = sched.dryrun(sub, notes(args.json))
        if args.json:
            emit_json(request.to_dict())
        else:
            out.out(request.to_text(width=out.width), end="", highlight=False)
        return errors.EXIT_OK
    if args.wake:
        from cluster.cli.nodes import wake_first

        wake_first(args, inv, sched.pcs(sub) or [])
    log = notes(args.json)
    request = sched.dryrun(sub, log)
    with err.status(f"starting {request.run_id}"):
        record = sched.submit(request, log, prediction=planned, forks=args.forks)
    if not args.json:
        where = sched.where(record)
        err.print(f"run {record.run_id}: {where}" if where else
                  f"run {record.run_id} started on {len(record.nodes)} nodes (world size {record.world_size})")
        for node, why in record.left_out.items():
            err.print(f"[yellow]left out: {escape(node)} ({escape(why)}); the job's min_nodes lets it start "
                      "without[/yellow]")
    if args.detach:
        if args.json:
            emit_json(record.to_dict())
        else:
            out.print(f"detached: follow it with `clusterctl status {record.run_id}` or `clusterctl logs "
                      f"{record.run_id} -f`; stop it with `clusterctl stop {record.run_id}`")
        return errors.EXIT_OK
    try:
        record = _follow(record, args.json)
    except KeyboardInterrupt:
        err.print(f"detached; the run goes on (its scheduler keeps it). Stop it with `clusterctl stop {record.run_id}`")
        return errors.EXIT_INTERRUPTED
    _print_run_end(args, record)
    if args.poweroff_after:
        from cluster.cli.nodes import poweroff_after
        from cluster.inventory.model import Host

        api.of(record).collect(record)  # the results on this head first: nothing a user ran is lost
        if not poweroff_after(args, inv, [Host.from_dict(h) for h in record.inventory["hosts"]]):
            return errors.EXIT_UNREACHABLE
    return _run_exit(record)


OWN_PROGRAM_OPTIONS = ("code", "name", "launcher", "requirements", "data", "outputs")  # with `-- COMMAND` only


def _spec(args: argparse.Namespace, inv: Any) -> Any:
    """The job spec a launch runs: a named or given spec file, or the ad-hoc one of `-- COMMAND`."""
    from pathlib import Path

    from cluster.errors import UsageError
    from cluster.runs import jobs
    from cluster.planner import plans

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
                                 args.set or [], options=extra)
    if not args.job:
        raise UsageError("launch needs a JOB or `-- COMMAND`",
                         "clusterctl launch resnet50-ddp, or clusterctl launch -- python train.py ARGS")
    if jobs.program_words([args.job]):
        raise UsageError(f"{args.job} is a program, not a job spec: a program's command goes after `--`",
                         f"clusterctl launch -- {'python ' if args.job.endswith('.py') else ''}{args.job} ARGS")
    for given in OWN_PROGRAM_OPTIONS:
        if getattr(args, given):
            raise UsageError(f"--{given} goes with `-- COMMAND`", f"set it in the job spec ({given}:) instead")
    return jobs.load(args.job, (plans.overrides_for(inv, args.job) if args.plan else []) + (args.set or []))


def _follow(record: RunRecord, quiet: bool) -> RunRecord:
    """Its scheduler's follow, shown: a live table on a terminal, else one line per change of a node's state or
    epoch."""
    from rich.live import Live

    from cluster.schedulers import api

    sched = api.of(record)
    live = Live(console=err, transient=False, auto_refresh=False) if err.is_terminal and not quiet else None
    seen: dict[str, str] = {}

    def update(rec: RunRecord, statuses: Mapping[str, NodeView | dict[str, Any]]) -> None:
        if live is not None:
            live.update(run_table(rec, statuses, sched.where(rec)), refresh=True)
        elif not quiet:
            for name, s in statuses.items():
                d = s if isinstance(s, dict) else s.to_dict()
                key = f"{d.get('state')} epoch {d.get('epoch')}"
                if seen.get(name) != key:
                    seen[name] = key
                    shown = " ".join(f"{k} {format(d[k], f)}" for k, f in (("epoch", ""), ("step", ""), ("loss", ".4f"))
                                     if d.get(k) is not None)  # a program of one's own may write a step only
                    err.print(f"{name}: {d.get('state')}" + (f", {shown}" if shown else ""))
            where = sched.where(rec)
            if where and seen.get("") != where:
                seen[""] = where
                err.print(where)

    if live is None:
        return sched.follow(record, on_update=update)
    with live:
        return sched.follow(record, on_update=update)


def _print_run_end(args: argparse.Namespace, record: RunRecord) -> None:
    from cluster.schedulers import api

    if args.json:
        emit_json(record.to_dict())
        return
    if record.last_status:
        out.print(run_table(record, record.last_status, api.of(record).where(record)))
    _print_details(record)
    if record.state == "succeeded":
        took = (record.ended or 0) - (record.started or 0)
        out.print(f"run {record.run_id} succeeded in {took:.0f} s; `clusterctl collect {record.run_id}` brings its "
                  "results to this head")


# --------------------------------------------------------------------------- runs, status, logs, stop


def cmd_status(args: argparse.Namespace) -> int:
    from cluster.runs import records as runs
    from cluster.schedulers import api

    record = runs.load(args.run)
    sched = api.of(record)
    record = sched.describe(record)
    if args.json:
        emit_json(record.to_dict() | {"where": sched.where(record)})
    else:
        out.print(run_table(record, record.last_status or {}, sched.where(record)))
        _print_details(record)
    return _run_exit(record)


def cmd_logs(args: argparse.Namespace) -> int:
    from cluster.runs import records as runs
    from cluster.schedulers import api

    record = runs.load(args.run)
    sched = api.of(record)
    if record.nodes and args.node is not None and args.node not in record.node_dirs():
        raise errors.UsageError(f"run {record.run_id} has no node '{args.node}'",
                                f"one of: {', '.join(record.node_dirs())}")
    if not args.follow:
        got = sched.logs(record, args.node, lines=args.lines)
        if args.json:
            emit_json(dict(got))
        else:
            from cluster.agent.runfiles import screen

            for name, text in got.items():  # as a terminal shows it: each progress bar once, its last drawing
                lines = screen(text.rstrip("\n").split("\n"))
                out.rule(name)
                out.out("\n".join(with_noise_notes(lines) if record.state == "succeeded" else lines), highlight=False)
        return _logs_exit(got.unreachable)
    unreachable: set[str] = set()
    noisy: dict[str, set[str]] = {}  # node -> the kinds of torchrun's known noise its lines held
    try:
        for name, line in sched.log_iter(record, args.node, unreachable=unreachable):
            out.out(f"{name}| {line}", highlight=False)
            kind = noise_kind(line)
            if kind:
                noisy.setdefault(name, set()).add(kind)
    except KeyboardInterrupt:
        return errors.EXIT_INTERRUPTED
    if noisy and runs.load(record.run_id).state == "succeeded":  # known once the lines are through: said after
        for name, kinds in sorted(noisy.items()):
            for kind in sorted(kinds):
                out.out(f"{name}| {NOISE_NOTES[kind].format(where='above')}", highlight=False)
    return _logs_exit(unreachable)


def _logs_exit(unreachable: set[str]) -> int:
    """Exit 3 when a node's log could not be read: what was printed is not the whole story."""
    if unreachable:
        err.print(f"[red]could not reach {', '.join(sorted(unreachable))}[/red]: their logs are not shown")
        return errors.EXIT_UNREACHABLE
    return errors.EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from cluster.runs import records as runs
    from cluster.schedulers import api

    try:
        record = runs.load(args.run)
    except errors.UsageError as e:
        if not args.run:
            raise
        from cluster.cli.room import stop_others  # another student's run: only the room's Slurm knows it

        return stop_others(args, e)
    sched = api.of(record)
    with err.status(f"stopping {record.run_id}"):
        record = sched.stop(record, grace=args.grace)
    results = record.stop_results or {}
    if args.json:
        emit_json(record.to_dict() | {"where": sched.where(record)})
    else:
        for n, r in results.items():
            out.print(f"{n}: " + ("[green]nothing left running[/]" if r.get("ok") else
                                  f"[red]not confirmed stopped: {escape(str(r.get('error') or r.get('left')))}[/]")
                      + (f" (terminated {len(r.get('terminated') or [])}, killed {len(r.get('killed') or [])})"
                         if r.get("ok") and "terminated" in r else ""))
        ended = ": every node's program had ended by itself before the stop reached it" \
            if record.state == "succeeded" else ""
        where = sched.where(record)
        out.print(f"run {record.run_id}: {record.state}{ended}" + (f" ({escape(where)})" if where else "")
                  + "; logs and metrics stay where it ran")
        for line in sched.details(record):
            out.print(escape(line))
    if record.stop_pending:  # exit 3 when a node could not be reached, 1 when a reachable one kept processes
        unreachable = any(results.get(n, {}).get("status") == "unreachable" for n in record.stop_pending)
        return errors.EXIT_UNREACHABLE if unreachable else errors.EXIT_FAILED
    return errors.EXIT_OK
