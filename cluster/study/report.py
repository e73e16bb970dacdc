"""`clusterctl report`: collected runs -> the tables and pages a lab can publish (docs/report.md).

Reads only what `collect` brought to the head (runs/<run-id>/<node>/...), so a report can be rebuilt offline
at any time. The figures (comparison.build) in words: the tables and paragraphs of the terminal, the HTML
page (which embeds its plots, plots.py) and the Markdown page (its plots beside it).
"""
from __future__ import annotations

import base64
import html
import time
from pathlib import Path
from typing import Any

from cluster import paths
from cluster.runs import records
from cluster.study.comparison import build
from cluster.study.figures import DEFAULT_TARGET_ACC, RunFigures
from cluster.study.plots import CAPTIONS, pngs


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _mb(x: int | None) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


def _scheme(f: RunFigures) -> str:
    """The gradient compression in effect, as a table cell: 'none', 'fp16', 'powersgd r2' ('powersgd r2 bf16'
    on a bfloat16 wire); '-' unrecorded."""
    if f.grad_compression is None:
        return "-"
    return (f.grad_compression + (f" r{f.powersgd_rank}" if f.powersgd_rank else "")
            + (" bf16" if f.powersgd_wire == "bfloat16" else ""))


def _whole(f: RunFigures) -> tuple[float | None, float | None, float | None, int]:
    """Time to the target, end-to-end images/s and wall time of what the user ran: a continued run's with
    the runs it continues (RunFigures.joined), else its own; and how many runs that is."""
    j = f.joined_figures()
    if j:
        return j["time_to_target_s"], j["images_per_s_e2e"], j["wall_s"], len(j["runs"])
    return f.time_to_target_s, f.images_per_s_e2e, f.wall_s, 1


def _reached(f: RunFigures) -> str:
    if not f.epochs:
        return "-"
    t, _, _, n = _whole(f)
    return "not reached" if t is None else f"{t:.0f}" + (f" ({n} runs)" if n > 1 else "")


def _e2e(f: RunFigures) -> str:
    _, e2e, _, n = _whole(f)
    return _f(e2e) + (f" ({n} runs)" if n > 1 and e2e is not None else "")


def _continues(f: RunFigures) -> str:
    """For a continued run: which runs it continues, and that its figures are theirs together."""
    j = f.joined
    if not j:
        return ""
    before = ", ".join(j["runs"][:-1])
    if "error" in j:
        return f"It continues {before}; their figures are not joined: {j['error']}. "
    return (f"It continues {before}: its time to the target and end-to-end figures are the {len(j['runs'])} runs "
            f"as one, {j['epochs']} epochs from the first one's training start (every end, collect, launch and "
            "start between them included). ")


def _vs_one(f: RunFigures) -> str:
    """This run's time to the target / the one-node run's, as a cell: '0.45x' (below 1: this run is faster)."""
    if not f.scaling or not f.epochs:
        return "-"
    ratio = f.scaling.get("time_to_target_ratio")
    if ratio is not None:
        return f"{ratio:.2f}x"
    return "not reached" if _whole(f)[0] is None else "1 node: not reached"


def _summary_row(f: RunFigures) -> list[str]:
    predicted = _f(f.predicted_images_per_s) + (f" ({f.images_per_s / f.predicted_images_per_s - 1:+.0%})"
                                                if f.predicted_images_per_s and f.images_per_s else "")
    return [f.run_id, f.job, f.framework, str(len(f.nodes)), str(f.world), str(f.global_batch),
            _f(f.images_per_s), _e2e(f), _f(f.cpu_cores_process, "{:.2f}"), predicted, _f(f.epoch_s),
            _f(f.final_val_acc, "{:.4f}"), _f(f.best_val_acc, "{:.4f}"), _reached(f), _vs_one(f),
            _f(f.wall_s, "{:.0f}"),
            _f(f.scaling["efficiency"] if f.scaling else None, "{:.2f}"),
            _f(f.scaling.get("e2e_speedup") if f.scaling else None, "{:.2f}x"), _f(f.comm_share, "{:.0%}"),
            _mb(f.bytes_sent_per_step), _scheme(f), _f(f.accumulate, "{:d}"), _f(f.step_spread, "{:.2f}"),
            _f(f.energy_kwh, "{:.4f}"), _f(f.cost, "{:.4f}")]


def own_program(f: RunFigures) -> bool:
    """A run of a user's own program: no epochs of the built-in programs, so their words do not apply."""
    return f.settings.get("code") is not None and not f.epochs


def _own_row(f: RunFigures) -> list[str]:
    cpu = [p.cpu_percent for p in f.per_node if p.cpu_percent is not None]
    peak = [p.rss_mb_peak for p in f.per_node if p.rss_mb_peak is not None]
    return [f.run_id, f.job, str(f.settings.get("launcher")), str(len(f.nodes)), str(f.world), f.state,
            _f(f.wall_s, "{:.0f}"), " ".join(f"{p.node}:{_f(p.exit_code, '{:d}')}" for p in f.per_node) or "-",
            _f(sum(cpu) / len(cpu) if cpu else None, "{:.0f}"), _f(max(peak) if peak else None, "{:.0f}"),
            str(sum(len(v) for v in f.user_metrics.values())), _f(f.energy_kwh, "{:.4f}"), _f(f.cost, "{:.4f}")]


def summary_rows(figs: list[RunFigures]) -> tuple[list[str], list[list[str]]]:
    """One row per run: throughput (steady and end to end) beside CPU use, accuracy and time to the target
    accuracy (also against one node), scaling and communication, energy. SUMMARY_NOTE says which way the
    ratio goes. Runs of users' own programs only: what such a run has (wall time, exit codes, CPU, memory,
    $CLUSTER_METRICS records, energy)."""
    if figs and all(own_program(f) for f in figs):
        return OWN_HEAD, [_own_row(f) for f in figs]
    target = figs[0].target_acc if figs else DEFAULT_TARGET_ACC
    head = ["run", "job", "framework", "nodes", "world", "global batch", "images/s", "e2e images/s",
            "CPU cores/proc", "predicted", "epoch s", "final val acc", "best val acc", f"s to val acc {target:g}",
            "time to target vs 1 node", "wall s",
            "scaling eff.", "e2e speed-up vs 1 node", "comm. share", "MB sent/step", "compression", "accumulate",
            "step spread",
            "energy kWh", "cost"]
    return head, [_summary_row(f) for f in figs]


OWN_HEAD = ["run", "job", "launcher", "nodes", "world", "state", "wall s", "exit codes", "CPU %", "peak MB",
            "metrics records", "energy kWh", "cost"]
SUMMARY_NOTE = ("images/s: steady, the median over the epochs after the first; e2e images/s: every trained "
                "sample / wall s (the first epoch, warm-up and restarts included). time to target vs 1 node: this "
                "run's s to the target val acc / that of a one-node run of the same job and settings; below 1x "
                "this run is faster (0.45x: 2.2x faster), above 1x one node is faster end to end.")


def _end_to_end(f: RunFigures) -> str:
    """The run's end-to-end throughput and, against a one-node run, which is faster to the target: sentences."""
    to_target, e2e, wall, n = _whole(f)
    if e2e is None:
        return _continues(f)
    s = f.scaling or {}
    speedup = s.get("e2e_speedup")
    out = _continues(f) + (
        f"End to end {e2e:.1f} images/s (every trained sample / the {wall or 0:.0f} s wall time, first epoch and "
        f"any restart included{', of the runs together' if n > 1 else ''}; steady {_f(f.images_per_s)})"
        + (f", {speedup:.2f}x one node's" if speedup is not None else "") + ". ")
    if not s:
        return out
    rid, target, ratio = s["baseline"], f"{f.target_acc:g}", s.get("time_to_target_ratio")
    one_faster = ": one node is faster end to end"
    if ratio is not None:
        energy = s.get("energy_to_target_ratio")
        out += (f"It reaches {target} in {ratio:.2f}x the time of one node ({rid})"
                + (one_faster if ratio > 1 else f": {1 / ratio:.1f}x faster end to end" if ratio < 1
                   else ": as fast as one node")
                + (f", with {energy:.2f}x its energy" if energy is not None else "") + ". ")
    elif to_target is not None:
        out += f"One node ({rid}) did not reach {target}; this run did. "
    elif s.get("baseline_time_to_target_s") is not None:
        out += (f"It does not reach {target}; one node ({rid}) does, after {s['baseline_time_to_target_s']:.0f} s"
                f"{one_faster}. ")
    else:
        out += (f"Neither it nor one node ({rid}) reaches {target}"
                + (one_faster if speedup is not None and speedup < 1 else "") + ". ")
    return out


def run_line(f: RunFigures) -> str:
    """The run's setting and its communication and convergence in words, with where each figure came from."""
    if own_program(f):
        n = sum(len(v) for v in f.user_metrics.values())
        return (f"{f.job}: your program ({f.settings.get('launcher')}), {len(f.nodes)} node(s), world size {f.world}, "
                f"state {f.state}, {_f(f.wall_s, '{:.0f}')} s wall. "
                + (f"{n} $CLUSTER_METRICS record(s), plotted above." if n else "No $CLUSTER_METRICS records (a "
                   "program may append JSON lines there, docs/metrics.md).")
                + " Exit code, CPU and memory per node below.")
    comm = (f"communication {f.comm_share:.0%} of the step time ({f.comm_share_source})" if f.comm_share is not None
            else "communication share unknown (the programs do not time the all-reduce apart, and no one-process "
                 "run of the same job, settings and batch per worker was found to compare with)")
    sent = ("One process: nothing all-reduced" if f.world == 1 else
            "Bytes per step not recorded" if f.bytes_sent_per_step is None else
            f"{_mb(f.bytes_sent_per_step)} MB sent per step and rank (ring all-reduce of "
            f"{_mb(f.allreduce_payload_bytes)} MB, compression {_scheme(f)}, {f.accumulate or 1} micro-batch(es) "
            "per all-reduce)")
    to_target, _, _, n = _whole(f)
    reached = ("not reached" if to_target is None else f"reached after {to_target:.0f} s"
               + (f" (the {n} runs together)" if n > 1 else ""))
    reached += "" if f.epochs else " (no epoch finished)"
    return (f"{f.job} ({f.framework}), {len(f.nodes)} node(s), world size {f.world}, batch {f.batch}/worker, "
            f"dataset {f.dataset}" + (" (synthetic: accuracy is meaningless)" if f.synthetic else "")
            + f", {len(f.epochs)} epoch(s) trained, state {f.state}"
            + (f"; slowest node {f.straggler} (spread {f.step_spread:.2f}x)" if f.straggler else "")
            + f". {sent}; {comm}. Validation accuracy {f.target_acc:g} {reached}. " + _end_to_end(f)
            + ("CPU use not recorded." if f.cpu_cores_process is None
               else f"{f.cpu_cores_process:.2f} cores busy per training process.")
            + (f" Its {len(f.nodes)} nodes are one machine (one kernel: a simulated lab) and share its cores, so "
               "its scaling shows the method, not what as many separate PCs give." if f.one_machine else "")
            + (f" The membership changed: {len(f.periods)} periods (below); world size and batch are period 1's, "
               "images/s and epoch s the medians over every period's epochs, wall s from period 1's start, e2e "
               "images/s every epoch's samples once over that wall time."
               if len(f.periods) > 1 else ""))


def _span(epochs: list[int]) -> str:
    """0, 1, 2, 5 -> '0-2, 5'."""
    runs: list[list[int]] = []
    for e in epochs:
        if runs and e == runs[-1][1] + 1:
            runs[-1][1] = e
        else:
            runs.append([e, e])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


def _clock(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "-"


def period_rows(f: RunFigures) -> tuple[list[str], list[list[str]]]:
    """One row per membership period: who ran it, where it resumed, what it did, what the change cost."""
    head = ["period", "nodes", "world", "from epoch / step", "epochs", "images/s", "wall s", "lost to the change s",
            "why it began"]
    rows = [[str(p.period), ", ".join(p.nodes) or "-", _f(p.world, "{:d}"),
             f"{_f(p.from_epoch, '{:d}')} / {_f(p.from_step, '{:d}')}", _span(p.epochs), _f(p.images_per_s),
             _f(p.wall_s, "{:.0f}"), _f(p.gap_s, "{:.0f}"), p.reason or "-"] for p in f.periods]
    return head, rows


def dropped_lines(f: RunFigures) -> list[str]:
    """The nodes the run went on without, a line each: why, when, and whether they came back."""
    out = []
    for node, d in f.dropped.items():
        period = d.get("period")
        back = d.get("came_back")
        out.append(f"{node} dropped at {_clock(d.get('at'))}"
                   + (f" (period {period})" if isinstance(period, int) else "")
                   + f": {d.get('why') or 'no reason recorded'}"
                   + (f"; came back at {_clock(back)}, kept out of this run" if back is not None else ""))
    return out


def node_rows(f: RunFigures) -> tuple[list[str], list[list[str]]]:
    head = ["node", "hardware", "ranks", "exit", "median step s", "p90 step s", "data s", "images/s", "CPU %",
            "peak MB", "CPU J (RAPL)", "GPU W", "watts (source)"]
    rows = [[p.node, p.hardware, ",".join(map(str, p.ranks)) or "-", _f(p.exit_code, "{:d}"),
             _f(p.step_s_median, "{:.3f}"), _f(p.step_s_p90, "{:.3f}"), _f(p.data_s_median, "{:.4f}"),
             _f(p.images_per_s), _f(p.cpu_percent, "{:.0f}"), _f(p.rss_mb_peak, "{:.0f}"),
             _f(p.cpu_energy_j, "{:.0f}"), _f(p.gpu_power_w), f"{p.watts:.0f} ({p.watts_source})"]
            for p in f.per_node]
    if own_program(f):  # the built-in programs' step timings mean nothing here
        keep = [i for i, h in enumerate(head) if h not in ("ranks", "median step s", "p90 step s", "data s",
                                                            "images/s")]
        return [head[i] for i in keep], [[r[i] for i in keep] for r in rows]
    return head, rows


def title(figs: list[RunFigures]) -> str:
    """The study's title, naming the models the runs trained (a ResNet18 study is not called ResNet50's),
    when every run is a training run of the built-in programs; else a plain one."""
    if not figs or not all(f.epochs or f.settings.get("code") is None for f in figs):
        return "Runs on the cluster"
    names = {"resnet50" if f.framework == "tensorflow" else str(f.settings.get("model", "resnet50")) for f in figs}
    models = " and ".join(sorted(n.replace("resnet", "ResNet") for n in names))
    kinds = [v for k, v in (("pytorch", "PyTorch DDP"), ("tensorflow", "TensorFlow MWMS"))
             if any(f.framework == k for f in figs)]
    return f"{models} study: {' vs '.join(kinds)}" if kinds else f"{models} study"


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    e = html.escape
    return ("<table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
            + "</tbody></table>")


def _split(head: list[str], rows: list[list[str]], at: str) -> list[tuple[list[str], list[list[str]]]]:
    """One wide table as two, both led by the first column: a page 1280 px wide shows each whole."""
    if at not in head:  # a narrow table (users' own programs)
        return [(head, rows)]
    cut = head.index(at)
    return [(head[:cut], [r[:cut] for r in rows]), (head[:1] + head[cut:], [r[:1] + r[cut:] for r in rows])]


def html_page(figs: list[RunFigures], images: dict[str, bytes], price_kwh: float | None) -> str:
    e = html.escape
    head, rows = summary_rows(figs)
    own = head == OWN_HEAD  # users' own programs only: their plots first (their metrics first), no built-in wording
    images = dict(sorted(images.items(), key=lambda kv: kv[0] != "user_metrics")) if own else images
    energy = ("measured GPU power plus an estimate for the rest of the PC" if any(
        f.energy_source != "estimated" for f in figs) else "estimated from the hardware (docs/report.md)")
    intro = (f"{len(figs)} run(s) of your own program: wall time, exit codes, CPU and memory per node, what the "
             f"program appended to $CLUSTER_METRICS; energy is {energy}" if own else
             f"{len(figs)} run(s). Throughput (images/s) and epoch time are medians over the epochs after the "
             "first; end-to-end throughput (e2e images/s) is every trained sample over the wall time; "
             "scaling efficiency and the communication share compare with a one-node run of the same job and "
             f"settings; time to the target accuracy counts from the run's start; energy is {energy}")
    plots = ["<h2>Plots</h2>"] + [f"<figure><img alt='{e(CAPTIONS.get(name, name))}' "
                                  f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
                                  f"<figcaption>{e(CAPTIONS.get(name, name))}</figcaption></figure>"
                                  for name, png in images.items()]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><meta name='generator' content='{paths.WRITTEN_BY}'>"
             "<title>clusterctl report</title><style>",
             "body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}"
             "th,td{border:1px solid #bbb;padding:3px 7px;font-size:13px;text-align:right}th{white-space:normal}"
             "th{background:#eee}td:first-child,th:first-child{text-align:left}img{max-width:100%}"
             "figure{margin:1em 0}figcaption{font-size:13px;color:#444}</style></head><body>",
             f"<h1>{e(title(figs))}</h1>",
             f"<p>{e(intro)}" + (f"; cost at {price_kwh:g} per kWh" if price_kwh is not None else "") + ".</p>",
             "<h2>Runs</h2>", *(_html_table(h, r) for h, r in _split(head, rows, "final val acc")),
             *(plots if own else [f"<p>{e(SUMMARY_NOTE)}</p>"])]
    for f in figs:
        nh, nr = node_rows(f)
        parts.append(f"<h2>{e(f.run_id)}</h2><p>{e(run_line(f))}</p>")
        if len(f.periods) > 1:
            parts.append("<h3>Membership periods</h3>" + _html_table(*period_rows(f)))
        if f.dropped:  # also a run that failed to go on without them (one period)
            parts.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in dropped_lines(f)) + "</ul>")
        parts.append(_html_table(nh, nr))
        if f.epochs:
            eh = ["epoch", "step", "train loss", "train acc", "val loss", "val acc", "epoch s", "images/s"]
            er = [[str(x["epoch"]), str(x["step"]), f"{x['train_loss']:.4f}", f"{x['train_acc']:.4f}",
                   f"{x['val_loss']:.4f}", f"{x['val_acc']:.4f}", f"{x['epoch_s']:.1f}", f"{x['images_per_s']:.1f}"]
                  for x in f.epochs]
            parts.append(_html_table(eh, er))
    parts += [] if own else plots
    parts.append("</body></html>\n")
    return "".join(parts)


def markdown_page(figs: list[RunFigures], image_dir: Path, images: dict[str, bytes]) -> str:
    def table(head: list[str], rows: list[list[str]]) -> str:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(r) + " |" for r in rows])

    image_dir.mkdir(parents=True, exist_ok=True)
    head, rows = summary_rows(figs)
    parts = [f"<!-- {paths.WRITTEN_BY} -->", f"# {title(figs)}", "", table(head, rows), ""]
    own = head == OWN_HEAD  # users' own programs only: their plots first (their metrics first)
    plots = []
    for name, png in sorted(images.items(), key=lambda kv: own and kv[0] != "user_metrics"):
        (image_dir / f"{name}.png").write_bytes(png)
        plots += [f"![{CAPTIONS.get(name, name)}]({image_dir.name}/{name}.png)", ""]
    parts += plots if own else [SUMMARY_NOTE, ""]
    for f in figs:
        parts += [f"## {f.run_id}", "", run_line(f), ""]
        if len(f.periods) > 1:
            parts += ["### Membership periods", "", table(*period_rows(f)), ""]
        if f.dropped:
            parts += [*(f"- {x}" for x in dropped_lines(f)), ""]
        parts += [table(*node_rows(f)), ""]
    return "\n".join(parts + ([] if own else plots))


def write_pages(run_ids: list[str], *, html: Path | None, markdown: Path | None, price_kwh: float | None,
                target_acc: float = DEFAULT_TARGET_ACC) -> tuple[list[RunFigures], list[Path]]:
    """Build the figures and plots and write the pages (HTML by default); the figures and the resolved paths
    written. `target_acc`: the validation accuracy whose time to reach is shown. Markdown gets its plots as
    PNG files in <stem>-plots/ beside it."""
    figs = build(run_ids, price_kwh=price_kwh, target_acc=target_acc)
    images = pngs(figs)
    if html is None and markdown is None:  # beside the run for one, else a dated page under reports/
        html = (records.run_path(figs[0].run_id) / "report.html" if len(figs) == 1
                else paths.home() / "reports" / f"report-{time.strftime('%Y%m%d-%H%M%S')}.html")
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
