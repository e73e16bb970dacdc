"""`clusterctl report`: collected runs -> the comparison a lab can publish (docs/report.md).

Reads only what `collect` brought to the head (runs/<run-id>/<node>/...), so a
report can be rebuilt offline at any time. Every figure is computed here from
the metrics files, in one place, and shown as tables (terminal, HTML, Markdown,
JSON) and PNG plots (matplotlib); the HTML page embeds its plots.
"""
from __future__ import annotations

import base64
import html
import io
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster import paths, runs
from cluster.errors import UsageError

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
    epochs: list[dict[str, Any]]  # rank 0's epoch records: global loss / accuracy / throughput
    images_per_s: float | None  # median over the epochs after the first (warm-up), else the one epoch
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

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["per_node"] = [dict(n.__dict__) for n in self.per_node]
        return d


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _p90(xs: list[float]) -> float | None:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else None


def _steady(values: list[float]) -> float | None:
    """Median over the epochs after the first (graph tracing, caches, warm-up), or the only one."""
    return _median(values[1:] if len(values) > 1 else values)


def read_metrics(node_dir: Path) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for f in sorted((node_dir / "out").glob("metrics-rank*.jsonl")):
        recs = []
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a stop: everything before it counts
        out[int(f.stem.removeprefix("metrics-rank"))] = recs
    return out


def _hardware(node_dir: Path) -> tuple[str, list[str], int]:
    """'4 cores, 8 GiB, GTX 1050 Ti', GPU names, cores — from the facts collect saved."""
    try:
        f = json.loads((node_dir / "facts.json").read_text())  # NodeFacts.to_dict(), as collect saved it
    except (OSError, ValueError):
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


def _rank0(r0: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]], float | None]:
    """Rank 0's start record, its epoch records (the last of a repeated epoch wins) and the wall time."""
    start = next((x for x in r0 if x["type"] == "start"), {})
    epochs_by_n: dict[int, dict[str, Any]] = {}
    for x in r0:
        if x["type"] == "epoch":
            epochs_by_n[x["epoch"]] = x  # a resumed run may repeat an epoch: the last record wins
    starts = [x["time"] for x in r0 if x["type"] == "start"]
    ends = [x["time"] for x in r0 if x["type"] in ("end", "epoch")]
    wall = (max(ends) - min(starts)) if starts and ends else None
    return start, [epochs_by_n[k] for k in sorted(epochs_by_n)], wall


def _node_figures(node: str, by_rank: dict[int, list[dict[str, Any]]], node_dir: Path,
                  batch: int) -> tuple[NodeFigures, float]:
    """One node's step times, CPU use and power (measured, else estimated from its hardware); the watts
    unrounded, for the energy."""
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
        images_per_s=(batch * len(by_rank) / med) if med else None, cpu_percent=_median(cpu),
        gpu_power_w=statistics.mean(power) if power else None, watts=round(watts, 1),
        watts_source="measured" if power else "estimated", hardware=hw), watts


def _spread_and_energy(fig: RunFigures, watts: list[float], price_kwh: float | None) -> None:
    """The straggler and the step-time spread across nodes; energy (and cost) over the wall time."""
    meds = [(p.step_s_median, p.node) for p in fig.per_node if p.step_s_median]
    if len(meds) > 1:
        fig.step_spread = max(meds)[0] / min(meds)[0]
        fig.straggler = max(meds)[1]
    if fig.wall_s:
        fig.energy_kwh = sum(w * fig.wall_s for w in watts) / 3.6e6
        measured_all = all(p.watts_source == "measured" for p in fig.per_node)
        fig.energy_source = "measured GPU power" if measured_all else "estimated"
        fig.cost = fig.energy_kwh * price_kwh if price_kwh is not None else None


def run_figures(record: runs.RunRecord, price_kwh: float | None = None) -> RunFigures:
    """Every figure of one collected run, from its metrics files on the head."""
    base = runs.run_path(record.run_id)
    nodes = [n.node for n in record.nodes]
    by_node = {n: read_metrics(base / n) for n in nodes}
    ranks = {r: recs for m in by_node.values() for r, recs in m.items()}
    if not ranks:
        raise UsageError(f"run {record.run_id}: no metrics on the head",
                         f"collect them first: clusterctl collect {record.run_id}")
    start, epochs, wall = _rank0(ranks[min(ranks)])
    vals = [e["val_acc"] for e in epochs]
    fig = RunFigures(
        run_id=record.run_id, job=record.job, framework=record.framework, state=record.state,
        nodes=nodes, world=int(start.get("world") or record.world_size or 0),
        batch=int(start.get("batch") or 0), global_batch=int(start.get("global_batch") or 0),
        dataset=str(start.get("dataset")), synthetic=bool(start.get("synthetic")), epochs=epochs,
        images_per_s=_steady([e["images_per_s"] for e in epochs]), epoch_s=_steady([e["epoch_s"] for e in epochs]),
        final_val_acc=vals[-1] if vals else None, best_val_acc=max(vals) if vals else None, wall_s=wall,
        settings=record.settings or {}, started=record.started,
        predicted_images_per_s=(record.prediction or {}).get("planned_images_per_s"))
    per_node = [_node_figures(n, by_node[n], base / n, fig.batch) for n in nodes]
    fig.per_node = [p for p, _ in per_node]
    _spread_and_energy(fig, [w for _, w in per_node], price_kwh)
    return fig


def _comparable(a: runs.RunRecord, b: runs.RunRecord) -> bool:
    """Same job and the same settings except which nodes ran it."""
    skip = {"nodes"}
    return a.job == b.job and {k: v for k, v in (a.settings or {}).items() if k not in skip} \
        == {k: v for k, v in (b.settings or {}).items() if k not in skip}


def add_scaling(figs: list[RunFigures], records: dict[str, runs.RunRecord], price_kwh: float | None) -> None:
    """Efficiency against a one-node run of the same job and settings (among these runs, else any
    collected one): images/s on N nodes / (N x images/s on one)."""
    pool = dict(records)
    for r in runs.scan()[0]:  # a damaged record elsewhere does not stop a report
        if r.run_id not in pool and r.state == "succeeded" and len(r.nodes) == 1 \
                and runs.run_path(r.run_id).joinpath(r.nodes[0].node, "out").exists():
            pool[r.run_id] = r
    singles: dict[str, RunFigures] = {f.run_id: f for f in figs if len(f.nodes) == 1}
    for f in figs:
        if len(f.nodes) < 2 or not f.images_per_s:
            continue
        cands = [rid for rid, r in pool.items() if len(r.nodes) == 1 and _comparable(r, records[f.run_id])
                 and r.state == "succeeded"]
        if not cands:
            continue
        rid = max(cands, key=lambda x: pool[x].started or 0)
        one = singles.get(rid) or run_figures(pool[rid], price_kwh)
        if one.images_per_s:
            f.scaling = {"baseline": rid, "baseline_images_per_s": one.images_per_s,
                         "speedup": f.images_per_s / one.images_per_s,
                         "efficiency": f.images_per_s / (len(f.nodes) * one.images_per_s)}


def build(run_ids: list[str], price_kwh: float | None = None) -> list[RunFigures]:
    records = {r.run_id: r for r in (runs.load(x) for x in run_ids)}
    figs = [run_figures(r, price_kwh) for r in records.values()]
    add_scaling(figs, records, price_kwh)
    return figs


# --------------------------------------------------------------------------- plots


def _accuracy_loss(plt: Any, figs: list[RunFigures]) -> Any:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for f in figs:
        t0 = min((e["time"] - e["epoch_s"] for e in f.epochs), default=0)
        ts = [(e["time"] - t0) / 60 for e in f.epochs]
        label = f"{f.job} x{len(f.nodes)} ({f.run_id[-4:]})"
        a1.plot(ts, [e["val_acc"] for e in f.epochs], marker="o", label=label)
        a2.plot(ts, [e["val_loss"] for e in f.epochs], marker="o", label=f"{label} val")
        a2.plot(ts, [e["train_loss"] for e in f.epochs], linestyle="--", alpha=0.6, label=f"{label} train")
    a1.set(xlabel="wall time (min)", ylabel="validation accuracy", title="Accuracy vs wall time")
    a2.set(xlabel="wall time (min)", ylabel="loss (log scale)", title="Loss vs wall time")
    a2.set_yscale("log")  # early validation losses (BatchNorm statistics still settling) dwarf the rest
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    return fig


def _throughput_nodes(plt: Any, figs: list[RunFigures]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    by_job: dict[str, list[tuple[int, float]]] = {}
    for f in figs:
        if f.images_per_s:
            by_job.setdefault(f.job, []).append((len(f.nodes), f.images_per_s))
            if f.scaling:
                by_job[f.job].append((1, f.scaling["baseline_images_per_s"]))
    for job, pts in by_job.items():
        pts = sorted(set(pts))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=job)
    ax.set(xlabel="nodes", ylabel="images/s", title="Throughput vs number of nodes")
    ax.set_xticks(sorted({p[0] for pts in by_job.values() for p in pts}) or [1])
    ax.legend(fontsize=8)
    return fig


def _step_time(plt: Any, figs: list[RunFigures]) -> Any:
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * sum(len(f.per_node) for f in figs)), 4))
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


PLOTS = {"accuracy_loss": _accuracy_loss, "throughput_nodes": _throughput_nodes, "step_time": _step_time}


def plots(figs: list[RunFigures]) -> dict[str, bytes]:
    """name -> PNG bytes: accuracy and loss vs wall time, images/s vs nodes, per-node step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}
    for name, draw in PLOTS.items():
        fig = draw(plt, figs)
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        out[name] = buf.getvalue()
    return out


# --------------------------------------------------------------------------- tables and pages


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def summary_rows(figs: list[RunFigures]) -> tuple[list[str], list[list[str]]]:
    head = ["run", "job", "framework", "nodes", "world", "global batch", "images/s", "predicted", "epoch s",
            "final val acc",
            "best val acc", "wall s", "scaling eff.", "step spread", "energy kWh", "cost"]
    rows = [[f.run_id, f.job, f.framework, str(len(f.nodes)), str(f.world), str(f.global_batch),
             _f(f.images_per_s),
             _f(f.predicted_images_per_s) + (f" ({f.images_per_s / f.predicted_images_per_s - 1:+.0%})"
                                              if f.predicted_images_per_s and f.images_per_s else ""),
             _f(f.epoch_s), _f(f.final_val_acc, "{:.4f}"), _f(f.best_val_acc, "{:.4f}"),
             _f(f.wall_s, "{:.0f}"), _f(f.scaling["efficiency"] if f.scaling else None, "{:.2f}"),
             _f(f.step_spread, "{:.2f}"), _f(f.energy_kwh, "{:.4f}"), _f(f.cost, "{:.4f}")] for f in figs]
    return head, rows


def node_rows(f: RunFigures) -> tuple[list[str], list[list[str]]]:
    head = ["node", "hardware", "ranks", "median step s", "p90 step s", "data s", "images/s", "CPU %",
            "GPU W", "watts (source)"]
    rows = [[p.node, p.hardware, ",".join(map(str, p.ranks)), _f(p.step_s_median, "{:.3f}"),
             _f(p.step_s_p90, "{:.3f}"), _f(p.data_s_median, "{:.4f}"), _f(p.images_per_s),
             _f(p.cpu_percent, "{:.0f}"), _f(p.gpu_power_w), f"{p.watts:.0f} ({p.watts_source})"]
            for p in f.per_node]
    return head, rows


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    e = html.escape
    return ("<table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
            + "</tbody></table>")


CAPTIONS = {"accuracy_loss": "Validation accuracy and loss (dashed: training loss) against wall time",
            "throughput_nodes": "Images/s against the number of nodes, per job",
            "step_time": "Median step time per node and run"}


def html_page(figs: list[RunFigures], images: dict[str, bytes], price_kwh: float | None) -> str:
    e = html.escape
    head, rows = summary_rows(figs)
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>clusterctl report</title><style>",
             "body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}"
             "th,td{border:1px solid #bbb;padding:3px 7px;font-size:13px;text-align:right}"
             "th{background:#eee}td:first-child,th:first-child{text-align:left}img{max-width:100%}"
             "figure{margin:1em 0}figcaption{font-size:13px;color:#444}</style></head><body>",
             "<h1>ResNet50 study: PyTorch DDP vs TensorFlow MWMS</h1>",
             f"<p>{len(figs)} run(s). Throughput and epoch time are medians over the epochs after the first; "
             "scaling efficiency compares with a one-node run of the same job and settings; energy is "
             + ("measured GPU power plus an estimate for the rest of the PC" if any(
                 f.energy_source != "estimated" for f in figs) else "estimated from the hardware (docs/report.md)")
             + (f"; cost at {price_kwh:g} per kWh" if price_kwh is not None else "") + ".</p>",
             "<h2>Runs</h2>", _html_table(head, rows)]
    for f in figs:
        nh, nr = node_rows(f)
        parts.append(f"<h2>{e(f.run_id)}</h2><p>{e(f.job)} ({e(f.framework)}), {len(f.nodes)} node(s), "
                     f"world size {f.world}, batch {f.batch}/worker, dataset {e(f.dataset)}"
                     + (" (synthetic: accuracy is meaningless)" if f.synthetic else "")
                     + f", state {e(f.state)}"
                     + (f"; slowest node {e(f.straggler)} (spread {f.step_spread:.2f}x)" if f.straggler else "")
                     + "</p>")
        parts.append(_html_table(nh, nr))
        eh = ["epoch", "step", "train loss", "train acc", "val loss", "val acc", "epoch s", "images/s"]
        er = [[str(x["epoch"]), str(x["step"]), f"{x['train_loss']:.4f}", f"{x['train_acc']:.4f}",
               f"{x['val_loss']:.4f}", f"{x['val_acc']:.4f}", f"{x['epoch_s']:.1f}", f"{x['images_per_s']:.1f}"]
              for x in f.epochs]
        parts.append(_html_table(eh, er))
    parts.append("<h2>Plots</h2>")
    for name, png in images.items():
        parts.append(f"<figure><img alt='{e(CAPTIONS.get(name, name))}' "
                     f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
                     f"<figcaption>{e(CAPTIONS.get(name, name))}</figcaption></figure>")
    parts.append("</body></html>\n")
    return "".join(parts)


def markdown_page(figs: list[RunFigures], image_dir: Path, images: dict[str, bytes]) -> str:
    def table(head: list[str], rows: list[list[str]]) -> str:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(r) + " |" for r in rows])

    image_dir.mkdir(parents=True, exist_ok=True)
    parts = ["# ResNet50 study: PyTorch DDP vs TensorFlow MWMS", "", table(*summary_rows(figs)), ""]
    for f in figs:
        parts += [f"## {f.run_id}", "", table(*node_rows(f)), ""]
    for name, png in images.items():
        (image_dir / f"{name}.png").write_bytes(png)
        parts += [f"![{CAPTIONS.get(name, name)}]({image_dir.name}/{name}.png)", ""]
    return "\n".join(parts)


def default_page(figs: list[RunFigures]) -> Path:
    """Where a report goes when no path is given: beside the run for one, else a dated page under reports/."""
    if len(figs) == 1:
        return runs.run_path(figs[0].run_id) / "report.html"
    return paths.home() / "reports" / f"report-{time.strftime('%Y%m%d-%H%M%S')}.html"


def write_pages(run_ids: list[str], *, html: Path | None, markdown: Path | None, price_kwh: float | None,
                target_acc: float = 0.9) -> tuple[list[RunFigures], list[Path]]:
    """Build the figures and plots and write the pages (HTML by default); the figures and the resolved paths
    written. Markdown gets its plots as PNG files in <stem>-plots/ beside it."""
    figs = build(run_ids, price_kwh=price_kwh)
    images = plots(figs)
    if html is None and markdown is None:
        html = default_page(figs)
    written: list[Path] = []
    if html is not None:
        html.parent.mkdir(parents=True, exist_ok=True)
        html.write_text(html_page(figs, images, price_kwh))
        written.append(html.resolve())
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(markdown_page(figs, markdown.parent / f"{markdown.stem}-plots", images))
        written.append(markdown.resolve())
    return figs, written
