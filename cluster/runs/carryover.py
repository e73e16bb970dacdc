"""A run that continues another (`clusterctl launch --continue RUN`, docs/jobs.md "Continue a run").

A run that ended short of what its user wanted (one point short of a target accuracy, stopped, failed) is
taken further by a new run, not by starting again: the new run folder on each node gets what the old
one left there (the built-in programs' checkpoint, or the `outputs` a user's program declared), and the
program resumes from it as it does after a restart in the same folder. The old run stays as it was: its
record, its folders and its collected results are not touched.

The same job, settings and nodes as the old run by default (the plan's shares and scheme included);
`--set` changes any. The built-in programs resume at the epoch after the checkpoint with the schedule of a
run of `epochs` in all, so `--set epochs=E+1` after a run of E is one more epoch at the rate the longer
schedule has there, annealed to zero again; they refuse (exit 2) a continuation with nothing to train.
"""
from __future__ import annotations

import json
import shlex
from typing import Iterable

from cluster.errors import UsageError
from cluster.nodes.fanout import Group, GroupResult
from cluster.runs import jobs, records, schema
from cluster.runs.render import LaunchRequest

COPY_TIMEOUT_S = 600.0  # a local copy on the node's disk (a checkpoint of ResNet50 and its momentum: ~200 MB)


def continued(spec: jobs.JobSpec) -> records.RunRecord | None:
    """The run `spec` continues, checked: ended, on these PCs, the same job and model; None when it continues none."""
    rid = spec["continues"]
    if rid is None:
        return None
    old = records.load(rid)
    if old.state not in records.FINAL:
        raise UsageError(f"run {old.run_id} is {old.state}: a run is continued once it has ended",
                         f"wait for it (clusterctl status {old.run_id}) or stop it (clusterctl stop {old.run_id})")
    if old.scheduler != "ssh":  # this module continues runs on the PCs (the SSH scheduler's)
        raise UsageError(f"run {old.run_id} ran on {old.scheduler}: its checkpoints are there, not on the "
                         "inventory's PCs", "launch it there again with --on")
    if old.job != spec.name or old.framework != spec.framework:
        raise UsageError(f"run {old.run_id} is job {old.job} ({old.framework}), this one {spec.name} "
                         f"({spec.framework}): a run continues the same job", f"clusterctl launch --continue "
                         f"{old.run_id} (its job and settings; --set changes any)")
    _check_model(old, spec)
    return old


def _check_model(old: records.RunRecord, spec: jobs.JobSpec) -> None:
    """A built-in program resumes RUN's checkpoint into the model it builds: another model cannot load it,
    so `--set model=...` is refused here, before anything is sent, not by every rank on the nodes."""
    if spec.own:
        return  # a user's program reads what it wrote: `model` means nothing to it
    was, now = old.settings.get("model", schema.DEFAULTS["model"]), spec["model"]
    if was != now:
        raise UsageError(f"run {old.run_id} trained {was} ({old.framework}), this one would train {now}: "
                         f"{old.run_id}'s checkpoint holds {was}'s weights, which {now} cannot load",
                         f"drop --set model={now} to continue {old.run_id}, or train {now} in a new run "
                         f"(clusterctl launch without --continue)")


def spec_for(run_id: str, overrides: Iterable[str] = ()) -> jobs.JobSpec:
    """`launch --continue RUN`'s job: RUN's settings on the nodes it ended on (those that hold its
    checkpoints), `overrides` (--set) on top."""
    old = records.load(run_id)
    nodes = [n.node for n in old.nodes if n.node not in old.dropped]
    return jobs.from_run(old.spec_file, old.settings, [f"nodes={json.dumps(nodes)}", *overrides,
                                                       f"continues={old.run_id}"])


def copy_command(src_dir: str, dst_dir: str, paths: list[str]) -> str:
    """Each path that the old run folder holds, copied into the new one (metadata kept); prints each copied."""
    parts = []
    for p in paths:
        src, dst = shlex.quote(f"{src_dir}/{p}"), shlex.quote(f"{dst_dir}/{p}")
        parent = shlex.quote(f"{dst_dir}/{p}".rsplit("/", 1)[0])
        parts.append(f"if [ -e {src} ]; then mkdir -p -- {parent} && rm -rf -- {dst} && cp -a -- {src} {dst} && "
                     f"echo {shlex.quote(p)} || exit 1; fi")
    return "; ".join(parts)


def carry_over(group: Group, old: records.RunRecord, request: LaunchRequest) -> tuple[dict[str, list[str]], GroupResult | None]:
    """What each node of `request` held of `old` (only nodes that ran it can), copied into its new run
    folder: node -> the paths copied. The GroupResult where a copy failed (the caller fails the start)."""
    paths = request.job.carried_over()
    before = {n.node: n.run_dir for n in old.nodes}
    new = {n.node: n.run_dir for n in request.nodes if n.node in before}
    hosts = [t.host for t in request.targets if t.host.name in new]
    if not hosts:
        return {}, None
    res = group.run(lambda h: copy_command(before[h.name], new[h.name], paths), timeout=COPY_TIMEOUT_S, hosts=hosts)
    if not res.ok:
        return {}, res
    return {n: r.stdout.splitlines() for n, r in res.items() if r.stdout.strip()}, None
