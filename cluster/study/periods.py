"""A run's membership periods (docs/report.md), from its metrics files and the head's run record.

A run that lost a node and went on without it (cluster/runs/elastic.py) has several membership periods,
each with its own ranks: rank 0 of period 2 may write in another node's folder than rank 0 of period 1,
and a node that kept its rank appends the new period's records after the old ones. So every metrics file
is split into its periods (each `start` record names its `period`, 1 when absent) and rank 0's records
are merged from every node folder before anything is computed from them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.runs import records as runs
from cluster.study.node_figures import Record


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


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _time(x: Record) -> float:
    t = _num(x.get("time"))
    return float("-inf") if t is None else t


def split_periods(recs: list[Record]) -> dict[int, list[Record]]:
    """One metrics file's records by period: each start record opens its period (1 when it names none: runs
    from before periods); what comes before any start record (a file cut at its head) counts to period 1."""
    out: dict[int, list[Record]] = {}
    period = 1
    for x in recs:
        if x.get("type") == "start":
            p = _int(x.get("period"))
            period = p if p is not None and p >= 1 else 1
        out.setdefault(period, []).append(x)
    return out


def series(by_node: dict[str, dict[int, list[Record]]]) -> list[SeriesRecords]:
    """Every (node folder, rank file, period) of the run's metrics."""
    return [SeriesRecords(n, r, k, recs) for n, m in by_node.items() for r in sorted(m)
            for k, recs in sorted(split_periods(m[r]).items())]


def lead(series: list[SeriesRecords]) -> dict[int, list[Record]]:
    """Rank 0's records per period, from every node folder (a restart may give rank 0 to another node),
    in time order. A period whose rank 0 left nothing on the head (its node was not collected) takes its
    lowest collected rank: every rank writes the same all-reduced epoch figures."""
    out: dict[int, list[Record]] = {}
    for k in sorted({s.period for s in series}):
        mine = [s for s in series if s.period == k]
        low = min(s.rank for s in mine)
        out[k] = sorted((x for s in mine if s.rank == low for x in s.records), key=_time)
    return out


def node_processes(series: list[SeriesRecords], node: str, files: int) -> int:
    """A node's training processes at a time: its rank files, or where its ranks changed with the
    membership, the most it ran in one period."""
    per = [s.period for s in series if s.node == node]
    return max(per.count(k) for k in set(per)) if len(set(per)) > 1 else files


def _recorded(record: runs.RunRecord) -> dict[int, dict[str, Any]]:
    """The run record's periods by number (none: a record from before periods)."""
    return {p["period"]: p for p in record.periods if isinstance(p.get("period"), int) and p["period"] >= 1}


def _names(x: Any) -> list[str]:
    return [n for n in x if isinstance(n, str)] if isinstance(x, list) else []


def _start_nodes(series: list[SeriesRecords], k: int) -> list[str]:
    """Period k's nodes in rank order, from the folders its start records are in."""
    starts = sorted((s.rank, s.node) for s in series
                    if s.period == k and any(x.get("type") == "start" for x in s.records))
    return list(dict.fromkeys(n for _, n in starts))


def from_metrics(record: runs.RunRecord, series: list[SeriesRecords], lead: dict[int, list[Record]],
                 run_nodes: list[str]) -> list[PeriodFigures]:
    """Each membership period's figures: its nodes and reason from the run record (else its start
    records), the rest from rank 0's records of that period."""
    recorded = _recorded(record)
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
        samples = sum(_epoch_samples(x, start) or 0.0 for x in ep)
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


def from_head(record: runs.RunRecord, nodes: list[str], wall: float | None) -> list[PeriodFigures]:
    """A run without training metrics: its periods as the head recorded them (its times), else one."""
    recorded = _recorded(record)
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


def _epoch_samples(epoch: Record, start: Record) -> float | None:
    """The samples one epoch record trained: steps_per_epoch x global_batch of the start record of the period
    that wrote it (exact: what the program ran, and what its images_per_s divides), else images_per_s x
    epoch_s (both rounded in the record: a few samples off); None when neither is recorded."""
    steps, batch = _int(start.get("steps_per_epoch")), _int(start.get("global_batch"))
    if steps and batch:
        return float(steps * batch)
    ips, secs = _num(epoch.get("images_per_s")), _num(epoch.get("epoch_s"))
    return ips * secs if ips is not None and secs is not None else None


def run_samples(lead: dict[int, list[Record]]) -> float | None:
    """Every epoch's samples once, from rank 0's records per period (`lead`): an epoch redone after a restart
    counts as its later record (the one the epoch table shows), so the work lost to the restart is wall time
    without samples. None without epochs, or when an epoch's samples are not recorded."""
    by_n: dict[Any, float | None] = {}
    for k in sorted(lead):
        start = next((x for x in lead[k] if x.get("type") == "start"), {})
        for x in lead[k]:
            if x.get("type") == "epoch":
                by_n[x.get("epoch")] = _epoch_samples(x, start)
    vals = list(by_n.values())
    return sum(v for v in vals if v is not None) if vals and None not in vals else None
