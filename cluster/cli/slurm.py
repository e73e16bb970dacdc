"""The run commands for a run on a Slurm cluster (cluster.slurm.run): launch --on NAME, status, logs, stop.

cluster/cli/runs.py comes here when the record says it ran on Slurm; the output and exit codes are the
SSH runs' (docs/cli.md), with Slurm's own words for where the job stands.
"""
from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from cluster import errors
from cluster.cli.output import emit_json, err, notes, out, styled, table

if TYPE_CHECKING:
    from cluster.runs.records import RunRecord
    from cluster.slurm.submit import SlurmRequest


def slurm_table(record: RunRecord) -> Table:
    from cluster.slurm import run

    tg = run.target(record)
    t = table(f"{record.run_id}: {styled(record.state)} ({record.job}, Slurm job {tg['job_id']} on {tg['cluster']}: "
              f"{tg.get('state', '?')}{', ' + tg['reason'] if tg.get('reason') else ''})",
              ("node", "state", "exit", "last line"), overflow="fold")
    for node, s in (record.last_status or {}).items():
        tail = [x for x in s.get("log_tail") or [] if x.strip()]
        code = s.get("exit_code")
        t.add_row(escape(node), styled(str(s.get("state"))), "-" if code is None else str(code),
                  escape(tail[-1][:160] if tail else ""))
    rq = tg.get("requeued")
    if rq and record.active:
        t.caption = (f"requeued by Slurm after it lost {', '.join(rq['lost'])} {rq.get('reason') or ''}: it starts "
                     "over when Slurm lets it (requeue: true)")
    return t


def _print_end(args: argparse.Namespace, record: RunRecord) -> None:
    if args.json:
        emit_json(record.to_dict())
        return
    out.print(slurm_table(record))
    f = record.failure
    if f is not None:
        out.print(f"[red]run failed[/red] on {escape(f.node)}: {escape(f.reason)}")
        for line in f.log[-10:]:
            out.print(f"  [dim]{escape(f.node)}|[/dim] {escape(line)}")
    if record.state == "succeeded":
        took = (record.ended or 0) - (record.started or 0)
        out.print(f"run {record.run_id} succeeded in {took:.0f} s; `clusterctl collect {record.run_id}` brings its "
                  "folder from the cluster")


def exit_code(record: RunRecord) -> int:
    return errors.EXIT_OK if record.state in ("succeeded", "running", "starting") else errors.EXIT_FAILED


def submit(args: argparse.Namespace, request: SlurmRequest) -> int:
    """Submit, then follow the job until Slurm ends it (or return at once with --detach)."""
    from cluster.slurm import run

    with err.status(f"submitting {request.run_id} to {request.cluster.name}"):
        record = run.submit(request, log=notes(args.json))
    if not args.json:
        err.print(f"run {record.run_id}: Slurm job {run.target(record)['job_id']} on {request.cluster.name}")
    if args.detach:
        if args.json:
            emit_json(record.to_dict())
        else:
            out.print(f"detached: `clusterctl status {record.run_id}` asks Slurm where it stands; "
                      f"`clusterctl stop {record.run_id}` cancels it")
        return errors.EXIT_OK
    seen: dict[str, str] = {}

    def update(r: RunRecord) -> None:
        if args.json:
            return
        key = str(run.target(r).get("state"))
        if seen.get("state") != key:
            seen["state"] = key
            err.print(f"Slurm job {run.target(r)['job_id']}: {key}")

    try:
        record = run.follow(record, on_update=update)
    except KeyboardInterrupt:
        err.print(f"detached; the job goes on in Slurm. Stop it with `clusterctl stop {record.run_id}`")
        return errors.EXIT_INTERRUPTED
    _print_end(args, record)
    return exit_code(record)


def status(args: argparse.Namespace, record: RunRecord) -> int:
    from cluster.slurm import run

    record = run.refresh(record)
    _print_end(args, record)
    return exit_code(record)


def logs(args: argparse.Namespace, record: RunRecord) -> int:
    """Each task's output file on the shared filesystem; -f: again every 2 s until the job ends."""
    from cluster.slurm import run

    shown: dict[str, int] = {}
    while True:
        got = run.logs(record, lines=args.lines if not args.follow else 100000)
        if args.json and not args.follow:
            emit_json(got)
            return errors.EXIT_OK
        for node, text in got.items():
            if args.node and node != args.node:
                continue
            lines = text.splitlines()
            if not args.follow:
                out.rule(node)
                out.out("\n".join(lines), highlight=False)
                continue
            for line in lines[shown.get(node, 0):]:
                out.out(f"{node}| {line}", highlight=False)
            shown[node] = len(lines)
        if not args.follow:
            return errors.EXIT_OK
        record = run.refresh(record)
        if not record.active:
            return errors.EXIT_OK
        try:
            time.sleep(2.0)
        except KeyboardInterrupt:
            return errors.EXIT_INTERRUPTED


def stop(args: argparse.Namespace, record: RunRecord) -> int:
    from cluster.slurm import run

    with err.status(f"cancelling Slurm job {run.target(record)['job_id']}"):
        record = run.stop(record)
    if args.json:
        emit_json(record.to_dict())
    else:
        out.print(f"run {record.run_id}: {record.state} (Slurm: {run.target(record).get('state')}); its folder stays "
                  "on the cluster: `clusterctl collect` brings it")
    return errors.EXIT_OK
