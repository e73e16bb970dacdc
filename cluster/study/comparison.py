"""The runs' figures set against each other (docs/report.md): a run against a one-node run of the same job
and settings (scaling, the communication share, end-to-end ratios), and a continued run joined with the
runs it continues, timed as what its user waited. `build` gives the figures of the runs a report shows.
"""
from __future__ import annotations

from cluster.errors import ClusterError
from cluster.runs import jobs, records as runs, schema
from cluster.study.figures import DEFAULT_TARGET_ACC, RunFigures, run_figures


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
        whole = f.joined_figures() or {}
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
    """The figures of the runs a report shows, each against the others and against the runs before it."""
    records = {r.run_id: r for r in (runs.load(x) for x in run_ids)}
    figs = [run_figures(r, price_kwh, target_acc) for r in records.values()]
    for f in figs:
        join_continued(f, records[f.run_id], price_kwh)
    add_scaling(figs, records, price_kwh)
    return figs
