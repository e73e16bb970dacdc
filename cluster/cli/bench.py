"""`clusterctl bench|plan`: measure a mixed room, then pick a job's nodes and batch shares (docs/planning.md)."""
from __future__ import annotations

import argparse

from rich.markup import escape

from cluster import errors
from cluster.cli.args import (POSITIVE_INT, add_forks, add_inventory_option, add_job_settings, add_limit,
                              add_outside_slurm)
from cluster.cli.output import emit_json, err, load_inventory, notes, out, table

RECOMMENDED = " (recommended)"  # how plans.summary_rows marks the recommended node set


def configure(name: str, p: argparse.ArgumentParser) -> None:
    if name == "bench":
        add_inventory_option(p)
        add_limit(p, "only these nodes (an Ansible host pattern, docs/cli.md): the benchmark saved is theirs, so "
                     "`plan` chooses among them")
        add_forks(p)
        p.add_argument("--jobs", default="resnet50-ddp,resnet50-tf", help="jobs whose program, size and batch to "
                       "measure, comma-separated (default both frameworks)")
        p.add_argument("--steps", type=POSITIVE_INT, default=8,
                       help="training steps per node (the first 2 are warm-up)")
        add_job_settings(p)
        p.add_argument("--parallel", action="store_true",
                       help="all nodes at once (faster; only where nodes share no CPU, i.e. real PCs)")
        add_outside_slurm(p)
        p.set_defaults(fn=cmd_bench)
    else:
        p.add_argument("job", metavar="JOB")
        add_inventory_option(p)
        add_limit(p, "plan with only these of the job's benchmarked nodes (an Ansible host pattern, docs/cli.md)")
        add_job_settings(p)
        p.set_defaults(fn=cmd_plan)


def cmd_bench(args: argparse.Namespace) -> int:
    from cluster.planner import bench
    from cluster.room import held

    inv = load_inventory(args.inventory, None, args.ssh_config)
    held.guard(inv, [h.name for h in inv.select(args.limit)], "bench runs training on {them} outside its queue",
               "clusterctl launch JOB --on {room} runs a job through its queue", args.outside_slurm,
               log=lambda s: err.print(f"[yellow]{escape(s)}[/yellow]"))
    res = bench.run(inv, args.jobs.split(","), steps=args.steps, overrides=args.set or [], parallel=args.parallel,
                    log=notes(args.json), limit=args.limit, forks=args.forks)
    if args.json:
        emit_json(res.to_dict())
    else:
        head, rows = bench.summary_rows(res, [h.name for h in inv.ordered(inv.select(args.limit))])
        t = table(f"bench {inv.name}: each node alone (images/s at the job's size and batch)", head)
        for row in rows:
            t.add_row(*(escape(c) for c in row))
        out.print(t)
        net = res.network
        if net:
            out.print(f"network ({net.nodes} nodes): all-reduce bus bandwidth {net.busbw_MBps:.0f} MB/s "
                      f"(slowest node), model all-reduce {net.model_allreduce_s:.3f} s, latency "
                      f"{net.latency_s * 1000:.2f} ms")
        for k, v in res.errors.items():
            out.print(f"[red]error[/red] {k}: {escape(str(v))}")
        out.print(f"saved for `clusterctl plan`: {escape(str(bench.bench_path(inv)))}")
    if res.unreachable:  # a node lost during its benchmark
        return errors.EXIT_UNREACHABLE
    return errors.EXIT_FAILED if res.errors else errors.EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from cluster.planner import plans

    inv = load_inventory(args.inventory, None, args.ssh_config)
    choice = plans.choose(inv, args.job, args.set or [], limit=args.limit)
    said = {"verdict": plans.verdict(choice), "even_kept": plans.even_kept(choice)}
    if args.json:  # the terminal's sentences too, so a script need not derive them from the candidates
        emit_json({**choice.to_dict(), **said})
        return errors.EXIT_OK
    head, rows = plans.summary_rows(choice)
    t = table(f"plan {choice.job} on {inv.name} (model: docs/planning.md)", head, overflow="fold")
    for nodes, *rest in rows:
        mark = nodes.endswith(RECOMMENDED)
        shown = escape(nodes.removesuffix(RECOMMENDED)) + (" [green](recommended)[/]" if mark else "")
        t.add_row(shown, *(escape(c) for c in rest))
    out.print(t)
    if said["verdict"]:
        out.print(escape(said["verdict"]) + " (predicted from the training start: steps and epoch ends; "
                  "docs/planning.md)")
    if said["even_kept"]:
        out.print(escape(said["even_kept"]))
    out.print(f"apply it: clusterctl launch {choice.job} --plan")
    return errors.EXIT_OK
