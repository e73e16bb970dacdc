"""Before a launch: which of the inventory's hosts the job runs on, whether each has the verified environment
(the same on all, with the framework the job's launcher starts), and whether another run still uses them."""
from __future__ import annotations

import json
import shlex
from typing import Any

from cluster import errors
from cluster.errors import ClusterError, UsageError
from cluster.inventory import context
from cluster.inventory.model import Host, Inventory
from cluster.nodes.fanout import Group, GroupResult
from cluster.provision import verify
from cluster.runs import records as runs, render
from cluster.runs.jobs import JobSpec
from cluster.runs.schema import JobError
from cluster.runs.state import refresh
from cluster.transport import Transport


class LaunchRefused(ClusterError):
    """The nodes are not ready for this job (not provisioned, environments differ, busy)."""


def select_hosts(inv: Inventory, spec: JobSpec, limit: str | None) -> list[Host]:
    nodes = spec["nodes"]
    chosen = inv.select(None if nodes == "all" else ",".join(nodes) if isinstance(nodes, list) else nodes)
    if limit:
        allowed = {h.name for h in inv.select(limit)}
        chosen = [h for h in chosen if h.name in allowed]
    if not chosen and limit:
        raise UsageError(f"job {spec.name}: --limit {limit!r} leaves none of the job's nodes (nodes={nodes!r})",
                         "name hosts or groups that the job's `nodes:` includes")
    if not chosen:
        raise UsageError(f"job {spec.name}: nodes={nodes!r} selects no host of the inventory",
                         "set the job's `nodes:` to all, a group or host names of the inventory")
    clash = sorted(h.name for h in chosen if h.name in runs.RUN_FOLDER_ENTRIES)
    if clash:  # each node's results go to runs/<id>/<node>/ beside these
        raise UsageError(f"host name {clash[0]!r} is the name of a file clusterctl keeps in each run folder",
                         f"rename the host in the inventory (reserved: {', '.join(sorted(runs.RUN_FOLDER_ENTRIES))})")
    return inv.ordered(chosen)


def check(group: Group, hosts: list[Host], spec: JobSpec | None = None,
          left_out: dict[str, str] | None = None, embedded: bool = False) -> dict[str, render.Target]:
    """Each node's verified environment (its provision state.json); refuse unless all exist and match, and
    (with `spec`) unless that environment has the framework the job's launcher starts.
    `left_out`: where the job's `min_nodes` lets it start without the nodes that do not answer, they are put
    there (node -> why) and left out of the targets; otherwise one unreachable node refuses the start.
    `embedded`: the hosts are the embedded local inventory's, used because no inventory was named."""

    def read(t: Transport) -> dict[str, Any] | None:
        q = shlex.quote(t.host.workdir)
        r = t.run(f"cat -- {q}/clusterctl/state.json && test -f {q}/cluster.env", timeout=60)
        return json.loads(r.stdout) if r.exit_code == 0 and r.stdout.strip() else None

    results = group.call(read, hosts)
    unreachable = {n: r for n, r in results.items() if not r.ok and r.status == "unreachable"}
    need = (spec["min_nodes"] or len(hosts)) if spec is not None else len(hosts)
    if unreachable and (left_out is None or len(hosts) - len(unreachable) < need):
        short = (f" (min_nodes {need}: {len(hosts) - len(unreachable)} of {len(hosts)} answer)"
                 if spec is not None and spec["min_nodes"] else "")
        raise LaunchRefused("cannot reach " + "; ".join(f"{n}: {r.error}" for n, r in unreachable.items()) + short,
                            next((r.fix for r in unreachable.values() if r.fix), None)
                            or "check the nodes with `clusterctl check`", exit_code=errors.EXIT_UNREACHABLE)
    if unreachable and left_out is not None:
        left_out.update({n: f"unreachable: {r.error}" for n, r in unreachable.items()})
        hosts = [h for h in hosts if h.name not in unreachable]
        results = GroupResult((n, r) for n, r in results.items() if n not in unreachable)
    missing = [n for n, r in results.items() if not r.ok or not r.value]
    if missing and embedded:  # a student's first launch, before anyone told clusterctl where the room is
        raise LaunchRefused("no inventory given and no current context: the embedded inventory (this machine "
                            "alone) is not provisioned", f"use the room's inventory (ask the lab's admin for it): "
                            f"`clusterctl context ROOM.yaml` once, or `-i ROOM.yaml`, or `export {context.ENV}="
                            "ROOM.yaml`; to train on this machine alone, run `clusterctl provision` first",
                            exit_code=errors.EXIT_USAGE)
    if missing:
        raise LaunchRefused(f"not provisioned (no verified environment): {', '.join(missing)}",
                            "run `clusterctl provision` for these nodes first")
    states = {n: r.value for n, r in results.items()}
    fps = {n: s.get("fingerprint") or {} for n, s in states.items()}
    gpu_nodes = {n for n, s in states.items() if (s.get("build") or {}).get("gpu")}
    diff, _ = verify.fingerprint_diff(fps, gpu_nodes)
    if diff:
        raise LaunchRefused("the nodes' environments differ: " + "; ".join(diff),
                            "run `clusterctl provision` so every node gets the same builds")
    need = {"torchrun": "torch", "tensorflow": "tensorflow"}.get(spec.launcher if spec else "", "")
    lacking = sorted(n for n, fp in fps.items() if need and not fp.get(need))
    if spec is not None and lacking:
        raise JobError(str(spec.path), None, "launcher", f"{spec.launcher} needs {need}, which the provisioned "
                       f"environment of {', '.join(lacking)} does not have",
                       f"provision {need} on those nodes, or choose another launcher (plain starts any program)")
    targets = {}
    for h in hosts:
        s = states[h.name]
        gpus = len(s["fingerprint"].get("gpus") or []) if s["fingerprint"].get("cuda_available") else 0
        chosen = render.visible_devices(h)
        if chosen is not None:
            beyond = [d for d in chosen if d.isdigit() and int(d) >= gpus]
            if beyond:
                raise LaunchRefused(f"{h.name}: cuda_visible_devices names GPU {', '.join(beyond)}, but the node's "
                                    f"verified environment sees {gpus} GPU(s)",
                                    "list indices from `nvidia-smi -L` on that node, or leave the var out")
            gpus = len(chosen) if gpus else 0
        targets[h.name] = render.Target(h, gpus, (s.get("build") or {}).get("backend") or "gloo")
    return targets


def refuse_busy(hosts: list[Host]) -> None:
    """Refuse to start on nodes another run still uses (after asking the nodes, not trusting the record),
    or where an earlier stop could not be confirmed. Called under runs.launch_lock()."""
    mine = {(h.address, h.port): h.name for h in hosts}  # the same machines, whatever they are called
    records, damaged = runs.scan()
    if damaged:
        raise LaunchRefused(f"cannot tell whether the nodes are free: {damaged[0].message}", damaged[0].fix)
    for rec in records:
        if not rec.active and not rec.stop_pending:
            continue
        shared = {mine[(h.address, h.port)] for h in rec.hosts() if (h.address, h.port) in mine}
        if not shared:
            continue
        rec = refresh(rec)
        pending = shared & set(rec.stop_pending)
        if rec.active:
            raise LaunchRefused(f"run {rec.run_id} is still {rec.state} on {', '.join(sorted(shared))}",
                                f"wait for it, or stop it: clusterctl stop {rec.run_id}")
        if pending:
            raise LaunchRefused(f"run {rec.run_id} could not be stopped on {', '.join(sorted(pending))} "
                                "(unreachable): its processes may still be running there",
                                f"bring the node back and run `clusterctl stop {rec.run_id}`",
                                exit_code=errors.EXIT_UNREACHABLE)
