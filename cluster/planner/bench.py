"""`clusterctl bench`: how fast is each node alone, and how fast is the network between them.

Compute: the job's own training program, one process on one node at a time
(so nodes never compete, as on a real lab where each PC has its own CPU/GPU),
a few steps at the job's image size, at its batch and at half of it; images/s =
batch / mean step time after the first steps (warm-up); the two sizes split
a step into a fixed part and a part per sample (`fit`). Network: a real all-reduce across all the
nodes, of the model's size (bandwidth) and of 4 bytes (latency).
Results are data for `clusterctl plan`: $CLUSTERCTL_HOME/bench/<inventory>.json.
"""
from __future__ import annotations

import functools
import json
import math
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster import paths
from cluster.bounds import read_regular
from cluster.planner import commmodel
from cluster.runs import datasets, jobs, launch, payload, preflight
from cluster.provision import apply
from cluster.errors import EXIT_UNREACHABLE, ClusterError, UsageError
from cluster.nodes.fanout import Group, GroupResult
from cluster.inventory.model import Host, Inventory
from cluster.nodes.replies import agent_reply, error_tail
from cluster.transport import Transport

WARMUP_STEPS = 2
MODEL_BYTES = 23_528_522 * 4  # ResNet50 with 10 classes, fp32: what DDP all-reduces every step


# --------------------------------------------------------------------------- results (the saved JSON)


@dataclass
class StepRate:
    """One process alone at one batch size: the mean step time after the warm-up steps."""

    images_per_s: float
    step_s: float
    steps: int
    batch: int

    def to_dict(self) -> dict[str, Any]:
        return {"images_per_s": self.images_per_s, "step_s": self.step_s, "steps": self.steps, "batch": self.batch}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRate:
        return cls(float(d["images_per_s"]), float(d["step_s"]), int(d["steps"]), int(d["batch"]))


@dataclass
class NodeBench(StepRate):
    """A node's rate at the job's batch and, fitted with half of it, step(b) = fixed_s + b * per_sample_s;
    powersgd_s, what PowerSGD's compute adds to a step at the job's batch (one process: DDP with the hook,
    TensorFlow's loop with tfcomm's; their all-reduces of one move nothing). Files from before the fit have no
    fixed_s, per_sample_s or half: they still load."""

    fixed_s: float | None = None
    per_sample_s: float | None = None
    half: StepRate | None = None
    powersgd_s: float | None = None
    # an epoch's end, from the same run (EpochCosts): seconds per image scored and the checkpoint's save
    eval_image_s: float | None = None
    save_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if self.per_sample_s is not None:
            d.update(fixed_s=self.fixed_s, per_sample_s=self.per_sample_s,
                     half=self.half.to_dict() if self.half else None)
        if self.powersgd_s is not None:
            d["powersgd_s"] = self.powersgd_s
        if self.eval_image_s is not None:
            d.update(eval_image_s=self.eval_image_s, save_s=self.save_s)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeBench:
        rate = StepRate.from_dict(d)
        if d.get("per_sample_s") is None:
            return cls(**rate.__dict__)
        return cls(**rate.__dict__, fixed_s=float(d.get("fixed_s") or 0.0), per_sample_s=float(d["per_sample_s"]),
                   half=StepRate.from_dict(d["half"]) if d.get("half") else None,
                   powersgd_s=float(d["powersgd_s"]) if d.get("powersgd_s") is not None else None,
                   eval_image_s=_opt_float(d.get("eval_image_s")), save_s=_opt_float(d.get("save_s")))


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


@dataclass(frozen=True)
class EpochCosts:
    """What an epoch costs beyond its steps, from a single-process run's records: the evaluation (the
    training loss's sum, the validation split and the training-accuracy sample: the epoch record's time less
    the last step's) over the images it scored, and the checkpoint (the end record's time less the epoch
    record's: both programs save after the epoch record). `plan` adds both to every epoch it prices
    (docs/planning.md)."""

    eval_s: float
    eval_images: int
    save_s: float

    @classmethod
    def from_records(cls, metrics_text: str) -> EpochCosts | None:
        """None where the run wrote no epoch or end record (killed, or an old program)."""
        from cluster.programs import wlcommon

        kinds: dict[str, list[dict[str, Any]]] = {}
        for r in (json.loads(x) for x in metrics_text.splitlines() if x.startswith("{")):
            kinds.setdefault(str(r.get("type")), []).append(r)
        if not all(kinds.get(k) for k in ("start", "step", "epoch", "end")) or "val_samples" not in kinds["start"][0]:
            return None
        start, steps, epoch, end = kinds["start"][0], kinds["step"], kinds["epoch"][0], kinds["end"][0]
        images = wlcommon.eval_images(int(start["train_samples"]), int(start["val_samples"]), 1,
                                      int(start.get("bn_recompute") or 0))
        return cls(max(0.0, float(epoch["time"]) - float(steps[-1]["time"])), images,
                   max(0.0, float(end["time"]) - float(epoch["time"])))


@dataclass
class FrameworkBench:
    """Every node alone with one job's training program, at the job's image size and batch."""

    job: str
    size: int
    batch: int
    nodes: dict[str, NodeBench] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "size": self.size, "batch": self.batch,
                "nodes": {n: r.to_dict() for n, r in self.nodes.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FrameworkBench:
        return cls(str(d["job"]), int(d["size"]), int(d["batch"]),
                   {str(n): NodeBench.from_dict(r) for n, r in d["nodes"].items()})


@dataclass
class NetworkBench:
    """A real all-reduce across `nodes` nodes: of the model's size (bandwidth) and of 4 bytes (latency).
    `payload_bytes` is what the bandwidth test all-reduced (files from before it: ResNet50's 94 MB)."""

    nodes: int
    busbw_MBps: float
    model_allreduce_s: float
    per_node_busbw_MBps: dict[str, float]
    latency_s: float
    payload_bytes: int = MODEL_BYTES

    @property
    def per_byte_s(self) -> float:
        """Seconds per byte a rank sends: the bandwidth test's time less one latency, over the ring's
        2(W-1)/W of its payload (what each rank sends, and receives, in a ring all-reduce)."""
        sent = self.payload_bytes * 2 * (self.nodes - 1) / self.nodes
        return max(0.0, self.model_allreduce_s - self.latency_s) / sent

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"nodes": self.nodes, "busbw_MBps": self.busbw_MBps,
                             "model_allreduce_s": self.model_allreduce_s,
                             "per_node_busbw_MBps": dict(self.per_node_busbw_MBps), "latency_s": self.latency_s}
        if self.payload_bytes != MODEL_BYTES:
            d["payload_bytes"] = self.payload_bytes
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NetworkBench:
        return cls(int(d["nodes"]), float(d["busbw_MBps"]), float(d["model_allreduce_s"]),
                   {str(n): float(v) for n, v in d["per_node_busbw_MBps"].items()}, float(d["latency_s"]),
                   int(d.get("payload_bytes") or MODEL_BYTES))


@dataclass
class BenchResult:
    """What `clusterctl bench` measured, saved for `clusterctl plan` (the file keeps this JSON layout)."""

    inventory: str
    time: float
    steps: int
    compute: dict[str, FrameworkBench] = field(default_factory=dict)  # framework -> its figures
    network: NetworkBench | None = None
    errors: dict[str, str] = field(default_factory=dict)  # "job/node" -> why that node has no figure
    unreachable: list[str] = field(default_factory=list)  # nodes lost during the benchmark: exit 3, not 1

    def to_dict(self) -> dict[str, Any]:
        return {"inventory": self.inventory, "time": self.time, "steps": self.steps,
                "compute": {fw: c.to_dict() for fw, c in self.compute.items()},
                "network": self.network.to_dict() if self.network else None,
                "errors": dict(self.errors), "unreachable": list(self.unreachable)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        return cls(str(d["inventory"]), float(d["time"]), int(d["steps"]),
                   {str(fw): FrameworkBench.from_dict(c) for fw, c in d["compute"].items()},
                   NetworkBench.from_dict(d["network"]) if d.get("network") else None,
                   {str(k): str(v) for k, v in (d.get("errors") or {}).items()},
                   [str(n) for n in d.get("unreachable") or []])


def summary_rows(result: BenchResult, nodes: list[str] | None = None) -> tuple[list[str], list[list[str]]]:
    """`clusterctl bench`'s table (header, rows of strings): each node alone, per framework.
    `nodes` gives the row order (the inventory's); by default every node the result names."""
    header = ["node"]
    for fw in result.compute:
        header += [f"{fw} images/s", f"{fw} step s"]
    if nodes is None:
        named = [n for c in result.compute.values() for n in c.nodes]
        named += [k.split("/", 1)[-1] for k in result.errors] + list(result.unreachable)
        nodes = list(dict.fromkeys(named))
    rows = []
    for n in nodes:
        cells = [n]
        for c in result.compute.values():
            r = c.nodes.get(n)
            cells += [f"{r.images_per_s:.1f}", f"{r.step_s:.3f}"] if r else ["-", "-"]
        rows.append(cells)
    return header, rows


def bench_path(inv: Inventory) -> Path:
    return paths.home() / "bench" / f"{paths.inventory_key(inv.name, inv.path)}.json"


def load(inv: Inventory) -> BenchResult:
    p = bench_path(inv)
    if not p.exists():
        raise ClusterError(f"no benchmark for {inv.name} yet", f"run it first: clusterctl bench -i {inv.path}")
    try:
        return BenchResult.from_dict(json.loads(read_regular(p, f"remove {p} and run it again: clusterctl bench -i "
                                                                f"{inv.path}", noun="a benchmark record")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{p}: not a benchmark clusterctl can read ({type(e).__name__}: {e})",
                         f"run it again: clusterctl bench -i {inv.path}") from None


# --------------------------------------------------------------------------- compute: each node alone


# bench's PowerSGD run, one process, every counted step compressing: PyTorch (DDP with the hook) from the
# third step (the first two are warm-up, not counted; from the first, its first two would go without memory);
# TensorFlow from the first (its PowerSGD step is a tf.function of its own, traced at the first step it runs:
# started at the third, the tracing fell in the counted steps and bench read 1.2 s of PowerSGD a step)
POWERSGD_START = {"pytorch": WARMUP_STEPS, "tensorflow": 1}


def _compute_cmd(h: Host, spec: jobs.JobSpec, data_file: str, steps: int, batch: int, out: str,
                 powersgd: bool = False) -> str:
    q = shlex.quote
    args = spec.program_args(f"{h.workdir}/datasets/{data_file}", out)
    args += ["--max-steps", str(steps), "--epochs", "1", "--log-every", "1", "--resume", "no", "--batch", str(batch)]
    if powersgd:
        args += ["--grad-compression", "powersgd", "--powersgd-start-step", str(POWERSGD_START[spec.framework])]
    prog = f"{h.workdir}/clusterctl/bench/{spec.entry}"
    alone = "CLUSTER_DDP_ALONE=1 " if powersgd else ""
    return (f"cd -- {q(h.workdir)} && . ./cluster.env && rm -rf -- {q(out)} && "
            f"{alone}CLUSTER_NODE_NAME={q(h.name)} \"$CLUSTER_PYTHON\" {q(prog)} {' '.join(q(a) for a in args)} "
            f">/dev/null 2>{q(out)}.err; rc=$?; cat -- {q(out)}/metrics-rank0.jsonl 2>/dev/null; "
            f"[ $rc -eq 0 ] || tail -5 -- {q(out)}.err >&2; exit $rc")


def _node_cmd(h: Host, spec: jobs.JobSpec, data_file: str, steps: int, batch: int, powersgd: bool = False) -> str:
    return _compute_cmd(h, spec, data_file, steps, batch, f"{h.workdir}/clusterctl/bench/out-{spec.framework}",
                        powersgd)


def step_rate(metrics_text: str, batch: int) -> StepRate:
    """images/s from a single-process run's step records, after the warm-up steps: batch / the mean step
    time, what an epoch of such steps delivers. Not the median: on a node whose CPU time is rationed (a
    cgroup quota, as in the lab; a busy PC) step times are lopsided, most short and some held back a whole
    quota period, so the median of a few steps overstates what a run delivers (docs/performance.md)."""
    recs = [json.loads(x) for x in metrics_text.splitlines() if x.startswith("{")]
    steps = [r for r in recs if r.get("type") == "step"]
    times = [r["data_s"] + r["compute_s"] for r in steps[WARMUP_STEPS:]] or [r["data_s"] + r["compute_s"]
                                                                             for r in steps]
    if not times:
        raise ClusterError("the benchmark run recorded no step", "see the node's log above")
    mean = statistics.fmean(times)
    return StepRate(batch / mean, mean, len(times), batch)


def fit(full: StepRate, half: StepRate, powersgd: StepRate | None = None,
        costs: EpochCosts | None = None) -> NodeBench:
    """Step time at two batch sizes -> a fixed part per step (optimizer update, framework overhead)
    plus a part per sample: step(b) = fixed_s + b * per_sample_s; what PowerSGD adds to the
    full batch's step (never negative: noise); and an epoch's evaluation per image and checkpoint."""
    db = full.batch - half.batch
    per_sample = max((full.step_s - half.step_s) / db, 1e-6) if db else full.step_s / full.batch
    fixed = max(0.0, full.step_s - full.batch * per_sample)
    extra = max(0.0, powersgd.step_s - full.step_s) if powersgd else None
    return NodeBench(**full.__dict__, fixed_s=fixed, per_sample_s=per_sample, half=half, powersgd_s=extra,
                     eval_image_s=costs.eval_s / max(1, costs.eval_images) if costs else None,
                     save_s=costs.save_s if costs else None)


def _stage(group: Group, spec: jobs.JobSpec, prepared: datasets.Prepared) -> None:
    """The job's program and its dataset on every node, under <workdir>/clusterctl/bench."""
    tree = payload.program_tree(spec)  # the built-in program bench times, as launch ships it
    program = {name: (tree.root / name).read_text() for name in tree.files}

    def stage(t: Transport) -> Any:
        t.run(f"mkdir -p -- {shlex.quote(t.host.workdir + '/clusterctl/bench')}", timeout=60)
        for name, text in program.items():
            t.put_bytes(text.encode(), f"{t.host.workdir}/clusterctl/bench/{name}")
        return datasets.stage(t, prepared)

    staged = group.call(stage)
    _require_reachable(staged, "staging the benchmark")
    launch.require(staged, "staging the benchmark")


def _compute(group: Group, hosts: list[Host], spec: jobs.JobSpec, data_file: str, steps: int, parallel: bool,
             result: BenchResult, log: Callable[[str], None]) -> FrameworkBench:
    """Each node alone (or all at once with `parallel`) at the job's batch and half of it."""
    fb = FrameworkBench(spec.name, spec["dataset"]["size"], spec["batch"])
    for batch_hosts in ([hosts] if parallel else [[h] for h in hosts]):
        log(f"{spec.name}: {', '.join(h.name for h in batch_hosts)} alone, {steps} steps")
        rates: dict[str, list[StepRate]] = {}
        costs: dict[str, EpochCosts | None] = {}  # the first run's epoch end (evaluation, checkpoint)
        # two sizes (fixed + per-sample cost); the job's batch again with PowerSGD (its own compute)
        runs = [(spec["batch"], False), (max(1, spec["batch"] // 2), False), (spec["batch"], True)]
        for b, psgd in runs:
            res = group.run(functools.partial(_node_cmd, spec=spec, data_file=data_file, steps=steps, batch=b,
                                              powersgd=psgd), timeout=1800, hosts=batch_hosts)
            for name, r in res.items():
                if r.ok:
                    rates.setdefault(name, []).append(step_rate(r.stdout, b))
                    costs.setdefault(name, EpochCosts.from_records(r.stdout))
                    continue
                result.errors[f"{spec.name}/{name}"] = r.error or error_tail(r.stderr, 500)
                if r.status == "unreachable" and name not in result.unreachable:
                    result.unreachable.append(name)  # the CLI exits 3, not 1
        fb.nodes.update({n: fit(rs[0], rs[1], rs[2] if len(rs) > 2 else None, costs.get(n))
                         for n, rs in rates.items() if len(rs) == len(runs)})
    return fb


def run(inv: Inventory, job_names: list[str], steps: int = 8, overrides: list[str] | None = None,
        parallel: bool = False, log: Callable[[str], None] = lambda s: None, limit: str | None = None,
        forks: int = 32) -> BenchResult:
    """Every job's program on each node alone, then the network; saved for `clusterctl plan`.

    `limit` (a host pattern) benchmarks those nodes only: the result saved is theirs, so `plan` chooses among
    them; `forks` bounds the nodes contacted at once."""
    specs = [jobs.load(n, overrides or []) for n in job_names]
    hosts = inv.ordered(inv.select(limit))
    result = BenchResult(str(inv.path), time.time(), steps)
    with Group(hosts, forks=forks) as group:
        targets = preflight.check(group, hosts)
        for spec in specs:
            prepared = datasets.prepare(spec, log)
            _stage(group, spec, prepared)
            result.compute[spec.framework] = _compute(group, hosts, spec, prepared.file_name, steps, parallel,
                                                      result, log)
        result.network = network(group, hosts, targets[hosts[0].name].backend, _payload(specs))
    p = bench_path(inv)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result.to_dict(), indent=1))
    return result


def _require_reachable(results: GroupResult, what: str) -> None:
    """A node lost on the way is unreachable (exit 3), not a failed benchmark (exit 1)."""
    lost = {n: r for n, r in results.items() if r.status == "unreachable"}
    if lost:
        raise ClusterError(f"{what}: cannot reach " + "; ".join(f"{n}: {r.error}" for n, r in lost.items()),
                           next((r.fix for r in lost.values() if r.fix), None) or "check the nodes: clusterctl check",
                           exit_code=EXIT_UNREACHABLE)


# --------------------------------------------------------------------------- network: all nodes at once


def _allreduce(group: Group, hosts: list[Host], backend: str, what: str, mb: float) -> dict[str, dict[str, Any]]:
    """Every node's reply to one all-reduce test (cluster/programs/allreduce.py)."""
    port = int(hosts[0].vars.get("allreduce_port", 29499))
    res = group.run(lambda h: apply.allreduce_command(h, hosts, port, backend, mb), timeout=300, hosts=hosts)
    _require_reachable(res, f"the network test ({what})")
    docs = {}
    for n, r in res.items():
        doc = agent_reply(r.stdout)
        if doc is None:
            raise ClusterError(f"network test ({what}) failed on {n}: {error_tail(r.error or r.stderr)}",
                               "check the nodes reach each other: clusterctl provision --verify")
        docs[n] = doc
    return docs


def _payload(specs: list[jobs.JobSpec]) -> int:
    """The largest of the jobs' gradients in float32 (what plain DDP all-reduces per step)."""
    sizes = [MODEL_BYTES]
    for spec in specs:
        shapes, *_ = commmodel.job_model(spec)
        sizes.append(4 * sum(math.prod(s) for s in shapes) if shapes else MODEL_BYTES)
    return max(sizes[1:] or sizes)


def network(group: Group, hosts: list[Host], backend: str, payload: int = MODEL_BYTES) -> NetworkBench | None:
    """All-reduce over every node: bandwidth with the model's gradients (`payload` bytes), latency with 4."""
    if len(hosts) < 2:
        return None
    bw = _allreduce(group, hosts, backend, "bandwidth", payload / 2**20)
    lat = _allreduce(group, hosts, backend, "latency", 4 / 2**20)
    return NetworkBench(nodes=len(hosts), busbw_MBps=min(d["busbw_MBps"] for d in bw.values()),
                        model_allreduce_s=max(d["median_s"] for d in bw.values()),
                        per_node_busbw_MBps={n: d["busbw_MBps"] for n, d in bw.items()},
                        latency_s=max(d["median_s"] for d in lat.values()),
                        payload_bytes=int(next(iter(bw.values())).get("bytes", payload)))
