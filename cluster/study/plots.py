"""The report's plots as PNG (matplotlib, imported only to draw them): accuracy, loss, throughput, step time,
CPU and memory use, $CLUSTER_METRICS. A plot with nothing to draw is left out: the tables say it.
"""
from __future__ import annotations

import io
from typing import Any

from cluster.study.figures import RunFigures


def curve(f: RunFigures) -> tuple[list[float], list[dict[str, Any]], str]:
    """A run's points on the accuracy plot: minutes from its first epoch's start, its epochs, its label. A
    continued run is drawn with the runs it continues, from the first one's start (the gaps between them
    show), as what its user waited for."""
    j = f.joined_figures()
    epochs = j["curve"] if j and j.get("curve") else f.epochs
    t0 = min((e["time"] - e["epoch_s"] for e in epochs), default=0)
    label = f"{f.job} x{len(f.nodes)} ({f.run_id[-4:]}" + (f", {len(j['runs'])} runs)" if j else ")")
    return [(e["time"] - t0) / 60 for e in epochs], epochs, label


def _accuracy_loss(plt: Any, figs: list[RunFigures]) -> Any:
    if not any(len(curve(f)[1]) > 1 for f in figs):
        return None  # a line needs two points
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for f in figs:
        ts, epochs, label = curve(f)
        a1.plot(ts, [e["val_acc"] for e in epochs], marker="o", label=label)
        a2.plot(ts, [e["val_loss"] for e in epochs], marker="o", label=f"{label} val")
        a2.plot(ts, [e["train_loss"] for e in epochs], linestyle="--", alpha=0.6, label=f"{label} train")
    a1.set(xlabel="wall time (min)", ylabel="validation accuracy", title="Accuracy vs wall time")
    a2.set(xlabel="wall time (min)", ylabel="loss (log scale)", title="Loss vs wall time")
    a2.set_yscale("log")  # early validation losses (BatchNorm statistics still settling) dwarf the rest
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    return fig


def _throughput_nodes(plt: Any, figs: list[RunFigures]) -> Any:
    by_job: dict[str, list[tuple[int, float]]] = {}
    for f in figs:
        if f.images_per_s:
            by_job.setdefault(f.job, []).append((len(f.nodes), f.images_per_s))
            if f.scaling:
                by_job[f.job].append((1, f.scaling["baseline_images_per_s"]))
    if not any(len({p[0] for p in pts}) > 1 for pts in by_job.values()):
        return None  # one node count: nothing to draw against the number of nodes (the table has the figure)
    fig, ax = plt.subplots(figsize=(6, 4))
    for job, pts in by_job.items():
        pts = sorted(set(pts))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=job)
    ax.set(xlabel="nodes", ylabel="images/s", title="Throughput vs number of nodes")
    ax.set_xticks(sorted({p[0] for pts in by_job.values() for p in pts}) or [1])
    ax.legend(fontsize=8)
    return fig


def _step_time(plt: Any, figs: list[RunFigures]) -> Any:
    if not any(p.step_s_median for f in figs for p in f.per_node):
        return None
    fig, ax = plt.subplots(figsize=(min(11, max(6, 1.2 * sum(len(f.per_node) for f in figs))), 4))
    labels, values, colors = [], [], []
    for i, f in enumerate(figs):
        for p in f.per_node:
            labels.append(f"{p.node}\n{f.job}\n{f.run_id[-4:]}")
            values.append(p.step_s_median or 0)
            colors.append(f"C{i % 10}")
    ax.bar(range(len(values)), values, color=colors)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set(ylabel="median step time (s)", title="Per-node step time (stragglers stand out)")
    return fig


def _usage(plt: Any, figs: list[RunFigures]) -> Any:
    """Each node's CPU use and memory over the run, as the node agent sampled them."""
    series = [(f, p) for f in figs for p in f.per_node if len([x for x in p.usage if "cpu_percent" in x]) > 1]
    if not series:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for f, p in series:
        t0 = p.usage[0]["t"]
        pts = [x for x in p.usage if "cpu_percent" in x]
        label = f"{p.node} {f.job} ({f.run_id[-4:]})"
        a1.plot([(x["t"] - t0) / 60 for x in pts], [x["cpu_percent"] for x in pts], label=label)
        a2.plot([(x["t"] - t0) / 60 for x in p.usage], [x.get("rss_mb", 0) for x in p.usage], label=label)
    a1.set(xlabel="wall time (min)", ylabel="CPU % (100: one core)", title="CPU use of the run's processes")
    a2.set(xlabel="wall time (min)", ylabel="resident memory (MB)", title="Memory of the run's processes")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    return fig


def _user_metrics(plt: Any, figs: list[RunFigures]) -> Any:
    """Every numeric field a program wrote to $CLUSTER_METRICS, against its `step` (else the line number)."""
    fields = sorted({k for f in figs for recs in f.user_metrics.values() for r in recs for k in r if k != "step"})
    if not fields or not any(len(recs) > 1 for f in figs for recs in f.user_metrics.values()):
        return None
    fig, axes = plt.subplots(1, len(fields[:4]), figsize=(min(11, 4 * len(fields[:4])), 4), squeeze=False)
    for ax, name in zip(axes[0], fields[:4]):  # at most four panels: the page stays readable
        for f in figs:
            for node, recs in f.user_metrics.items():
                pts = [(r.get("step", i), r[name]) for i, r in enumerate(recs) if name in r]
                if len(pts) > 1:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], label=f"{node} ({f.run_id[-4:]})")
        ax.set(xlabel="step", title=name)
        ax.legend(fontsize=7)
    return fig


PLOTS = {"accuracy_loss": _accuracy_loss, "throughput_nodes": _throughput_nodes, "step_time": _step_time,
         "usage": _usage, "user_metrics": _user_metrics}

CAPTIONS = {"accuracy_loss": "Validation accuracy and loss (dashed: training loss) against wall time",
            "throughput_nodes": "Images/s against the number of nodes, per job",
            "step_time": "Median step time per node and run",
            "usage": "CPU use and resident memory of each node's run processes over time (the node agent's samples)",
            "user_metrics": "What the programs wrote to $CLUSTER_METRICS, field by field"}


def pngs(figs: list[RunFigures]) -> dict[str, bytes]:
    """Plot name (PLOTS, CAPTIONS) -> PNG bytes, for each plot with something to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}
    for name, draw in PLOTS.items():
        fig = draw(plt, figs)
        if fig is None:  # nothing to draw, or a single point: the tables say it
            continue
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        out[name] = buf.getvalue()
    return out

