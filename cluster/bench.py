"""`clusterctl bench`: how fast is each node alone, and how fast is the network between them.

Compute: the job's own training program, one process on one node at a time
(so nodes never compete, as on a real lab where each PC has its own CPU/GPU),
a few steps at the job's image size, at its batch and at half of it; images/s =
batch / median step time after the first steps (warm-up); the two sizes split
a step into a fixed part and a part per sample (`fit`). Network: a real all-reduce across all the
nodes, of the model's size (bandwidth) and of 4 bytes (latency).
Results are data for `clusterctl plan`: $CLUSTERCTL_HOME/bench/<inventory>.json.
"""
from __future__ import annotations

import json
import shlex
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from cluster import datasets, jobs, launch, paths, provision
from cluster.errors import EXIT_UNREACHABLE, ClusterError
from cluster.fanout import Group
from cluster.inventory import Host, Inventory
from cluster.replies import agent_reply, error_tail

WARMUP_STEPS = 2
MODEL_BYTES = 23_528_522 * 4  # ResNet50 with 10 classes, fp32: what DDP all-reduces every step


def bench_path(inv: Inventory) -> Path:
    return paths.home() / "bench" / f"{paths.inventory_key(inv.name, inv.path)}.json"


def load(inv: Inventory) -> dict[str, Any]:
    p = bench_path(inv)
    if not p.exists():
        raise ClusterError(f"no benchmark for {inv.name} yet", f"run it first: clusterctl bench -i {inv.path}")
    return json.loads(p.read_text())


def _compute_cmd(h: Host, spec: jobs.JobSpec, data_file: str, steps: int, batch: int, out: str) -> str:
    q = shlex.quote
    args = spec.program_args(f"{h.workdir}/datasets/{data_file}", out)
    args += ["--max-steps", str(steps), "--epochs", "1", "--log-every", "1", "--resume", "no", "--batch", str(batch)]
    prog = f"{h.workdir}/clusterctl/bench/{spec.entry}"
    return (f"cd -- {q(h.workdir)} && . ./cluster.env && rm -rf -- {q(out)} && "
            f"CLUSTER_NODE_NAME={q(h.name)} \"$CLUSTER_PYTHON\" {q(prog)} {' '.join(q(a) for a in args)} "
            f">/dev/null 2>{q(out)}.err; rc=$?; cat -- {q(out)}/metrics-rank0.jsonl 2>/dev/null; "
            f"[ $rc -eq 0 ] || tail -5 -- {q(out)}.err >&2; exit $rc")


def step_rate(metrics_text: str, batch: int) -> dict[str, Any]:
    """images/s from a single-process run's step records, after the warm-up steps."""
    recs = [json.loads(x) for x in metrics_text.splitlines() if x.startswith("{")]
    steps = [r for r in recs if r.get("type") == "step"]
    times = [r["data_s"] + r["compute_s"] for r in steps[WARMUP_STEPS:]] or [r["data_s"] + r["compute_s"]
                                                                             for r in steps]
    if not times:
        raise ClusterError("the benchmark run recorded no step", "see the node's log above")
    med = statistics.median(times)
    return {"images_per_s": batch / med, "step_s": med, "steps": len(times), "batch": batch}


def fit(full: dict[str, Any], half: dict[str, Any]) -> dict[str, Any]:
    """Step time at two batch sizes -> a fixed part per step (optimizer update, framework overhead)
    plus a part per sample: step(b) = fixed_s + b * per_sample_s."""
    db = full["batch"] - half["batch"]
    per_sample = max((full["step_s"] - half["step_s"]) / db, 1e-6) if db else full["step_s"] / full["batch"]
    fixed = max(0.0, full["step_s"] - full["batch"] * per_sample)
    return {**full, "fixed_s": fixed, "per_sample_s": per_sample, "half": half}


def run(inv: Inventory, job_names: list[str], steps: int = 8, overrides: list[str] | None = None,
        parallel: bool = False, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    specs = [jobs.load(n, overrides or []) for n in job_names]
    hosts = inv.ordered(inv.hosts.values())
    result: dict[str, Any] = {"inventory": str(inv.path), "time": time.time(), "steps": steps,
                              "compute": {}, "network": None, "errors": {}, "unreachable": []}
    with Group(hosts) as group:
        targets = launch.preflight(group, hosts)
        for spec in specs:
            prepared = datasets.prepare(spec, log)
            program = launch.program_files(spec.entry)

            def stage(t):
                t.run(f"mkdir -p -- {shlex.quote(t.host.workdir + '/clusterctl/bench')}", timeout=60)
                for name, text in program.items():
                    t.put_bytes(text.encode(), f"{t.host.workdir}/clusterctl/bench/{name}")
                return datasets.stage(t, prepared)

            staged = group.call(stage)
            _require_reachable(staged, "staging the benchmark")
            launch.require(staged, "staging the benchmark")
            per_node: dict[str, Any] = {}
            order = [hosts] if parallel else [[h] for h in hosts]
            for batch_hosts in order:
                log(f"{spec.name}: {', '.join(h.name for h in batch_hosts)} alone, {steps} steps")
                rates: dict[str, list[dict[str, Any]]] = {}
                for b in (spec["batch"], max(1, spec["batch"] // 2)):  # two sizes: fixed + per-sample cost
                    res = group.run(lambda h, b=b: _compute_cmd(h, spec, prepared.file_name, steps, b,
                                                                f"{h.workdir}/clusterctl/bench/out-{spec.framework}"),
                                    timeout=1800, hosts=batch_hosts)
                    for name, r in res.items():
                        if r.ok:
                            rates.setdefault(name, []).append(step_rate(r.stdout, b))
                        else:
                            result["errors"][f"{spec.name}/{name}"] = r.error or error_tail(r.stderr, 500)
                            if r.status == "unreachable" and name not in result["unreachable"]:
                                result["unreachable"].append(name)  # the CLI exits 3, not 1
                per_node.update({n: fit(*rs) for n, rs in rates.items() if len(rs) == 2})
            result["compute"][spec.framework] = {"job": spec.name, "size": spec["dataset"]["size"],
                                                 "batch": spec["batch"], "nodes": per_node}
        result["network"] = network(group, hosts, targets[hosts[0].name].backend)
    p = bench_path(inv)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1))
    return result


def _require_reachable(results: Any, what: str) -> None:
    """A node lost on the way is unreachable (exit 3), not a failed benchmark (exit 1)."""
    lost = {n: r for n, r in results.items() if r.status == "unreachable"}
    if lost:
        raise ClusterError(f"{what}: cannot reach " + "; ".join(f"{n}: {r.error}" for n, r in lost.items()),
                           next((r.fix for r in lost.values() if r.fix), None) or "check the nodes: clusterctl check",
                           exit_code=EXIT_UNREACHABLE)


def network(group: Group, hosts: list[Host], backend: str) -> dict[str, Any] | None:
    """All-reduce over every node: bandwidth with the model's size, latency with 4 bytes."""
    if len(hosts) < 2:
        return None
    port = int(hosts[0].vars.get("allreduce_port", 29499))
    out: dict[str, Any] = {"nodes": len(hosts)}
    for what, mb in (("bandwidth", MODEL_BYTES / 2**20), ("latency", 4 / 2**20)):
        res = group.run(lambda h, mb=mb: provision.allreduce_command(h, hosts, port, backend, mb), timeout=300,
                        hosts=hosts)
        _require_reachable(res, f"the network test ({what})")
        docs = {}
        for n, r in res.items():
            doc = agent_reply(r.stdout)
            if doc is None:
                raise ClusterError(f"network test ({what}) failed on {n}: {error_tail(r.error or r.stderr)}",
                                   "check the nodes reach each other: clusterctl provision --verify")
            docs[n] = doc
        if what == "bandwidth":
            out["busbw_MBps"] = min(d["busbw_MBps"] for d in docs.values())
            out["model_allreduce_s"] = max(d["median_s"] for d in docs.values())
            out["per_node_busbw_MBps"] = {n: d["busbw_MBps"] for n, d in docs.items()}
        else:
            out["latency_s"] = max(d["median_s"] for d in docs.values())
    return out
