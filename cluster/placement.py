"""Placement: which nodes a job should use and how to split its global batch among them, predicted
from `bench` (docs/planning.md). Users reach it as `clusterctl plan JOB` and `launch --plan`.

Model, per synchronous step on node set S with per-node batches b_i:
    compute_i = f_i + b_i * c_i       node i alone (bench at two batch sizes): fixed + per-sample time
    comm      = the model's all-reduce as measured by bench, scaled by the ring's 2(|S|-1)/|S|
    step      = max_i compute_i + comm            the slowest node sets the pace; no overlap assumed
    images/s  = B / step,   epoch time = (train samples / B) * step
The even split gives every node `batch`; the balanced split solves f_i + b_i c_i = T, sum b_i = B.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster import bench, jobs, launch, paths
from cluster.bench import NetworkBench, NodeBench
from cluster.errors import ClusterError, UsageError
from cluster.inventory import Inventory


@dataclass(frozen=True)
class NodeSpeed:
    """step(b) = fixed_s + b * per_sample_s, from `bench` (two batch sizes)."""

    fixed_s: float
    per_sample_s: float

    def step(self, b: int) -> float:
        return self.fixed_s + b * self.per_sample_s

    @classmethod
    def from_bench(cls, r: NodeBench) -> NodeSpeed:
        if r.per_sample_s is not None:
            return cls(r.fixed_s or 0.0, r.per_sample_s)
        return cls(0.0, 1.0 / r.images_per_s)  # a benchmark from before the two-size fit

    def to_dict(self) -> dict[str, float]:
        return {"fixed_s": self.fixed_s, "per_sample_s": self.per_sample_s}


@dataclass
class Placement:
    """One candidate: a node set, its batch shares and what the model predicts for it."""

    nodes: list[str]
    global_batch: int
    shares: dict[str, int]
    even_images_per_s: float
    planned_images_per_s: float
    step_s: float
    comm_s: float
    epoch_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "global_batch": self.global_batch, "shares": dict(self.shares),
                "even_images_per_s": self.even_images_per_s, "planned_images_per_s": self.planned_images_per_s,
                "step_s": self.step_s, "comm_s": self.comm_s, "epoch_s": self.epoch_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        return cls([str(n) for n in d["nodes"]], int(d["global_batch"]),
                   {str(n): int(b) for n, b in d["shares"].items()}, float(d["even_images_per_s"]),
                   float(d["planned_images_per_s"]), float(d["step_s"]), float(d["comm_s"]),
                   None if d.get("epoch_s") is None else float(d["epoch_s"]))


@dataclass
class PlacementChoice:
    """`clusterctl plan`'s document: every candidate and the recommended one (saved; `--json` prints it)."""

    job: str
    framework: str
    inventory: str
    time: float
    bench_time: float
    speeds: dict[str, NodeSpeed]
    network: NetworkBench | None
    batch: int
    candidates: list[Placement]
    recommended: Placement

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "framework": self.framework, "inventory": self.inventory, "time": self.time,
                "bench_time": self.bench_time, "speeds": {n: s.to_dict() for n, s in self.speeds.items()},
                "network": self.network.to_dict() if self.network else None, "batch": self.batch,
                "candidates": [c.to_dict() for c in self.candidates], "recommended": self.recommended.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlacementChoice:
        return cls(str(d["job"]), str(d["framework"]), str(d["inventory"]), float(d["time"]),
                   float(d["bench_time"]),
                   {str(n): NodeSpeed(float(s["fixed_s"]), float(s["per_sample_s"])) for n, s in d["speeds"].items()},
                   NetworkBench.from_dict(d["network"]) if d.get("network") else None, int(d["batch"]),
                   [Placement.from_dict(c) for c in d["candidates"]], Placement.from_dict(d["recommended"]))


# --------------------------------------------------------------------------- the model


def _round(total: int, raw: dict[str, float]) -> dict[str, int]:
    """Whole numbers summing to total (largest remainder), at least 1 each."""
    out = {n: max(1, int(x)) for n, x in raw.items()}
    for n in sorted(raw, key=lambda n: raw[n] - int(raw[n]), reverse=True):
        if sum(out.values()) >= total:
            break
        out[n] += 1
    while sum(out.values()) > total:  # the minimum of 1 may overshoot on very slow nodes
        n = max(out, key=lambda k: out[k])
        out[n] -= 1
    return out


def balance(total: int, speeds: dict[str, NodeSpeed]) -> dict[str, int]:
    """Shares that make every node finish its part at the same time T:
    fixed_i + b_i * per_sample_i = T with sum(b_i) = total."""
    inv = {n: 1.0 / s.per_sample_s for n, s in speeds.items()}
    t = (total + sum(s.fixed_s * inv[n] for n, s in speeds.items())) / sum(inv.values())
    raw = {n: max(0.5, (t - s.fixed_s) * inv[n]) for n, s in speeds.items()}
    scale = total / sum(raw.values())
    return _round(total, {n: x * scale for n, x in raw.items()})


def comm_time(network: NetworkBench | None, world: int) -> float:
    """The model's all-reduce as measured across the bench's nodes, scaled to `world` ranks by the
    ring's 2(W-1)/W volume; latency added once."""
    if world < 2 or not network:
        return 0.0
    w0 = network.nodes
    volume = (2 * (world - 1) / world) / (2 * (w0 - 1) / w0)
    return network.latency_s + max(0.0, network.model_allreduce_s - network.latency_s) * volume


def step_time(shares: dict[str, int], speeds: dict[str, NodeSpeed],
              network: NetworkBench | None) -> tuple[float, float]:
    """(step time, of which communication) for these shares: the slowest node plus the all-reduce."""
    comm = comm_time(network, len(shares))
    return max(speeds[n].step(b) for n, b in shares.items()) + comm, comm


def candidates(speeds: dict[str, NodeSpeed], batch: int, network: NetworkBench | None,
               train_samples: int | None = None) -> list[Placement]:
    """The k fastest nodes for k = 1..N, each with the job's global batch for k nodes (batch x k)."""
    ranked = sorted(speeds, key=lambda n: speeds[n].step(batch))
    out = []
    for k in range(1, len(ranked) + 1):
        chosen = ranked[:k]
        sp = {n: speeds[n] for n in chosen}
        total = batch * k
        even = {n: batch for n in chosen}
        planned = balance(total, sp)
        t_even, _ = step_time(even, sp, network)
        t_plan, comm = step_time(planned, sp, network)
        out.append(Placement(chosen, total, planned, total / t_even, total / t_plan, t_plan, comm,
                             (train_samples // total) * t_plan if train_samples else None))
    return out


def summary_rows(choice: PlacementChoice) -> tuple[list[str], list[list[str]]]:
    """`clusterctl plan`'s table (header, rows of strings): one row per candidate; the recommended one's
    nodes cell ends with " (recommended)"."""
    header = ["nodes", "global batch", "even split img/s", "planned split img/s", "step s", "all-reduce s",
              "epoch s", "shares"]
    rows = []
    for c in choice.candidates:
        mark = " (recommended)" if c.nodes == choice.recommended.nodes else ""
        rows.append([",".join(c.nodes) + mark, str(c.global_batch), f"{c.even_images_per_s:.1f}",
                     f"{c.planned_images_per_s:.1f}", f"{c.step_s:.3f}", f"{c.comm_s:.3f}",
                     f"{c.epoch_s:.0f}" if c.epoch_s else "-", ", ".join(f"{n}={b}" for n, b in c.shares.items())])
    return header, rows


# --------------------------------------------------------------------------- for a job on an inventory


def _job_bench(inv: Inventory, spec: jobs.JobSpec, job: str) -> tuple[bench.BenchResult, bench.FrameworkBench]:
    """The inventory's benchmark, checked to fit the job (framework, batch, image size)."""
    b = bench.load(inv)
    comp = b.compute.get(spec.framework)
    if not comp or not comp.nodes:
        raise ClusterError(f"the benchmark of {inv.name} has no {spec.framework} figures",
                           f"clusterctl bench -i {inv.path} --jobs {job}")
    if comp.batch != spec["batch"] or comp.size != spec["dataset"]["size"]:
        raise ClusterError(f"the benchmark ran batch {comp.batch} at {comp.size} px, the job uses "
                           f"batch {spec['batch']} at {spec['dataset']['size']} px",
                           f"re-run clusterctl bench with the job's settings (--set batch={spec['batch']})")
    return b, comp


def choose(inv: Inventory, job: str, overrides: list[str] | None = None) -> PlacementChoice:
    """Every candidate node set for the job, the best one recommended; saved for `launch --plan`."""
    spec = jobs.load(job, overrides or [])
    b, comp = _job_bench(inv, spec, job)
    allowed = {h.name for h in launch.select_hosts(inv, spec, None)}
    speeds = {n: NodeSpeed.from_bench(r) for n, r in comp.nodes.items() if n in allowed}
    cands = candidates(speeds, spec["batch"], b.network, _train_samples(spec))
    best = max(cands, key=lambda c: c.planned_images_per_s)
    choice = PlacementChoice(spec.name, spec.framework, str(inv.path), time.time(), b.time, speeds, b.network,
                             spec["batch"], cands, best)
    p = choice_path(inv, spec.name)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(choice.to_dict(), indent=1))
    return choice


def _train_samples(spec: jobs.JobSpec) -> int | None:
    from cluster import datasets

    try:
        from cluster.workloads import wldata

        prepared = datasets.prepare(spec)
        return len(wldata.open_prepared(prepared.path).y_train)
    except (ClusterError, OSError, ValueError):
        return None


def choice_path(inv: Inventory, job: str) -> Path:
    """Where `clusterctl plan` saves its document (the folder keeps the command's name)."""
    return paths.home() / "plans" / f"{paths.inventory_key(inv.name, inv.path)}-{job}.json"


def load_recommended(inv: Inventory, job: str) -> Placement:
    p = choice_path(inv, job)
    if not p.exists():
        raise ClusterError(f"no plan for {job} on {inv.name}", f"make one: clusterctl plan {job} -i {inv.path}")
    try:
        return Placement.from_dict(json.loads(p.read_text())["recommended"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{p}: not a plan clusterctl can read ({type(e).__name__}: {e})",
                         f"make it again: clusterctl plan {job} -i {inv.path}") from None


def overrides_for(inv: Inventory, job: str) -> list[str]:
    """`launch --plan`: the recommended nodes and their shares, as job settings."""
    rec = load_recommended(inv, job)
    return [f"nodes=[{', '.join(rec.nodes)}]"] + [f"shares.{n}={b}" for n, b in rec.shares.items()]
