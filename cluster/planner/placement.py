"""Placement: which nodes a job should use, how to split its global batch among them and how its
gradients cross the network, predicted from `bench` (docs/planning.md). Users reach it as
`clusterctl plan JOB` and `launch --plan`.

Model, per optimizer step on node set S with per-node micro-batches b_i and a scheme
(grad_compression x powersgd_rank x accumulate k, priced by commmodel):
    compute_i = f_i + k * b_i * c_i   node i alone (bench at two batch sizes): fixed + per-sample time
    comm      = per DDP bucket: latency + its payload x 2(|S|-1)/|S| x seconds per byte (bench)
    step      = max_i compute_i + max(last bucket, comm - backward of the last micro-batch)
    images/s  = k * B / step
    epoch     = (train samples / (k * B)) * step + max_i (e_i * eval images(|S|) + save_i)
                the epoch's end: each rank scores its share of the validation split and a training sample
                (wlcommon.eval_images) at e_i per image, then saves the checkpoint (bench's EpochCosts)
The even split gives every node `batch`; the balanced split solves f_i + b_i c_i = T, sum b_i = B.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from cluster.planner import bench, commmodel
from cluster.planner.bench import NetworkBench, NodeBench
from cluster.planner.commmodel import Scheme
from cluster.programs import wlcommon


@dataclass(frozen=True)
class NodeSpeed:
    """step(b) = fixed_s + b * per_sample_s, from `bench` (two batch sizes); powersgd_s: what PowerSGD's
    own compute adds to each optimizer step (bench: DDP and the hook on one process, where its
    all-reduces move nothing); an epoch's end: eval_image_s per image scored, save_s for the checkpoint;
    0 where not measured."""

    fixed_s: float
    per_sample_s: float
    powersgd_s: float = 0.0
    eval_image_s: float = 0.0
    save_s: float = 0.0

    def step(self, b: int) -> float:
        return self.fixed_s + b * self.per_sample_s

    def epoch_end(self, eval_images: int) -> float:
        return eval_images * self.eval_image_s + self.save_s

    @classmethod
    def from_bench(cls, r: NodeBench) -> NodeSpeed:
        if r.per_sample_s is not None:
            return cls(r.fixed_s or 0.0, r.per_sample_s, r.powersgd_s or 0.0, r.eval_image_s or 0.0, r.save_s or 0.0)
        return cls(0.0, 1.0 / r.images_per_s)  # a benchmark from before the two-size fit

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeSpeed:
        return cls(float(d["fixed_s"]), float(d["per_sample_s"]),
                   *(float(d.get(k) or 0.0) for k in ("powersgd_s", "eval_image_s", "save_s")))

    def to_dict(self) -> dict[str, float]:
        d = {"fixed_s": self.fixed_s, "per_sample_s": self.per_sample_s}
        extra = {"powersgd_s": self.powersgd_s, "eval_image_s": self.eval_image_s, "save_s": self.save_s}
        return {**d, **{k: v for k, v in extra.items() if v}}


@dataclass
class Placement:
    """One candidate: a node set, its batch shares, a communication scheme and what the model predicts.
    `global_batch` is the samples per optimizer step (accumulate x the shares); `comm_s` the all-reduce
    time the step waits for (not hidden under backward); documents from before the schemes load as
    uncompressed, accumulate 1."""

    nodes: list[str]
    global_batch: int
    shares: dict[str, int]
    even_images_per_s: float
    planned_images_per_s: float
    step_s: float
    comm_s: float
    epoch_s: float | None
    grad_compression: str = "none"
    powersgd_rank: int = 2
    accumulate: int = 1
    bytes_per_step: int | None = None
    warnings: list[str] = field(default_factory=list)
    # end to end over the job's epochs (training steps; PowerSGD's fp16 phase before it starts included):
    # what the recommendation ranks by where the job's length is known (Workload.epochs)
    run_s: float | None = None
    e2e_images_per_s: float | None = None
    powersgd_wire: str = "float32"
    # where the job's even shares were kept: the balanced ones balance() gave and their price, which bought
    # less than SHARES_GAIN (plans.even_kept says so); None where the shares are balance()'s own
    balanced: dict[str, int] | None = None
    balanced_images_per_s: float | None = None

    @property
    def scheme(self) -> Scheme:
        return Scheme(self.grad_compression, self.powersgd_rank, self.accumulate, self.powersgd_wire)

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "global_batch": self.global_batch, "shares": dict(self.shares),
                "even_images_per_s": self.even_images_per_s, "planned_images_per_s": self.planned_images_per_s,
                "step_s": self.step_s, "comm_s": self.comm_s, "epoch_s": self.epoch_s,
                "grad_compression": self.grad_compression, "powersgd_rank": self.powersgd_rank,
                "accumulate": self.accumulate, "bytes_per_step": self.bytes_per_step,
                "warnings": list(self.warnings), "run_s": self.run_s, "e2e_images_per_s": self.e2e_images_per_s,
                "powersgd_wire": self.powersgd_wire,
                "balanced": dict(self.balanced) if self.balanced else None,
                "balanced_images_per_s": self.balanced_images_per_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        """A saved candidate; keys of older plans that this model no longer prices are left aside."""
        def opt(key: str) -> float | None:
            return None if d.get(key) is None else float(d[key])

        return cls([str(n) for n in d["nodes"]], int(d["global_batch"]),
                   {str(n): int(b) for n, b in d["shares"].items()}, float(d["even_images_per_s"]),
                   float(d["planned_images_per_s"]), float(d["step_s"]), float(d["comm_s"]), opt("epoch_s"),
                   str(d.get("grad_compression", "none")), int(d.get("powersgd_rank", 2)),
                   int(d.get("accumulate", 1)), None if d.get("bytes_per_step") is None else int(d["bytes_per_step"]),
                   [str(w) for w in d.get("warnings") or []], opt("run_s"), opt("e2e_images_per_s"),
                   str(d.get("powersgd_wire", "float32")),
                   {str(n): int(b) for n, b in d["balanced"].items()} if d.get("balanced") else None,
                   opt("balanced_images_per_s"))


@dataclass(frozen=True)
class Workload:
    """What the model needs to price a job's communication: its gradients' shapes, how its framework
    overlaps them with backward (DDP's buckets; TensorFlow's loop all-reduces after backward), the
    schemes to weigh and the training set's size (epoch time, accuracy warnings)."""

    shapes: list[commmodel.Shape]
    framework: str = "pytorch"
    bucket_mb: float = 0.0
    schemes: tuple[Scheme, ...] = (Scheme(),)
    train_samples: int | None = None
    # the job's length, for the end-to-end figures (None: steady figures only, as plans before them)
    epochs: int | None = None
    warmup_epochs: float = 1.0
    powersgd_start_step: int = 0
    val_samples: int = 0  # what every epoch's end scores (with the training sample: wlcommon.eval_images)
    bn_recompute: int = 0  # and the samples it recomputes BatchNorm's statistics from

    @classmethod
    def flat(cls, network: NetworkBench | None, train_samples: int | None = None) -> Workload:
        """Gradients of unknown shapes: one vector of the bench's payload, sent uncompressed."""
        n = (network.payload_bytes if network else bench.MODEL_BYTES) // 4
        return cls([(n,)], train_samples=train_samples)


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
                   {str(n): NodeSpeed.from_dict(s) for n, s in d["speeds"].items()},
                   NetworkBench.from_dict(d["network"]) if d.get("network") else None, int(d["batch"]),
                   [Placement.from_dict(c) for c in d["candidates"]], Placement.from_dict(d["recommended"]))


# --------------------------------------------------------------------------- the model


MIN_SHARE = 2  # samples per node and micro-batch: BatchNorm cannot train on a batch of one


def _round(total: int, raw: dict[str, float]) -> dict[str, int]:
    """Whole numbers summing to total (largest remainder), at least MIN_SHARE each (1 where the total is
    too small for that)."""
    least = MIN_SHARE if total >= MIN_SHARE * len(raw) else 1
    out = {n: max(least, int(x)) for n, x in raw.items()}
    for n in sorted(raw, key=lambda n: raw[n] - int(raw[n]), reverse=True):
        if sum(out.values()) >= total:
            break
        out[n] += 1
    while sum(out.values()) > total:  # the minimum may overshoot on very slow nodes
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


def link(network: NetworkBench | None) -> commmodel.Link:
    """The bench's network as latency per all-reduce and seconds per byte a rank sends."""
    if not network:
        return commmodel.Link(0.0, 0.0)
    return commmodel.Link(network.latency_s, network.per_byte_s)


def step_time(shares: dict[str, int], speeds: dict[str, NodeSpeed], network: NetworkBench | None,
              work: Workload | None = None, scheme: Scheme = Scheme()) -> tuple[float, float]:
    """(step time, of which waiting for communication) for one optimizer step with these micro-batch
    shares: the slowest node's compute (the fixed part once, `accumulate` micro-batches; PowerSGD's
    products and orthogonalisation once) plus the all-reduce time that its last backward does not hide."""
    w = work or Workload.flat(network)
    k = scheme.accumulate
    psgd = scheme.grad_compression == "powersgd" and len(shares) > 1

    def compute(n: str) -> float:
        return speeds[n].step(k * shares[n]) + (speeds[n].powersgd_s if psgd else 0.0)

    slow = max(shares, key=compute)
    c = commmodel.comm(w.shapes, scheme, len(shares), link(network), w.bucket_mb)
    backward = commmodel.BACKWARD_SHARE * shares[slow] * speeds[slow].per_sample_s
    priced = all(speeds[n].powersgd_s > 0 for n in shares)
    wait = commmodel.exposed(c, backward, overlap=commmodel.overlaps(w.framework, scheme, priced))
    return compute(slow) + wait, wait


def _priced(nodes: list[str], shares: dict[str, int], even: dict[str, int], speeds: dict[str, NodeSpeed],
            network: NetworkBench | None, work: Workload, scheme: Scheme, base: int) -> Placement:
    """One node set with one scheme, as the model prices it."""
    total = scheme.accumulate * sum(shares.values())
    t_even, _ = step_time(even, speeds, network, work, scheme)
    t_plan, wait = step_time(shares, speeds, network, work, scheme)
    epoch = (work.train_samples // total) * t_plan + epoch_end(shares, speeds, work) if work.train_samples else None
    sent = commmodel.wire_bytes(work.shapes, scheme, len(nodes)) if len(nodes) > 1 else 0
    run = _run_s(shares, speeds, network, work, scheme, t_plan)
    return Placement(nodes, total, shares, total / t_even, total / t_plan, t_plan, wait, epoch,
                     scheme.grad_compression, scheme.powersgd_rank, scheme.accumulate, sent,
                     commmodel.warnings(scheme, total, work.train_samples, base),
                     run[0] if run else None, run[1] if run else None, scheme.powersgd_wire)


def epoch_end(shares: dict[str, int], speeds: dict[str, NodeSpeed], work: Workload) -> float:
    """Seconds of an epoch's end: the slowest node's evaluation of its share (the ranks' sums meet in an
    all-reduce) and checkpoint. One process per node, as on CPU-only and single-GPU PCs."""
    if not work.train_samples:
        return 0.0
    images = wlcommon.eval_images(work.train_samples, work.val_samples, len(shares), work.bn_recompute)
    return max(speeds[n].epoch_end(images) for n in shares)


def _steps_per_epoch(shares: dict[str, int], work: Workload, scheme: Scheme) -> int:
    """Optimizer steps an epoch (at least 1): the training set over the global batch, whole steps."""
    return max(1, (work.train_samples or 0) // (scheme.accumulate * sum(shares.values())))


def _run_s(shares: dict[str, int], speeds: dict[str, NodeSpeed], network: NetworkBench | None, work: Workload,
           scheme: Scheme, t_plan: float) -> tuple[float, float] | None:
    """(seconds, images/s) of the job end to end: every epoch at the step time, except PowerSGD's first
    steps, which go as fp16 until it starts (wlcommon.powersgd_start: after the warm-up and 1000 steps, at
    most half the run): on a slow link that phase is where the time goes; plus every epoch's end
    (evaluation and checkpoint). images/s: every sample trained / that time, as the report's end-to-end
    figure."""
    if not work.train_samples or not work.epochs:
        return None
    total = scheme.accumulate * sum(shares.values())
    steps = (work.train_samples // total) * work.epochs
    if not steps:
        return None
    seconds = _steps_s(steps, shares, speeds, network, work, scheme, t_plan)
    seconds += work.epochs * epoch_end(shares, speeds, work)
    return seconds, steps * total / seconds


def _steps_s(steps: int, shares: dict[str, int], speeds: dict[str, NodeSpeed], network: NetworkBench | None,
             work: Workload, scheme: Scheme, t_plan: float) -> float:
    """Seconds of the run's first `steps` optimizer steps: PowerSGD's before it starts at fp16's step time,
    the rest at t_plan."""
    if len(shares) < 2 or scheme.grad_compression != "powersgd":
        return steps * t_plan
    per_epoch = _steps_per_epoch(shares, work, scheme)
    first = wlcommon.fp16_steps(work.powersgd_start_step, per_epoch, work.warmup_epochs, work.epochs or 1)
    t_before, _ = step_time(shares, speeds, network, work, Scheme("fp16", scheme.powersgd_rank, scheme.accumulate))
    first = min(steps, first)
    return first * t_before + (steps - first) * t_plan


# Uneven shares must buy this much step rate over the job's even ones: more than bench's own spread between
# two measurements of a node (5-7% of a step on the lab). Below it they follow bench's noise on nodes of one
# speed, and a run on them trains on other batches than the even-share run it replaces (docs/planning.md).
SHARES_GAIN = 1.05


def candidates(speeds: dict[str, NodeSpeed], batch: int, network: NetworkBench | None,
               train_samples: int | None = None, work: Workload | None = None) -> list[Placement]:
    """The k fastest nodes for k = 1..N, each with the job's global batch for k nodes (batch x k),
    priced with every scheme of `work` (one node: the first scheme only, nothing crosses a network); with
    balanced shares where they are SHARES_GAIN faster a step than even ones, else even."""
    work = work or Workload.flat(network, train_samples)
    ranked = sorted(speeds, key=lambda n: speeds[n].step(batch))
    out = []
    for k in range(1, len(ranked) + 1):
        chosen = ranked[:k]
        sp = {n: speeds[n] for n in chosen}
        planned, even = balance(batch * k, sp), {n: batch for n in chosen}
        for scheme in work.schemes[:1] if k == 1 else work.schemes:
            c = _priced(chosen, planned, even, sp, network, work, scheme, batch * k)
            if planned != even and c.planned_images_per_s < SHARES_GAIN * c.even_images_per_s:
                c = replace(_priced(chosen, even, even, sp, network, work, scheme, batch * k),
                            balanced=planned, balanced_images_per_s=c.planned_images_per_s)
            out.append(c)
    return out


NEAR_BEST = 0.8  # within this fraction of the fastest, the plan takes the scheme that changes training least


def speed(c: Placement) -> float:
    """What the recommendation ranks by, higher is better: end to end over the job's epochs where known,
    else the steady step rate."""
    return c.e2e_images_per_s if c.e2e_images_per_s is not None else c.planned_images_per_s


def recommend(cands: list[Placement]) -> Placement:
    """Among the candidates without an accuracy warning (all, if every one has one), those within 20% of
    the fastest end to end (a scheme that changes training must buy 25% more throughput); of these the one
    that changes training least (fewer micro-batches per step, then no compression, fp16, PowerSGD, then
    PowerSGD's float32 wire before bfloat16), the fastest of equals. One node is a candidate like any other:
    where it is fastest, it is the answer."""
    safe = [c for c in cands if not c.warnings] or cands
    top = max(speed(c) for c in safe)
    near = [c for c in safe if speed(c) >= NEAR_BEST * top]
    return min(near, key=lambda c: (*changes(c), -speed(c)))


def changes(c: Placement) -> tuple[int, int, bool]:
    """How much a candidate changes training, least first: fewer micro-batches per step, then no compression,
    fp16, PowerSGD, then PowerSGD's float32 wire before bfloat16."""
    order = wlcommon.COMPRESSIONS
    rank = order.index(c.grad_compression) if c.grad_compression in order else len(order)
    return c.accumulate, rank, c.powersgd_wire != "float32"
