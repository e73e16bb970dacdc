"""Collect's path checks and the report's figures, on files written here (no lab needed)."""
from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest

from cluster.study import comparison, figures, plots, report
from cluster.runs import collect, records
from tests import goldens
from tests.conftest import ROOT

GOLDEN_PAGE = ROOT / "tests" / "golden" / "report" / "structure.txt"
GOLDEN_RECORDED = ROOT / "tests" / "golden" / "report" / "recorded.md"
RECORDED = ROOT / "tests" / "fixtures" / "report" / "runs"  # real runs: 3-node DDP and TF, 1-process DDP
DDP3, TF3, DDP1 = "resnet50-ddp-20261130-140038-7bbd", "resnet50-tf-20261130-140322-bcf8", "resnet50-ddp-20261130-145756-1prc"


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "out/../../x", "a//b", "", "./../x", "out/\0x"])
def test_paths_that_climb_or_are_absolute_are_refused(tmp_path: Path, rel: str) -> None:
    with pytest.raises(collect.UnsafePath):
        collect.safe_dest(tmp_path / "run" / "node1", rel)


def test_a_symlink_already_on_the_head_is_not_followed(tmp_path: Path) -> None:
    base = tmp_path / "run" / "node1"
    (base / "out").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (base / "out" / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(collect.UnsafePath, match="resolves outside|symbolic link"):
        collect.safe_dest(base, "out/link/file")
    assert collect.safe_dest(base, "out/metrics-rank0.jsonl") == base / "out" / "metrics-rank0.jsonl"


def _write_run(home: Path, run_id: str, nodes: list[str], ips: list[float], val: list[float], job: str = "j",
               settings: dict | None = None, power: float | None = None) -> dict:
    rec = {"run_id": run_id, "job": job, "framework": "pytorch", "state": "succeeded", "created": 1, "started": 1,
           "world_size": len(nodes), "settings": settings or {"epochs": len(val)},
           "nodes": [{"node": n, "node_rank": i, "nproc": 1, "run_dir": f"/srv/runs/{run_id}"}
                     for i, n in enumerate(nodes)],
           "inventory": {"hosts": [{"name": n, "address": f"10.0.0.{i + 1}"} for i, n in enumerate(nodes)]}}
    records.save(records.RunRecord.from_dict(rec))
    for r, n in enumerate(nodes):
        out = records.run_path(run_id) / n / "out"
        out.mkdir(parents=True)
        lines = [{"type": "start", "time": 100.0, "world": len(nodes), "batch": 32, "global_batch": 32 * len(nodes),
                  "dataset": "digits", "synthetic": False}]
        for s in range(1, 5):
            lines.append({"type": "step", "time": 100.0 + s, "epoch": 0, "step": s, "loss": 1.0,
                          "data_s": 0.01, "compute_s": 0.5 * (r + 1)})
        for e, (i, v) in enumerate(zip(ips, val)):
            ep = {"type": "epoch", "time": 110.0 + 10 * e, "epoch": e, "step": 4 * (e + 1), "train_loss": 1.0 / (e + 1),
                  "train_acc": v, "val_loss": 1.5 / (e + 1), "val_acc": v, "epoch_s": 10.0, "images_per_s": i,
                  "cpu_percent_node": 50.0}
            if power is not None:
                ep["gpus"] = [{"index": 0, "power_w": power}]
            lines.append(ep)
        lines.append({"type": "end", "time": 110.0 + 10 * len(val), "step": 4 * len(val)})
        (out / f"metrics-rank{r}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"cut")
    return rec


def test_report_figures_come_from_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _write_run(tmp_path, "one", ["a"], [50.0, 60.0, 62.0], [0.2, 0.6, 0.7])
    _write_run(tmp_path, "two", ["a", "b"], [40.0, 90.0, 100.0], [0.3, 0.8, 0.75], power=100.0)
    figs = {f.run_id: f for f in comparison.build(["one", "two"], price_kwh=0.5)}
    two = figs["two"]
    assert two.images_per_s == 95.0 and two.epoch_s == 10.0  # median of the epochs after the first
    assert (two.final_val_acc, two.best_val_acc) == (0.75, 0.8)
    assert two.scaling["baseline"] == "one" and two.scaling["efficiency"] == pytest.approx(95.0 / (2 * 61.0))
    assert [p.step_s_median for p in two.per_node] == [0.51, 1.01] and two.straggler == "b"
    # no all-reduce timing recorded: the share is derived from the one-node run's step time (same batch)
    assert two.comm_share == pytest.approx(1 - (32 / 61.0) / (64 / 95.0)) and "one" in two.comm_share_source
    assert figs["one"].comm_share == 0.0 and two.time_to_target_s is None  # 0.9 not reached
    assert comparison.build(["two"], target_acc=0.8)[0].time_to_target_s == 20.0  # epoch 1 ends 20 s after start
    assert two.step_spread == pytest.approx(1.01 / 0.51)
    # measured GPU power: idle + half-loaded CPU + 100 W GPU, per node, over the 40 s wall time
    assert two.per_node[0].watts == 40 + 32.5 + 100 and two.energy_source == "measured GPU power"
    assert two.energy_kwh == pytest.approx(2 * 172.5 * 40 / 3.6e6) and two.cost == pytest.approx(two.energy_kwh * 0.5)
    assert figs["one"].energy_source == "estimated" and figs["one"].per_node[0].watts == 72.5
    pngs = plots.pngs(list(figs.values()))
    assert set(pngs) == {"accuracy_loss", "throughput_nodes", "step_time"}
    assert all(p.startswith(b"\x89PNG") for p in pngs.values())
    page = report.html_page(list(figs.values()), pngs, 0.5)
    assert page.count("data:image/png;base64,") == 3 and "0.7500" in page and "95.0" in page


def test_scaling_needs_the_same_job_and_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _write_run(tmp_path, "one", ["a"], [50.0, 60.0], [0.2, 0.6], settings={"epochs": 2, "batch": 64})
    _write_run(tmp_path, "two", ["a", "b"], [40.0, 90.0], [0.3, 0.8], settings={"epochs": 2, "batch": 32})
    two = comparison.build(["two"])[0]
    assert two.scaling is None and two.comm_share is None and two.comm_share_source is None
    assert "communication share unknown" in report.run_line(two)
    head, rows = report.summary_rows([two])
    assert rows[0][head.index("comm. share")] == "-"


def test_report_without_collected_metrics_says_how_to_get_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    records.save(records.RunRecord.from_dict({"run_id": "r", "job": "j", "framework": "pytorch", "state": "succeeded",
                                        "created": 1, "nodes": [{"node": "a", "node_rank": 0, "nproc": 1,
                                                                 "run_dir": "/srv/r"}], "inventory": {"hosts": []}}))
    with pytest.raises(Exception, match="collect them first: clusterctl collect r"):
        comparison.build(["r"])


class _Outline(HTMLParser):
    """The page's skeleton: headings, each table's columns and row count, figure captions; not the images."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self._tag: str | None = None
        self._text = ""
        self._columns: list[str] = []
        self._rows = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("h1", "h2", "th", "figcaption", "title"):
            self._tag, self._text = tag, ""
        elif tag == "table":
            self._columns, self._rows = [], 0
        elif tag == "tr":
            self._rows += 1
        elif tag == "img":
            src = dict(attrs).get("src") or ""
            self.lines.append(f"image: {src.split(',', 1)[0]}")

    def handle_data(self, data: str) -> None:
        if self._tag:
            self._text += data

    def handle_endtag(self, tag: str) -> None:
        if tag == self._tag == "th":
            self._columns.append(self._text)
        elif tag == self._tag:
            self.lines.append(f"{tag}: {self._text}")
        elif tag == "table":
            self.lines.append(f"table ({self._rows - 1} rows): {' | '.join(self._columns)}")
        if tag == self._tag:
            self._tag = None


def test_report_page_structure_matches_golden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Headings, table columns and captions of report.html for two fixed runs (UPDATE_GOLDEN=1 rewrites)."""
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _write_run(tmp_path, "one", ["a"], [50.0, 60.0, 62.0], [0.2, 0.6, 0.7])
    _write_run(tmp_path, "two", ["a", "b"], [40.0, 90.0, 100.0], [0.3, 0.8, 0.75], power=100.0)
    figs = comparison.build(["one", "two"], price_kwh=0.5)
    outline = _Outline()
    outline.feed(report.html_page(figs, plots.pngs(figs), 0.5))
    text = "\n".join(outline.lines) + "\n"
    goldens.check(GOLDEN_PAGE, text, "the report page's structure")


def test_write_pages_picks_the_default_path_and_writes_markdown_plots(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _write_run(tmp_path, "one", ["a"], [50.0, 60.0, 62.0], [0.2, 0.6, 0.7])
    _write_run(tmp_path, "two", ["a", "b"], [40.0, 90.0, 100.0], [0.3, 0.8, 0.75])
    figs, written = report.write_pages(["one"], html=None, markdown=None, price_kwh=0.5)
    assert [f.run_id for f in figs] == ["one"] and written == [(records.run_path("one") / "report.html").resolve()]
    assert written[0].read_text().startswith("<!doctype html>")
    _, written = report.write_pages(["one", "two"], html=None, markdown=None, price_kwh=0.5)
    assert len(written) == 1 and written[0].parent == (tmp_path / "reports").resolve()
    assert written[0].name.startswith("report-") and written[0].suffix == ".html"
    md = tmp_path / "out" / "r.md"
    _, written = report.write_pages(["one", "two"], html=None, markdown=md, price_kwh=None)
    assert written == [md.resolve()] and (tmp_path / "out" / "r-plots" / "step_time.png").exists()
    assert "![" in md.read_text()
    page = tmp_path / "p.html"
    _, written = report.write_pages(["two"], html=page, markdown=md, price_kwh=None)
    assert written == [page.resolve(), md.resolve()]


def _recorded(home: Path) -> None:
    shutil.copytree(RECORDED, home / "runs")


def _rank_records(run_id: str, node: str, rank: int) -> list[dict]:
    return [json.loads(x) for x in (RECORDED / run_id / node / "out" / f"metrics-rank{rank}.jsonl").read_text()
            .splitlines()]


def test_recorded_runs_show_bytes_compression_cpu_and_time_to_target(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _recorded(tmp_path)
    figs = {f.run_id: f for f in comparison.build([DDP3, TF3, DDP1], target_acc=0.9)}
    ddp, tf, one = figs[DDP3], figs[TF3], figs[DDP1]
    start = _rank_records(DDP3, "node1", 0)[0]
    assert (ddp.bytes_sent_per_step, ddp.allreduce_payload_bytes) == (start["bytes_sent_per_step_ring"],
                                                                      start["allreduce_payload_bytes"])
    assert ddp.bytes_sent_per_step == round(start["allreduce_payload_bytes"] * 2 * 2 / 3)  # ring, 3 ranks
    assert (ddp.grad_compression, ddp.accumulate, ddp.powersgd_rank) == ("none", 1, None)
    assert one.bytes_sent_per_step == 0 and one.comm_share == 0.0
    # CPU: the median over every rank's epochs after the first
    cores = [r["cpu_cores_process"] for n, k in (("node1", 0), ("node2", 1), ("node3", 2))
             for r in [x for x in _rank_records(DDP3, n, k) if x["type"] == "epoch"][1:]]
    assert ddp.cpu_cores_process == statistics.median(cores)
    # time to 0.9: start record to the end of the first epoch at or above it
    ep = [x for x in _rank_records(DDP3, "node1", 0) if x["type"] == "epoch"]
    first = next(x for x in ep if x["val_acc"] >= 0.9)
    assert ddp.time_to_target_s == pytest.approx(first["time"] - start["time"])
    # communication share: derived from the one-process run (same job, settings and batch); TF has none
    assert ddp.scaling and ddp.scaling["baseline"] == DDP1
    assert ddp.comm_share == pytest.approx(1 - (32 / one.images_per_s) / (96 / ddp.images_per_s))
    assert 0 < ddp.comm_share < 1 and DDP1 in ddp.comm_share_source
    assert tf.comm_share is None and tf.scaling is None
    head, rows = report.summary_rows([ddp, tf, one])
    row = dict(zip(head, rows[0]))
    assert row["MB sent/step"] == "125.5" and row["compression"] == "none" and row["accumulate"] == "1"
    assert row["comm. share"] == f"{ddp.comm_share:.0%}" and row["CPU cores/proc"] == f"{ddp.cpu_cores_process:.2f}"
    assert row["s to val acc 0.9"] == f"{ddp.time_to_target_s:.0f}"
    assert dict(zip(head, rows[1]))["comm. share"] == "-"
    d = json.loads(json.dumps(ddp.to_dict()))
    assert d["bytes_sent_per_step"] == start["bytes_sent_per_step_ring"] and d["target_acc"] == 0.9
    assert d["comm_share_source"].startswith("derived") and d["time_to_target_s"] == ddp.time_to_target_s


def test_a_target_not_reached_and_compression_in_the_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _recorded(tmp_path)
    md = tmp_path / "r.md"
    figs, _ = report.write_pages([DDP3, TF3], html=tmp_path / "r.html", markdown=md, price_kwh=None,
                                 target_acc=0.99)
    assert all(f.time_to_target_s is None and f.target_acc == 0.99 for f in figs)
    head, rows = report.summary_rows(figs)
    assert [dict(zip(head, r))["s to val acc 0.99"] for r in rows] == ["not reached", "not reached"]
    text = md.read_text()
    assert "Validation accuracy 0.99 not reached" in text and "125.5 MB sent per step and rank" in text
    assert "s to val acc 0.99" in (tmp_path / "r.html").read_text()
    psgd = replace(figs[0], grad_compression="powersgd", powersgd_rank=2, accumulate=4)
    head, rows = report.summary_rows([psgd])
    row = dict(zip(head, rows[0]))
    assert (row["compression"], row["accumulate"]) == ("powersgd r2", "4")
    assert "compression powersgd r2, 4 micro-batch(es) per all-reduce" in report.run_line(psgd)
    assert "compression powersgd r2 bf16," in report.run_line(replace(psgd, powersgd_wire="bfloat16"))


def test_recorded_runs_markdown_page_matches_golden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every figure and sentence of the Markdown page for the recorded runs (UPDATE_GOLDEN=1 rewrites)."""
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _recorded(tmp_path)
    md = tmp_path / "recorded.md"
    report.write_pages([DDP3, TF3, DDP1], html=None, markdown=md, price_kwh=0.25)
    goldens.check(GOLDEN_RECORDED, md.read_text(), "the recorded runs' Markdown report")


def _fig(framework: str, settings: dict[str, object], epochs: bool = True) -> figures.RunFigures:
    return figures.RunFigures(run_id="r", job="j", framework=framework, state="succeeded", nodes=["node1"], world=1,
                              batch=32, global_batch=32, dataset="digits", synthetic=False,
                              epochs=[{"epoch": 1}] if epochs else [], images_per_s=None, epoch_s=None,
                              final_val_acc=None, best_val_acc=None, wall_s=None, settings=settings)


def test_the_title_names_the_models_and_frameworks_the_runs_trained() -> None:
    torch18, torch50 = _fig("pytorch", {"model": "resnet18"}), _fig("pytorch", {"model": "resnet50"})
    tf = _fig("tensorflow", {"model": "resnet50"})
    assert report.title([torch50, tf]) == "ResNet50 study: PyTorch DDP vs TensorFlow MWMS"
    assert report.title([torch18]) == "ResNet18 study: PyTorch DDP"
    assert report.title([torch18, tf]) == "ResNet18 and ResNet50 study: PyTorch DDP vs TensorFlow MWMS"
    own = _fig("pytorch", {"model": "resnet50", "code": "train.py"}, epochs=False)
    assert report.title([torch50, own]) == "Runs on the cluster"


OWN = "code-20261207-143806-94aa"  # a user's own program, recorded on the lab


def test_the_report_of_a_users_program_speaks_of_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wall time, exit codes, CPU, memory, energy and the $CLUSTER_METRICS plot first; none of the built-in
    programs' words (validation accuracy, batch per worker, dataset, images/s) where they do not apply."""
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _recorded(tmp_path)
    md, page = tmp_path / "own.md", tmp_path / "own.html"
    figs, _ = report.write_pages([OWN], html=page, markdown=md, price_kwh=None)
    head, rows = report.summary_rows(figs)
    row = dict(zip(head, rows[0]))
    assert (row["launcher"], row["state"], row["exit codes"], row["metrics records"]) == (
        "torchrun", "succeeded", "node1:0 node2:0", "8")
    assert row["wall s"] != "-" and row["CPU %"] != "-" and row["peak MB"] != "-" and row["energy kWh"] != "-"
    for text in (md.read_text(), page.read_text()):
        for word in ("val acc", "Validation accuracy", "/worker", "dataset", "images/s", "CPU use not recorded"):
            assert word not in text, word
    text = md.read_text()
    assert text.index("user_metrics.png") < text.index("usage.png") < text.index(f"## {OWN}")
    assert "8 $CLUSTER_METRICS record(s)" in report.run_line(figs[0])


def test_a_runs_nodes_on_one_kernel_are_said_to_share_one_machine(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Lab nodes share the head's kernel (one boot id in their facts): the report says their scaling shows the
    method, not separate PCs; nodes with their own boot ids (a room) get no such sentence."""
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _recorded(tmp_path)

    def boot(ids: list[str]) -> str:
        for n, b in zip(("node1", "node2", "node3"), ids):
            facts = tmp_path / "runs" / DDP3 / n / "facts.json"
            facts.write_text(json.dumps({**json.loads(facts.read_text()), "place": {"boot_id": b}}))
        return report.run_line(comparison.build([DDP3], target_acc=0.9)[0])

    assert "nodes are one machine" not in report.run_line(comparison.build([DDP3], target_acc=0.9)[0])
    assert "Its 3 nodes are one machine (one kernel: a simulated lab)" in boot(["b1", "b1", "b1"])
    assert "one machine" not in boot(["b1", "b2", "b3"])
