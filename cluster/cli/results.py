"""`clusterctl collect|report|study`: results back to the head, compared, and the whole study in one go."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from cluster import errors
from cluster.cli.args import (FRACTION, add_forks, add_inventory_option, add_job_settings, add_limit, add_power,
                              add_price, add_run)
from cluster.cli.output import emit_json, err, error_line, load_inventory, notes, out, styled, table

if TYPE_CHECKING:
    from cluster.runs.collect import RunCollect

VERDICT_EXIT = {"ok": errors.EXIT_OK, "failed": errors.EXIT_FAILED, "unreachable": errors.EXIT_UNREACHABLE}
# the terminal gets the columns a comparison needs; the pages have them all
REPORT_COLUMNS = ("run", "framework", "nodes", "images/s", "e2e images/s", "epoch s", "final val acc", "best val acc",
                  "s to val acc", "time to target vs 1 node", "scaling eff.", "e2e speed-up vs 1 node", "energy kWh",
                  "launcher", "state", "wall s", "exit codes", "CPU %", "peak MB", "metrics records")  # own programs


def configure(name: str, p: argparse.ArgumentParser) -> None:
    {"collect": _declare_collect, "report": _declare_report, "study": _declare_study}[name](p)
    p.set_defaults(fn={"collect": cmd_collect, "report": cmd_report, "study": cmd_study}[name])


def _declare_collect(p: argparse.ArgumentParser) -> None:
    add_run(p)
    p.add_argument("--all", action="store_true", help="every recorded run")
    add_inventory_option(p, "reach the nodes as this inventory says (default: as recorded when the run started)")
    p.add_argument("--with-checkpoints", action="store_true", help="also what the job names large (large_outputs: the built-in programs' checkpoints)")
    add_forks(p)


def _declare_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="*", metavar="RUN", help="run ids or prefixes (default: the latest run)")
    p.add_argument("--html", metavar="FILE", help="the HTML page (default: runs/<run>/report.html, or "
                   "reports/report-<time>.html for several runs)")
    p.add_argument("--markdown", metavar="FILE", help="also (or only) a Markdown page, plots next to it")
    add_price(p)
    p.add_argument("--target-acc", type=FRACTION, default=0.9, metavar="ACC",
                   help="validation accuracy whose time to reach is reported (default 0.9)")


def _declare_study(p: argparse.ArgumentParser) -> None:
    p.add_argument("jobs", nargs="+", metavar="JOB", help="job names or spec files, e.g. resnet50-ddp resnet50-tf")
    p.add_argument("--nodes", default="1,2", help="node counts, comma-separated (default 1,2); the first N nodes")
    add_inventory_option(p)
    add_limit(p, "only these of each job's nodes (an Ansible host pattern, docs/cli.md); the first N of them")
    add_forks(p)
    add_job_settings(p, "job setting for every run; repeatable")
    p.add_argument("--vary", metavar="KEY=V1,V2", help="one setting that differs between runs, every job x node "
                   "count with each value, e.g. grad_compression=none,fp16 (a setting that only changes the wire, "
                   "like this one, runs one node once: every value's scaling baseline)")
    add_price(p)
    add_power(p)
    p.add_argument("--on", metavar="NAME", help="run every cell on the inventory's Slurm cluster NAME "
                   "(docs/slurm.md): N nodes of its partition instead of the first N PCs")


# --------------------------------------------------------------------------- collect


def cmd_collect(args: argparse.Namespace) -> int:
    from rich.progress import DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from cluster.runs import collect
    from cluster.inventory import loader
    from cluster.schedulers import api

    records = collect.chosen_runs(args.run, args.all)
    override = loader.load(args.inventory).hosts if args.inventory else None
    prog = Progress(TextColumn("{task.description}"), DownloadColumn(), TransferSpeedColumn(), console=err,
                    transient=True, disable=not err.is_terminal or args.json)
    tasks = {(r.run_id, n.node): prog.add_task(f"{r.run_id} {n.node}", total=None) for r in records for n in r.nodes}

    def advance(run: str, node: str, n: int) -> None:
        if (run, node) not in tasks:  # a Slurm run's nodes are known once its tasks ran
            tasks[(run, node)] = prog.add_task(f"{run} {node}", total=None)
        prog.advance(tasks[(run, node)], n)

    with prog:  # each run through its scheduler: its PCs over SSH, or the job's folder on a cluster
        summary = api.collect_runs(records, checkpoints=args.with_checkpoints, forks=args.forks, on_bytes=advance,
                                   inventory_hosts=override)
    if args.json:
        docs = [r.to_dict() for r in summary.runs]
        emit_json(docs if args.all else docs[0])
    else:
        for run in summary.runs:
            _print_collect(run)
    return VERDICT_EXIT[summary.verdict]


def _print_collect(run: RunCollect) -> None:
    from cluster.runs.collect import CHANGED_FIX

    t = table(f"collect {run.run_id} -> {escape(str(run.folder))}",
              ("node", "status", "files", "fetched", "transferred", "node total", "skipped", "refused", "changed",
               "time"))
    for c in run.nodes.values():
        t.add_row(c.node, f"[{'green' if c.status == 'ok' else 'red'}]{c.status}[/]", str(c.files),
                  str(c.fetched), f"{c.bytes / 2**20:.2f} MiB", f"{c.total_bytes / 2**20:.2f} MiB",
                  str(len(c.skipped)), str(len(c.refused)), str(len(c.changed)), f"{c.duration:.1f}s")
    out.print(t)
    for c in run.nodes.values():
        if c.woke:
            out.print(f"{c.node}: {escape(c.woke)}")
        if c.error:
            out.print(error_line("error", c.node, c.error, c.fix))
        for x in c.refused:
            out.print(f"[red]refused[/red] {c.node}: {escape(x['reason'])}")
        for x in c.skipped:
            out.print(f"[yellow]skipped[/yellow] {c.node}: {escape(x['path'])} ({escape(x['reason'])})")
        for x in c.changed:
            out.print(f"[yellow]changed[/yellow] {c.node}: {escape(x['path'])} ({escape(x['reason'])})")
        left = [f"{c.shipped} shipped file(s), unchanged (the head has them)"] if c.shipped else []
        left += [f"{c.not_outputs} path(s) of the program's folder outside its outputs"] if c.not_outputs else []
        if left:
            out.print(f"[dim]left on {c.node}: {'; '.join(left)}[/dim]")
        if c.large:
            named = ", ".join(f"{escape(x['path'])} ({x['size'] / 2**20:.1f} MiB)" for x in c.large)
            out.print(f"left on {c.node}: {named}: `clusterctl collect {run.run_id} --with-checkpoints` brings "
                      f"{'it' if len(c.large) == 1 else 'them'}", soft_wrap=True)
    if any(c.changed for c in run.nodes.values()):  # a running run's program at work: a note, not a failure
        out.print(f"[dim]changed: the run's files moved under the copy; {CHANGED_FIX}[/dim]")


# --------------------------------------------------------------------------- report


def cmd_report(args: argparse.Namespace) -> int:
    from cluster.study import report
    from cluster.runs import records as runs

    figs, written = report.write_pages(args.runs or [runs.load().run_id],
                                       html=Path(args.html) if args.html else None,
                                       markdown=Path(args.markdown) if args.markdown else None,
                                       price_kwh=args.price_kwh, target_acc=args.target_acc)
    if args.json:
        emit_json({"runs": [f.to_dict() for f in figs], "written": [str(p) for p in written]})
        return errors.EXIT_OK
    head, rows = report.summary_rows(figs)
    keep = [i for i, h in enumerate(head) if h in REPORT_COLUMNS or h.startswith("s to val acc ")]
    t = table(report.title(figs), (head[i] for i in keep), overflow="fold")
    for r in rows:
        t.add_row(*(r[i] for i in keep))
    out.print(t)
    for p in written:
        out.print(f"written: {escape(str(p))}")
    return errors.EXIT_OK


# --------------------------------------------------------------------------- study


def _sizes(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise errors.UsageError(f"--nodes {text!r}: expected node counts separated by commas",
                                "e.g. --nodes 1,2,4") from None


def cmd_study(args: argparse.Namespace) -> int:
    from cluster.schedulers import api
    from cluster.study import matrix

    from cluster.cli.nodes import poweroff_after, wake_first

    inv = load_inventory(args.inventory, None, args.ssh_config)
    api.check_options(api.for_launch(args.on, inv), {k: getattr(args, k) for k in ("wake", "poweroff_after", "limit")},
                      args.on)  # the PCs' own options
    hosts = inv.select(args.limit) if args.wake or args.poweroff_after else []
    wake_first(args, inv, hosts)
    sid, cells, page = matrix.run(inv, args.jobs, _sizes(args.nodes), args.set or [], args.price_kwh,
                                 log=notes(args.json), vary=args.vary, limit=args.limit, forks=args.forks,
                                 on=args.on, outside_slurm=args.outside_slurm)
    if args.json:
        emit_json({"study": sid, "cells": [dict(c.__dict__) for c in cells], "report": str(page) if page else None})
    else:
        varied = any(c.setting for c in cells)
        t = table(f"{sid} ({escape(str(inv.path))})", ("job", *(["setting"] if varied else []), "nodes", "run",
                                                       "state", "note"))
        for c in cells:
            t.add_row(c.job, *([escape(c.setting or "")] if varied else []), str(c.nodes), c.run_id or "-",
                      styled(c.state, "red"),
                      "done before" if c.skipped else escape(c.error or ""))
        out.print(t)
        if page:
            out.print(f"report: {escape(str(page))}")
    off = poweroff_after(args, inv, hosts)  # the study has collected every run: its results are on this head
    if not all(c.state == "succeeded" for c in cells):
        return errors.EXIT_FAILED
    return errors.EXIT_OK if off else errors.EXIT_UNREACHABLE
