"""The figures of collected runs, computed from their metrics files on the head (docs/report.md).

Everything `report` shows is computed here, in one place, from what `collect`
brought (runs/<run-id>/<node>/out/metrics-rank*.jsonl and facts.json); report.py
only renders these figures. A figure the metrics cannot give is None ("-" on
the page), never a guess.

A run that lost a node and went on without it (cluster/runs/elastic.py) has several membership periods,
each with its own ranks: rank 0 of period 2 may write in another node's folder than rank 0 of period 1,
and a node that kept its rank appends the new period's records after the old ones. So every metrics file
is split into its periods (each `start` record names its `period`, 1 when absent) and rank 0's records
are merged from every node folder before anything is computed from them.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.runs import jobs, records as runs, schema
from cluster.errors import ClusterError, UsageError

# Energy estimate where no power was measured (docs/report.md): an old desktop draws about
# IDLE_W doing nothing, and up to CPU_LOAD_W more with its CPU busy; a GPU without a power
# reading counts at its board power from GPU_BOARD_W (NVIDIA's specifications).
IDLE_W = 40.0
CPU_LOAD_W = 65.0
GPU_BOARD_W = {"GTX 750 Ti": 60, "GTX 950": 90, "GTX 960": 120, "GTX 970": 145, "GTX 980": 165,
               "GTX 1050 Ti": 75, "GTX 1050": 75, "GTX 1060": 120, "GTX 1070": 150, "GTX 1080 Ti": 250,
               "GTX 1080": 180, "RTX 2060": 160, "RTX 2070": 175, "RTX 2080": 215, "RTX 3060": 170,
               "RTX 3070": 220, "RTX 3080": 320, "RTX 3090": 350}
DEFAULT_GPU_W = 150.0
DEFAULT_TARGET_ACC = 0.9

Record = dict[str, Any]  # one metrics line, as the training programs wrote it (docs/metrics.md)


@dataclass
class NodeFigures:
    node: str
    ranks: list[int]
    step_s_median: float | None
    step_s_p90: float | None
    data_s_median: float | None
    images_per_s: float | None  # this node's own samples / its median step time
    cpu_percent: float | None
    gpu_power_w: float | None  # measured (NVML / nvidia-smi) mean over the run, all GPUs of the node
    watts: float
    watts_source: str  # measured | estimated
    hardware: str
    # from the node agent's samples (out/usage.jsonl), for any program: the built-in ones and a user's own
    rss_mb_peak: float | None = None
    cpu_energy_j: float | None = None  # the CPU packages' measured energy (RAPL) over the run, where readable
    exit_code: int | None = None
    usage: list[Record] = field(default_factory=list)


@dataclass
class PeriodFigures:
    """One membership period of a run: the nodes it ran on (rank order) and what it did."""

    period: int  # 1-based
    nodes: list[str]
    world: int | None
    from_epoch: int | None  # where it resumed (its start record's start_epoch / start_step, else the record's)
    from_step: int | None
    reason: str | None  # why it began (the run record's); None for the first
    epochs: list[int]  # the epochs whose records it wrote (a redone epoch is in two periods)
    started: float | None  # its first start record's time
    wall_s: float | None  # its start record to its last epoch / end record
    images_per_s: float | None  # the samples of its epochs (images_per_s x epoch_s) / wall_s
    gap_s: float | None  # the previous period's last record (any rank) to this start: what the change cost


@dataclass
class SeriesRecords:
    """One metrics file's records of one period (a file holds several when its node kept its rank)."""

    node: str
    rank: int
    period: int
    records: list[Record]


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


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _p90(xs: list[float]) -> float | None:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else None


def _steady(values: list[float]) -> float | None:
    """Median over the epochs after the first (graph tracing, caches, warm-up), or the only one."""
    return _median(values[1:] if len(values) > 1 else values)


def read_metrics(node_dir: Path) -> dict[int, list[Record]]:
    out: dict[int, list[Record]] = {}
    for f in sorted((node_dir / "out").glob("metrics-rank*.jsonl")):
        recs = []
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a stop: everything before it counts
        out[int(f.stem.removeprefix("metrics-rank"))] = recs
    return out


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _time(x: Record) -> float:
    t = _num(x.get("time"))
    return float("-inf") if t is None else t


def period_of(start: Record) -> int:
    """The membership period a start record opens (1 when it names none: runs from before periods)."""
    p = _int(start.get("period"))
    return p if p is not None and p >= 1 else 1


def split_periods(recs: list[Record]) -> dict[int, list[Record]]:
    """One metrics file's records by period: each start record opens its period; what comes before any
    start record (a file cut at its head) counts to period 1. Anything but an object is passed over."""
    out: dict[int, list[Record]] = {}
    period = 1
    for x in recs:
        if not isinstance(x, dict):
            continue
        if x.get("type") == "start":
            period = period_of(x)
        out.setdefault(period, []).append(x)
    return out


def _series(by_node: dict[str, dict[int, list[Record]]]) -> list[SeriesRecords]:
    """Every (node folder, rank file, period) of the run's metrics."""
    return [SeriesRecords(n, r, k, recs) for n, m in by_node.items() for r in sorted(m)
            for k, recs in sorted(split_periods(m[r]).items())]


def _lead(series: list[SeriesRecords]) -> dict[int, list[Record]]:
    """Rank 0's records per period, from every node folder (a restart may give rank 0 to another node),
    in time order. A period whose rank 0 left nothing on the head (its node was not collected) takes its
    lowest collected rank: every rank writes the same all-reduced epoch figures."""
    out: dict[int, list[Record]] = {}
    for k in sorted({s.period for s in series}):
        mine = [s for s in series if s.period == k]
        low = min(s.rank for s in mine)
        out[k] = sorted((x for s in mine if s.rank == low for x in s.records), key=_time)
    return out


def record_periods(record: runs.RunRecord) -> dict[int, dict[str, Any]]:
    """The run record's periods by number (none: a record from before periods)."""
    return {p["period"]: p for p in record.periods if isinstance(p.get("period"), int) and p["period"] >= 1}


def record_dropped(record: runs.RunRecord) -> dict[str, dict[str, Any]]:
    """The nodes the run went on without: node -> {"why", "at", "period", "came_back", ...}."""
    return dict(record.dropped)


def _names(x: Any) -> list[str]:
    return [n for n in x if isinstance(n, str)] if isinstance(x, list) else []


def _start_nodes(series: list[SeriesRecords], k: int) -> list[str]:
    """Period k's nodes in rank order, from the folders its start records are in."""
    starts = sorted((s.rank, s.node) for s in series
                    if s.period == k and any(x.get("type") == "start" for x in s.records))
    return list(dict.fromkeys(n for _, n in starts))


def _periods(record: runs.RunRecord, series: list[SeriesRecords], lead: dict[int, list[Record]],
             run_nodes: list[str]) -> list[PeriodFigures]:
    """Each membership period's figures: its nodes and reason from the run record (else its start
    records), the rest from rank 0's records of that period."""
    recorded = record_periods(record)
    numbers = sorted(set(lead) | set(recorded)) or [1]
    out: list[PeriodFigures] = []
    prev_last: float | None = None
    for k in numbers:
        rp, recs = recorded.get(k, {}), lead.get(k, [])
        start = next((x for x in recs if x.get("type") == "start"), {})
        t0 = _num(start.get("time"))
        ends = [t for x in recs if x.get("type") in ("epoch", "end") and (t := _num(x.get("time"))) is not None]
        wall = max(ends) - t0 if t0 is not None and ends and max(ends) >= t0 else None
        ep = [x for x in recs if x.get("type") == "epoch"]
        samples = sum(epoch_samples(x, start) or 0.0 for x in ep)
        nodes = (_names(rp.get("nodes")) or (run_nodes if len(numbers) == 1 else _start_nodes(series, k))
                 or (run_nodes if k == 1 else []))
        world = _int(start.get("world")) or _int(rp.get("world_size")) or len(nodes) or None
        from_epoch, from_step = _int(start.get("start_epoch")), _int(start.get("start_step"))
        from_epoch = _int(rp.get("from_epoch")) if from_epoch is None else from_epoch
        from_step = _int(rp.get("from_step")) if from_step is None else from_step
        reason = rp.get("reason")
        out.append(PeriodFigures(
            period=k, nodes=nodes, world=world, from_epoch=from_epoch, from_step=from_step,
            reason=reason if isinstance(reason, str) else None,
            epochs=sorted({e for x in ep if (e := _int(x.get("epoch"))) is not None}), started=t0, wall_s=wall,
            images_per_s=samples / wall if samples and wall else None,
            gap_s=t0 - prev_last if t0 is not None and prev_last is not None else None))
        lasts = [t for s in series if s.period == k for x in s.records if (t := _num(x.get("time"))) is not None]
        prev_last = max(lasts) if lasts else None
    return out


def epoch_samples(epoch: Record, start: Record) -> float | None:
    """The samples one epoch record trained: steps_per_epoch x global_batch of the start record of the period
    that wrote it (exact: what the program ran, and what its images_per_s divides), else images_per_s x
    epoch_s (both rounded in the record: a few samples off); None when neither is recorded."""
    steps, batch = _int(start.get("steps_per_epoch")), _int(start.get("global_batch"))
    if steps and batch:
        return float(steps * batch)
    ips, secs = _num(epoch.get("images_per_s")), _num(epoch.get("epoch_s"))
    return ips * secs if ips is not None and secs is not None else None


def run_samples(lead: dict[int, list[Record]]) -> float | None:
    """Every epoch's samples once, from rank 0's records per period (_lead): an epoch redone after a restart
    counts as its later record (the one the epoch table shows), so the work lost to the restart is wall time
    without samples. None without epochs, or when an epoch's samples are not recorded."""
    by_n: dict[Any, float | None] = {}
    for k in sorted(lead):
        start = next((x for x in lead[k] if x.get("type") == "start"), {})
        for x in lead[k]:
            if x.get("type") == "epoch":
                by_n[x.get("epoch")] = epoch_samples(x, start)
    vals = list(by_n.values())
    return sum(v for v in vals if v is not None) if vals and None not in vals else None


def _jsonl(path: Path) -> list[Record]:
    """A JSON-lines file's objects; a line cut short (a stop, a crash) or not an object is passed over."""
    out = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_usage(node_dir: Path) -> list[Record]:
    """The node agent's samples of the run's processes (cluster/agent/usage.py)."""
    return _jsonl(node_dir / "out" / "usage.jsonl")


def read_user_metrics(node_dir: Path) -> list[Record]:
    """What the program appended to $CLUSTER_METRICS, its numeric fields only."""
    return [{k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for r in _jsonl(node_dir / "out" / "user-metrics.jsonl")]


def _usage_figures(p: NodeFigures, samples: list[Record], exit_code: int | None) -> None:
    """Fill a node's figures from its usage samples (where the program's own metrics had none)."""
    p.usage, p.exit_code = samples, exit_code
    cpu = [x["cpu_percent"] for x in samples if isinstance(x.get("cpu_percent"), (int, float))]
    if p.cpu_percent is None and cpu:
        p.cpu_percent = statistics.mean(cpu)
    rss = [x["rss_mb"] for x in samples if isinstance(x.get("rss_mb"), (int, float))]
    p.rss_mb_peak = max(rss) if rss else None
    joules = [x["cpu_energy_j"] for x in samples if isinstance(x.get("cpu_energy_j"), (int, float))]
    p.cpu_energy_j = round(sum(joules), 1) if joules else None


def node_facts(node_dir: Path) -> dict[str, Any]:
    """The facts collect saved beside a node's files (NodeFacts.to_dict()); {} where there are none."""
    try:
        f = json.loads((node_dir / "facts.json").read_text())
    except (OSError, ValueError):
        return {}
    return f if isinstance(f, dict) else {}


def _hardware(node_dir: Path) -> tuple[str, list[str], int]:
    """'4 cores, 8 GiB, GTX 1050 Ti', GPU names, cores — from the facts collect saved."""
    f = node_facts(node_dir)
    if not f:
        return "unknown", [], 0
    cores = (f.get("cpu") or {}).get("usable") or 0
    ram = ((f.get("memory") or {}).get("total_mib") or 0) / 1024
    gpus = [g["name"].replace("NVIDIA ", "").replace("GeForce ", "") for g in (f.get("gpus") or {}).get("gpus", [])]
    model = ((f.get("cpu") or {}).get("model") or "").replace("(R)", "").replace("(TM)", "").strip()
    return f"{model + ', ' if model else ''}{cores} cores, {ram:.0f} GiB, {', '.join(gpus) or 'no GPU'}", gpus, cores


def _board_watts(gpu: str) -> float:
    for model, w in sorted(GPU_BOARD_W.items(), key=lambda kv: -len(kv[0])):
        if model in gpu:
            return float(w)
    return DEFAULT_GPU_W


def _rank0(r0: list[Record]) -> tuple[Record, list[Record], float | None, float | None]:
    """Rank 0's first start record (period 1's: what describes the run), its epoch records (the last of a
    repeated epoch wins), the wall time and the time of its first start; `r0` is rank 0's records of
    every node folder, period by period in time order (_lead)."""
    start = next((x for x in r0 if x["type"] == "start"), {})
    epochs_by_n: dict[int, Record] = {}
    for x in r0:
        if x["type"] == "epoch":
            epochs_by_n[x["epoch"]] = x  # a resumed run may repeat an epoch: the last record wins
    starts = [x["time"] for x in r0 if x["type"] == "start"]
    ends = [x["time"] for x in r0 if x["type"] in ("end", "epoch")]
    wall = (max(ends) - min(starts)) if starts and ends else None
    return start, [epochs_by_n[k] for k in sorted(epochs_by_n)], wall, min(starts) if starts else None


def _node_figures(node: str, by_rank: dict[int, list[Record]], node_dir: Path,
                  batch: int, procs: int) -> tuple[NodeFigures, float]:
    """One node's step times, CPU use and power (measured, else estimated from its hardware); the watts
    unrounded, for the energy. `procs`: its training processes at a time (a node whose rank changed with
    the membership has a file per rank it held, one after the other)."""
    recs = [x for r in sorted(by_rank) for x in by_rank[r]]
    steps = [x for x in recs if x["type"] == "step"]
    step_s = [x["data_s"] + x["compute_s"] for x in steps]
    ep = [x for x in recs if x["type"] == "epoch"]
    cpu = [x["cpu_percent_node"] for x in ep if x.get("cpu_percent_node") is not None]
    power = [sum(g["power_w"] for g in x["gpus"] if g.get("power_w") is not None)
             for x in ep if x.get("gpus") and any(g.get("power_w") is not None for g in x["gpus"])]
    hw, gpus, _ = _hardware(node_dir)
    med = _median(step_s)
    rest = IDLE_W + CPU_LOAD_W * min(1.0, (_median(cpu) or 100.0) / 100.0)
    watts = rest + (statistics.mean(power) if power else sum(_board_watts(g) for g in gpus))
    return NodeFigures(
        node=node, ranks=sorted(by_rank), step_s_median=med, step_s_p90=_p90(step_s),
        data_s_median=_median([x["data_s"] for x in steps]),
        images_per_s=(batch * procs / med) if med else None, cpu_percent=_median(cpu),
        gpu_power_w=statistics.mean(power) if power else None, watts=round(watts, 1),
        watts_source="measured" if power else "estimated", hardware=hw), watts


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
    return _median([v for vals in per_rank for v in (vals[1:] if len(vals) > 1 else vals)])


def run_figures(record: runs.RunRecord, price_kwh: float | None = None,
                target_acc: float = DEFAULT_TARGET_ACC) -> RunFigures:
    """Every figure of one collected run, from its metrics files on the head."""
    base = runs.run_path(record.run_id)
    nodes = [n.node for n in record.nodes]
    by_node = {n: read_metrics(base / n) for n in nodes}
    series = _series(by_node)
    exits = {n: (record.last_status or {}).get(n, {}).get("exit_code") for n in nodes}
    if not any(by_node.values()):
        if not record.collected:
            raise UsageError(f"run {record.run_id}: no metrics on the head",
                             f"collect them first: clusterctl collect {record.run_id}")
        return _program_figures(record, base, nodes, exits, price_kwh, target_acc)
    lead = _lead(series)
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
        periods=_periods(record, series, lead, nodes), dropped=record_dropped(record), training_start=t0)
    fig.trained_samples = run_samples(lead)
    fig.images_per_s_e2e = fig.trained_samples / wall if fig.trained_samples and wall else None
    _communication(fig, start, epochs)
    per_node = [_node_figures(n, by_node[n], base / n, fig.batch, _processes(series, n, len(by_node[n])))
                for n in nodes]
    fig.per_node = [p for p, _ in per_node]
    for p in fig.per_node:
        _usage_figures(p, read_usage(base / p.node), exits[p.node])
    fig.user_metrics = {n: m for n in nodes if (m := read_user_metrics(base / n))}
    _spread_and_energy(fig, [w for _, w in per_node], price_kwh)
    return fig


def _processes(series: list[SeriesRecords], node: str, files: int) -> int:
    """A node's training processes at a time: its rank files, or where its ranks changed with the
    membership, the most it ran in one period."""
    per = [s.period for s in series if s.node == node]
    return max(per.count(k) for k in set(per)) if len(set(per)) > 1 else files


def _head_periods(record: runs.RunRecord, nodes: list[str], wall: float | None) -> list[PeriodFigures]:
    """A run without training metrics: its periods as the head recorded them (its times), else one."""
    recorded = record_periods(record)
    if not recorded:
        return [PeriodFigures(1, nodes, record.world_size or None, None, None, None, [], record.started, wall,
                              None, None)]
    out: list[PeriodFigures] = []
    prev_end: float | None = None
    for k in sorted(recorded):
        rp = recorded[k]
        t0, t1 = _num(rp.get("started")), _num(rp.get("ended"))
        t1 = _num(record.ended) if t1 is None and k == max(recorded) else t1  # the last ends with the run
        reason = rp.get("reason")
        out.append(PeriodFigures(
            k, _names(rp.get("nodes")), _int(rp.get("world_size")), _int(rp.get("from_epoch")),
            _int(rp.get("from_step")), reason if isinstance(reason, str) else None, [], t0,
            t1 - t0 if t0 is not None and t1 is not None else None, None,
            t0 - prev_end if t0 is not None and prev_end is not None else None))
        prev_end = t1
    return out


def _program_figures(record: runs.RunRecord, base: Path, nodes: list[str], exits: dict[str, int | None],
                     price_kwh: float | None, target_acc: float) -> RunFigures:
    """A run whose program writes no training metrics (a user's own): its wall time, each node's exit
    code and what the node agent measured (CPU, memory, measured CPU energy), and $CLUSTER_METRICS."""
    wall = (record.ended - record.started) if record.ended and record.started else None
    fig = RunFigures(
        run_id=record.run_id, job=record.job, framework=record.framework, state=record.state, nodes=nodes,
        world=record.world_size, batch=0, global_batch=0, dataset="-", synthetic=False, epochs=[],
        images_per_s=None, epoch_s=None, final_val_acc=None, best_val_acc=None, wall_s=wall,
        settings=record.settings or {}, started=record.started, target_acc=target_acc,
        periods=_head_periods(record, nodes, wall), dropped=record_dropped(record))
    watts = []
    for n in nodes:
        hw, gpus, _ = _hardware(base / n)
        samples = read_usage(base / n)
        cpu = [x["cpu_percent"] for x in samples if isinstance(x.get("cpu_percent"), (int, float))]
        rest = IDLE_W + CPU_LOAD_W * min(1.0, (statistics.mean(cpu) if cpu else 100.0) / 100.0)
        w = rest + sum(_board_watts(g) for g in gpus)
        p = NodeFigures(node=n, ranks=[], step_s_median=None, step_s_p90=None, data_s_median=None,
                        images_per_s=None, cpu_percent=None, gpu_power_w=None, watts=round(w, 1),
                        watts_source="estimated", hardware=hw)
        _usage_figures(p, samples, exits[n])
        fig.per_node.append(p)
        watts.append(w)
    fig.user_metrics = {n: m for n in nodes if (m := read_user_metrics(base / n))}
    _spread_and_energy(fig, watts, price_kwh)
    return fig


def _comparable(a: runs.RunRecord, b: runs.RunRecord) -> bool:
    """Same job and the same settings except which nodes ran it and, where one of them ran on one node,
    what only changes the wire (a one-node fp16 run and a plain one are the same run)."""
    skip = {"nodes", *(schema.WIRE_KEYS if 1 in (len(a.nodes), len(b.nodes)) else ())}
    return a.job == b.job and {k: v for k, v in jobs.with_defaults(a.settings).items() if k not in skip} \
        == {k: v for k, v in jobs.with_defaults(b.settings).items() if k not in skip}


def _collected_singles(records: dict[str, runs.RunRecord]) -> dict[str, runs.RunRecord]:
    """The runs reported plus every collected, succeeded one-node run: where baselines come from."""
    pool = dict(records)
    for r in runs.scan()[0]:  # a damaged record elsewhere does not stop a report
        if r.run_id not in pool and r.state == "succeeded" and len(r.nodes) == 1 \
                and runs.run_path(r.run_id).joinpath(r.nodes[0].node, "out").exists():
            pool[r.run_id] = r
    return pool


def _comm_share(f: RunFigures, one: RunFigures) -> None:
    """Derived where the programs do not time the all-reduce apart (they don't): a one-process run of the
    same job and per-worker batch computes the same step with nothing to all-reduce, so the rest of this
    run's step time is communication and waiting for the other nodes."""
    if one.world != 1 or one.batch != f.batch or not one.step_s or not f.step_s:
        return
    f.comm_share = max(0.0, 1.0 - one.step_s / f.step_s)
    f.comm_share_source = (f"derived: step {f.step_s:.3f} s here vs {one.step_s:.3f} s in one-process run "
                           f"{one.run_id}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def add_scaling(figs: list[RunFigures], records: dict[str, runs.RunRecord], price_kwh: float | None) -> None:
    """Against a one-node run of the same job and settings (among these runs, else any collected one):
    scaling efficiency, images/s on N nodes / (N x images/s on one), and the communication share; end to
    end, this run's figure / the one-node run's: e2e images/s (above 1: this run trains faster), time and
    energy to the target accuracy and wall time (below 1: this run needs less; None where either has none).
    A continued run is compared as the runs it continues and it, joined (its first run's settings, their
    joined figures: `joined` true)."""
    pool = _collected_singles(records)
    singles: dict[str, RunFigures] = {f.run_id: f for f in figs if len(f.nodes) == 1}
    for f in figs:
        if len(f.nodes) < 2 or not f.images_per_s:
            continue
        whole = f.joined if f.joined and "error" not in f.joined else {}
        first = records[f.run_id] if not whole else records.get(whole["runs"][0]) or runs.load(whole["runs"][0])
        cands = [rid for rid, r in pool.items() if len(r.nodes) == 1 and _comparable(r, first)
                 and r.state == "succeeded"]
        if not cands:
            continue
        rid = max(cands, key=lambda x: pool[x].started or 0)
        one = singles.get(rid) or run_figures(pool[rid], price_kwh, f.target_acc)
        if one.images_per_s:
            f.scaling = {"baseline": rid, "baseline_images_per_s": one.images_per_s,
                         "speedup": f.images_per_s / one.images_per_s,
                         "efficiency": f.images_per_s / (len(f.nodes) * one.images_per_s),
                         "baseline_images_per_s_e2e": one.images_per_s_e2e,
                         "baseline_time_to_target_s": one.time_to_target_s,
                         "e2e_speedup": _ratio(whole.get("images_per_s_e2e", f.images_per_s_e2e),
                                               one.images_per_s_e2e),
                         "time_to_target_ratio": _ratio(whole.get("time_to_target_s", f.time_to_target_s),
                                                        one.time_to_target_s),
                         "energy_to_target_ratio": _ratio(whole.get("energy_to_target_kwh", f.energy_to_target_kwh),
                                                          one.energy_to_target_kwh),
                         "wall_ratio": _ratio(whole.get("wall_s", f.wall_s), one.wall_s),
                         "joined": bool(whole)}
        _comm_share(f, one)


def continued_runs(record: runs.RunRecord) -> list[str]:
    """The runs `record` continues (`launch --continue`, each from the one before it), oldest first."""
    chain: list[str] = []
    cur: runs.RunRecord | None = record
    while cur is not None and isinstance(c := cur.extra.get("continues"), dict) and c.get("run") \
            and c["run"] != record.run_id and c["run"] not in chain:
        chain.insert(0, str(c["run"]))
        try:
            cur = runs.load(chain[0])
        except ClusterError:
            cur = None  # not on this head: join_continued says so
    return chain


CURVE_KEYS = ("epoch", "time", "epoch_s", "val_acc", "val_loss", "train_loss")  # an epoch's point on the plot


def join_continued(fig: RunFigures, record: runs.RunRecord, price_kwh: float | None) -> None:
    """A continued run's figures with the runs before it as one run, timed as one: from the first one's
    training start to the target and to this run's last record, the ends, collects, launches and starts
    in between included; samples of every run over that time; energy to the target with each run at its own
    draw (_joined_energy); every run's epochs, for the accuracy plot (`curve`). Where a run before it cannot
    be read, `joined` says which and why, with no figure."""
    chain = continued_runs(record)
    if not chain:
        return
    parts: list[RunFigures] = []
    for rid in chain:
        try:
            parts.append(run_figures(runs.load(rid), price_kwh, fig.target_acc))
        except ClusterError as e:
            fig.joined = {"runs": [*chain, fig.run_id], "error": f"run {rid}: {e.message}"
                          + (f" ({e.fix})" if e.fix else "")}
            return
    parts.append(fig)
    t0 = parts[0].training_start
    if t0 is None or fig.training_start is None or fig.wall_s is None:
        fig.joined = {"runs": [*chain, fig.run_id], "error": "no training start record (a program without "
                      "training metrics): nothing to time them by"}
        return
    hit = next((e for p in parts for e in p.epochs if e["val_acc"] >= fig.target_acc), None)
    wall, to_target = fig.training_start + fig.wall_s - t0, (hit["time"] - t0 if hit is not None else None)
    samples = [p.trained_samples for p in parts]
    total = sum(x for x in samples if x is not None) if all(x is not None for x in samples) else None
    fig.joined = {"runs": [p.run_id for p in parts], "epochs": sum(len(p.epochs) for p in parts),
                  "time_to_target_s": to_target, "wall_s": wall, "trained_samples": total,
                  "images_per_s_e2e": total / wall if total and wall > 0 else None,
                  "energy_to_target_kwh": _joined_energy(parts, t0, hit["time"]) if hit is not None else None,
                  "curve": [{k: e[k] for k in CURVE_KEYS if k in e} for p in parts for e in p.epochs]}


def _joined_energy(parts: list[RunFigures], t0: float, until: float) -> float | None:
    """kWh from t0 to `until` over the joined runs, each at its own draw (its energy / its wall time) from the
    end of the run before it to its own end: the PCs stay on between the runs, waiting for the next one, and a
    run continued on fewer or more PCs draws what those draw. None where a run has no energy figure."""
    total, start = 0.0, t0
    for p in parts:
        if p.energy_kwh is None or not p.wall_s or p.training_start is None:
            return None
        end = p.training_start + p.wall_s
        total += p.energy_kwh / p.wall_s * max(0.0, min(end, until) - start)
        if end >= until:
            break
        start = max(start, end)
    return total


def build(run_ids: list[str], price_kwh: float | None = None,
          target_acc: float = DEFAULT_TARGET_ACC) -> list[RunFigures]:
    records = {r.run_id: r for r in (runs.load(x) for x in run_ids)}
    figs = [run_figures(r, price_kwh, target_acc) for r in records.values()]
    for f in figs:
        join_continued(f, records[f.run_id], price_kwh)
    add_scaling(figs, records, price_kwh)
    return figs
