"""One run's figures (RunFigures) from its folders on the head (docs/report.md): rank 0's epoch records over
the membership periods (periods.py), each node's (node_figures.py), the wire and the energy; for a program
without training metrics, the head's record. A figure the metrics cannot give is None, never a guess.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cluster.errors import UsageError
from cluster.runs import records as runs
from cluster.study import node_figures, periods
from cluster.study.node_figures import NodeFigures, Record, median
from cluster.study.periods import PeriodFigures, SeriesRecords

DEFAULT_TARGET_ACC = 0.9


@dataclass
class RunFigures:
    run_id: str
    job: str
    framework: str
    state: str
    nodes: list[str]
    world: int
    batch: int
    global_batch: int
    dataset: str
    synthetic: bool
    epochs: list[Record]  # rank 0's epoch records: global loss / accuracy / throughput
    images_per_s: float | None  # steady: median over the epochs after the first (warm-up), else the one epoch
    epoch_s: float | None  # the same way
    final_val_acc: float | None
    best_val_acc: float | None
    wall_s: float | None
    per_node: list[NodeFigures] = field(default_factory=list)
    step_spread: float | None = None  # slowest / fastest node's median step time
    straggler: str | None = None
    energy_kwh: float | None = None
    energy_source: str = "estimated"
    cost: float | None = None
    scaling: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    started: float | None = None
    predicted_images_per_s: float | None = None  # `clusterctl plan`'s figure, for runs launched with --plan
    cpu_cores_process: float | None = None  # cores a training process kept busy (median, epochs after the first)
    bytes_sent_per_step: int | None = None  # per rank and optimizer step, ring all-reduce (epochs after the first)
    allreduce_payload_bytes: int | None = None  # handed to the all-reduce per step, after compression
    grad_compression: str | None = None  # the one in effect (start record); None: not recorded
    powersgd_rank: int | None = None
    powersgd_wire: str | None = None  # PowerSGD's all-reduces: float32 | bfloat16 (None: not PowerSGD, or before it)
    accumulate: int | None = None  # micro-batches per optimizer step (one all-reduce per step)
    comm_share: float | None = None  # of the step time: all-reduce and waiting for other nodes
    comm_share_source: str | None = None  # how comm_share was obtained; None: it could not be
    target_acc: float = DEFAULT_TARGET_ACC
    time_to_target_s: float | None = None  # run start -> end of the first epoch with val_acc >= target
    # end to end: every epoch's samples (once; steps_per_epoch x global_batch of the period that trained it) /
    # wall_s, so the first epoch, warm-up, evaluation, checkpoints and restart gaps all count
    trained_samples: float | None = None
    images_per_s_e2e: float | None = None
    energy_to_target_kwh: float | None = None  # every node's watts (as energy_kwh) x time_to_target_s
    # what a program wrote to $CLUSTER_METRICS (JSON lines), per node: plotted field by field
    user_metrics: dict[str, list[Record]] = field(default_factory=dict)
    one_machine: bool = False  # several nodes on one kernel (a simulated lab): they share its cores
    # membership: one period for a run that kept its nodes; the nodes it lost (node -> the record's
    # {"why", "at", "period", "came_back", ...})
    periods: list[PeriodFigures] = field(default_factory=list)
    dropped: dict[str, dict[str, Any]] = field(default_factory=dict)
    training_start: float | None = None  # rank 0's first start record: where time to the target counts from
    # a run that continues others (`launch --continue`): the figures of them all as one run, what the user
    # waited (join_continued); None for a run that continues none
    joined: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["per_node"] = [{k: v for k, v in n.__dict__.items() if k != "usage"} for n in self.per_node]
        d["periods"] = [dataclasses.asdict(p) for p in self.periods]
        d.pop("user_metrics")
        return d

    @property
    def step_s(self) -> float | None:
        """Steady wall time of one optimizer step, all nodes together (from the epoch records)."""
        return self.global_batch / self.images_per_s if self.images_per_s and self.global_batch else None

    def joined_figures(self) -> dict[str, Any] | None:
        """`joined`, where it continues runs and could be joined with them; else None."""
        return self.joined if self.joined and "error" not in self.joined else None


def _steady(values: list[float]) -> float | None:
    """Median over the epochs after the first (graph tracing, caches, warm-up), or the only one."""
    return median(values[1:] if len(values) > 1 else values)


def _rank0(r0: list[Record]) -> tuple[Record, list[Record], float | None, float | None]:
    """Rank 0's first start record (period 1's: what describes the run), its epoch records (the last of a
    repeated epoch wins), the wall time and the time of its first start; `r0` is rank 0's records of
    every node folder, period by period in time order (periods.lead)."""
    start = next((x for x in r0 if x["type"] == "start"), {})
    epochs_by_n: dict[int, Record] = {}
    for x in r0:
        if x["type"] == "epoch":
            epochs_by_n[x["epoch"]] = x  # a resumed run may repeat an epoch: the last record wins
    starts = [x["time"] for x in r0 if x["type"] == "start"]
    ends = [x["time"] for x in r0 if x["type"] in ("end", "epoch")]
    wall = (max(ends) - min(starts)) if starts and ends else None
    return start, [epochs_by_n[k] for k in sorted(epochs_by_n)], wall, min(starts) if starts else None


def _communication(fig: RunFigures, start: Record, epochs: list[Record]) -> None:
    """What went on the wire per step and the scheme in effect, as the training program recorded it."""
    sent = _steady([float(e["bytes_sent_per_step_ring"]) for e in epochs if "bytes_sent_per_step_ring" in e])
    if sent is None and "bytes_sent_per_step_ring" in start:
        sent = float(start["bytes_sent_per_step_ring"])
    fig.bytes_sent_per_step = round(sent) if sent is not None else None
    payload = start.get("allreduce_payload_bytes")
    fig.allreduce_payload_bytes = int(payload) if payload is not None else None
    fig.grad_compression = start.get("grad_compression")
    fig.powersgd_rank = start.get("powersgd_rank") if fig.grad_compression == "powersgd" else None
    fig.powersgd_wire = start.get("powersgd_wire") if fig.grad_compression == "powersgd" else None
    fig.accumulate = int(start["accumulate"]) if start.get("accumulate") is not None else None
    if fig.world == 1:  # one process: nothing is all-reduced, the step is all computation
        fig.comm_share, fig.comm_share_source = 0.0, "one process: no all-reduce"


def time_to_target(epochs: list[Record], t0: float | None, target: float) -> float | None:
    """Seconds from the run's start to the end of the first epoch whose val_acc >= target; None if none."""
    hit = next((e for e in epochs if e["val_acc"] >= target), None)
    return hit["time"] - t0 if hit is not None and t0 is not None else None


def _cpu_cores(series: list[SeriesRecords]) -> float | None:
    """Cores a training process kept busy: the median over every rank's epochs after its first (of each
    period: a restart warms up again)."""
    per_rank = [[float(x["cpu_cores_process"]) for x in s.records if x["type"] == "epoch" and "cpu_cores_process" in x]
                for s in series]
    return median([v for vals in per_rank for v in (vals[1:] if len(vals) > 1 else vals)])


def _spread_and_energy(fig: RunFigures, watts: list[float], price_kwh: float | None) -> None:
    """The straggler and the step-time spread across nodes; energy (and cost) over the wall time, and the
    energy to the target accuracy (the same watts over time_to_target_s)."""
    meds = [(p.step_s_median, p.node) for p in fig.per_node if p.step_s_median]
    if len(meds) > 1:
        fig.step_spread = max(meds)[0] / min(meds)[0]
        fig.straggler = max(meds)[1]
    if fig.wall_s:
        fig.energy_kwh = sum(w * fig.wall_s for w in watts) / 3.6e6
        measured_all = all(p.watts_source == "measured" for p in fig.per_node)
        fig.energy_source = "measured GPU power" if measured_all else "estimated"
        fig.cost = fig.energy_kwh * price_kwh if price_kwh is not None else None
    if fig.time_to_target_s is not None:
        fig.energy_to_target_kwh = sum(w * fig.time_to_target_s for w in watts) / 3.6e6


def _training(record: runs.RunRecord, series: list[SeriesRecords], nodes: list[str],
              target_acc: float) -> RunFigures:
    """The run-wide figures of a run whose programs wrote training metrics, from rank 0's records."""
    lead = periods.lead(series)
    start, epochs, wall, t0 = _rank0([x for k in sorted(lead) for x in lead[k]])
    vals = [e["val_acc"] for e in epochs]
    fig = RunFigures(
        run_id=record.run_id, job=record.job, framework=record.framework, state=record.state,
        nodes=nodes, world=int(start.get("world") or record.world_size or 0),
        batch=int(start.get("batch") or 0), global_batch=int(start.get("global_batch") or 0),
        dataset=str(start.get("dataset")), synthetic=bool(start.get("synthetic")), epochs=epochs,
        images_per_s=_steady([e["images_per_s"] for e in epochs]), epoch_s=_steady([e["epoch_s"] for e in epochs]),
        final_val_acc=vals[-1] if vals else None, best_val_acc=max(vals) if vals else None, wall_s=wall,
        settings=record.settings or {}, started=record.started,
        predicted_images_per_s=(record.prediction or {}).get("planned_images_per_s"),
        cpu_cores_process=_cpu_cores(series), target_acc=target_acc,
        time_to_target_s=time_to_target(epochs, t0, target_acc),
        periods=periods.from_metrics(record, series, lead, nodes), dropped=dict(record.dropped), training_start=t0)
    fig.trained_samples = periods.run_samples(lead)
    fig.images_per_s_e2e = fig.trained_samples / wall if fig.trained_samples and wall else None
    _communication(fig, start, epochs)
    return fig


def run_figures(record: runs.RunRecord, price_kwh: float | None = None,
                target_acc: float = DEFAULT_TARGET_ACC) -> RunFigures:
    """Every figure of one collected run, from its metrics files on the head; for a program without training
    metrics, each node's exit code, what the node agent measured and what it wrote to $CLUSTER_METRICS."""
    base = runs.run_path(record.run_id)
    nodes = [n.node for n in record.nodes]
    by_node = {n: node_figures.read_metrics(base / n) for n in nodes}
    exits = {n: (record.last_status or {}).get(n, {}).get("exit_code") for n in nodes}
    if any(by_node.values()):
        series = periods.series(by_node)
        fig = _training(record, series, nodes, target_acc)
        node_figs = [node_figures.from_metrics(n, by_node[n], base / n, fig.batch,
                                               periods.node_processes(series, n, len(by_node[n])), exits[n])
                     for n in nodes]
    elif record.collected:  # a program without training metrics (a user's own): the head's times
        wall = (record.ended - record.started) if record.ended and record.started else None
        fig = RunFigures(
            run_id=record.run_id, job=record.job, framework=record.framework, state=record.state, nodes=nodes,
            world=record.world_size, batch=0, global_batch=0, dataset="-", synthetic=False, epochs=[],
            images_per_s=None, epoch_s=None, final_val_acc=None, best_val_acc=None, wall_s=wall,
            settings=record.settings or {}, started=record.started, target_acc=target_acc,
            periods=periods.from_head(record, nodes, wall), dropped=dict(record.dropped))
        node_figs = [node_figures.from_usage(n, base / n, exits[n]) for n in nodes]
    else:
        raise UsageError(f"run {record.run_id}: no metrics on the head",
                         f"collect them first: clusterctl collect {record.run_id}")
    fig.per_node = [p for p, _ in node_figs]
    fig.user_metrics = {n: m for n in nodes if (m := node_figures.read_user_metrics(base / n))}
    boots = {node_figures.boot_id(base / n) for n in nodes}
    fig.one_machine = len(nodes) > 1 and len(boots) == 1 and None not in boots
    _spread_and_energy(fig, [w for _, w in node_figs], price_kwh)
    return fig
