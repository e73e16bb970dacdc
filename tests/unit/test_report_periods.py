"""The report of a run whose membership changed: node1 of three died after epoch 1, and node2 (as rank 0)
and node3 (as rank 1) went on from the checkpoint of epoch 0, redoing epoch 1 (docs/report.md)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.runs import records
from cluster.study import comparison, node_figures, periods, report

RUN = "resnet50-ddp-20261201-100000-elas"
START_FIELDS = {"schema": 1, "framework": "pytorch", "device": "cpu", "amp": False, "dataset": "digits",
                "synthetic": False, "train_samples": 1438, "val_samples": 359, "batch": 32, "steps_per_epoch": 4,
                "epochs": 3, "grad_compression": "none", "powersgd_rank": None, "accumulate": 1,
                "allreduce_payload_bytes": 94114088}
REASON = "lost node1: no answer for 60 s"
WHY = "no answer for 60 s"


def _start(t: float, rank: int, node: str, world: int, period: int | None, epoch: int, step: int) -> dict[str, Any]:
    rec = {"type": "start", **START_FIELDS, "rank": rank, "time": t, "mono": t, "node": node, "run_id": RUN,
           "world": world, "local_rank": 0, "batches": [32] * world, "global_batch": 32 * world,
           "start_epoch": epoch, "start_step": step,
           "bytes_sent_per_step_ring": round(94114088 * 2 * (world - 1) / world)}
    if period is not None:  # period 1 written before the field existed reads the same
        rec["period"] = period
    return rec


def _step(t: float, rank: int, epoch: int, step: int, compute_s: float) -> dict[str, Any]:
    return {"type": "step", "schema": 1, "framework": "pytorch", "rank": rank, "time": t, "mono": t, "epoch": epoch,
            "step": step, "loss": 2.0, "lr": 0.01, "images_per_s": 50.0, "data_s": 0.01, "compute_s": compute_s}


def _epoch(t: float, rank: int, epoch: int, step: int, world: int, epoch_s: float, val: float,
           cores: float) -> dict[str, Any]:
    return {"type": "epoch", "schema": 1, "framework": "pytorch", "rank": rank, "time": t, "mono": t, "epoch": epoch,
            "step": step, "train_loss": 1.0 / (epoch + 1), "train_acc": val, "val_loss": 1.5 / (epoch + 1),
            "val_acc": val, "epoch_s": epoch_s, "images_per_s": 4 * 32 * world / epoch_s, "data_s": 0.04,
            "compute_s": epoch_s - 0.04, "cpu_s_process": cores * epoch_s, "cpu_cores_process": cores,
            "cpu_percent_node": 50.0}


def _period1(rank: int, node: str, world: int = 3) -> list[dict[str, Any]]:
    """World 3 from t=100: epoch 0 ends at 130, epoch 1 at 160 (its checkpoint never made it), a step of
    epoch 2 at 165, then node1 is gone."""
    return [_start(100.0 + rank * 0.1, rank, node, world, None, 0, 0), _step(105.0, rank, 0, 1, 1.0),
            _epoch(130.0, rank, 0, 4, world, 24.0, 0.5, 0.4), _step(135.0, rank, 1, 5, 1.0),
            _epoch(160.0, rank, 1, 8, world, 24.0, 0.6, 0.6), _step(165.0, rank, 2, 9, 1.0)]


def _period2(rank: int, node: str) -> list[dict[str, Any]]:
    """World 2 from t=200, resumed at epoch 1 (step 4): epoch 1 again at 240, epoch 2 at 280, end at 285."""
    return [_start(200.0 + rank * 0.1, rank, node, 2, 2, 1, 4), _step(205.0, rank, 1, 5, 2.0),
            _epoch(240.0, rank, 1, 8, 2, 32.0, 0.7, 0.8), _step(245.0, rank, 2, 9, 2.0),
            _epoch(280.0, rank, 2, 12, 2, 32.0, 0.95, 1.0),
            {"type": "end", "schema": 1, "framework": "pytorch", "rank": rank, "time": 285.0, "mono": 285.0,
             "epochs_done": 2, "step": 12, "wall_s": 85.0, "cpu_s_process": 70.0, "cpu_cores_process": 0.8}]


def _write(path: Path, recs: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in recs))


def _record(run_id: str, nodes: list[str], membership: bool) -> None:
    rec: dict[str, Any] = {
        "run_id": run_id, "job": "resnet50-ddp", "framework": "pytorch", "state": "succeeded", "created": 1,
        "started": 99.0, "ended": 290.0, "world_size": len(nodes), "settings": {"epochs": 3},
        "nodes": [{"node": n, "node_rank": i, "nproc": 1, "run_dir": f"/srv/runs/{run_id}"}
                  for i, n in enumerate(nodes)],
        "inventory": {"hosts": [{"name": n, "address": f"10.0.0.{i + 1}"} for i, n in enumerate(nodes)]}}
    if membership:
        rec["periods"] = [
            {"period": 1, "nodes": nodes, "world_size": 3, "started": 99.0, "ended": 170.0, "reason": None,
             "from_epoch": None, "from_step": None},
            {"period": 2, "nodes": ["node2", "node3"], "world_size": 2, "started": 195.0, "ended": None,
             "reason": REASON, "from_epoch": 1, "from_step": 4}]
        rec["dropped"] = {"node1": {"why": WHY, "at": 170.0, "period": 1, "step": 9, "came_back": 300.0}}
    records.save(records.RunRecord.from_dict(rec))


def _elastic_run(run_id: str = RUN, membership: bool = True, node1_collected: bool = True) -> None:
    _record(run_id, ["node1", "node2", "node3"], membership)
    base = records.run_path(run_id)
    if node1_collected:
        _write(base / "node1" / "out" / "metrics-rank0.jsonl", _period1(0, "node1"))
    _write(base / "node2" / "out" / "metrics-rank1.jsonl", _period1(1, "node2"))
    _write(base / "node2" / "out" / "metrics-rank0.jsonl", _period2(0, "node2"))
    _write(base / "node3" / "out" / "metrics-rank2.jsonl", _period1(2, "node3"))
    _write(base / "node3" / "out" / "metrics-rank1.jsonl", _period2(1, "node3"))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    return tmp_path


def test_rank0_is_merged_from_every_folder_and_a_redone_epoch_counts_once(home: Path) -> None:
    _elastic_run()
    f = comparison.build([RUN], target_acc=0.9)[0]
    assert [e["epoch"] for e in f.epochs] == [0, 1, 2]
    assert [(e["rank"], e["time"], e["val_acc"]) for e in f.epochs] == [(0, 130.0, 0.5), (0, 240.0, 0.7),
                                                                       (0, 280.0, 0.95)]  # period 2's epoch 1 wins
    assert f.wall_s == 285.0 - 100.0  # period 1's start (node1's folder) to period 2's end (node2's)
    assert f.time_to_target_s == 280.0 - 100.0
    assert (f.final_val_acc, f.best_val_acc) == (0.95, 0.95)
    # what describes the run is period 1's start record
    assert (f.world, f.batch, f.global_batch, f.dataset) == (3, 32, 96, "digits")
    assert f.bytes_sent_per_step == round(94114088 * 4 / 3) and f.grad_compression == "none"
    # per node: node2 held rank 1 then rank 0, one process at a time
    per = {p.node: p for p in f.per_node}
    assert per["node2"].ranks == [0, 1] and per["node1"].ranks == [0]
    med = per["node2"].step_s_median
    assert med is not None and med == pytest.approx(1.01)
    assert per["node2"].images_per_s == pytest.approx(32 / med)
    # CPU: each rank's epochs after the first of each period (a restart warms up again)
    assert f.cpu_cores_process == 0.6  # the median of 0.6 x 3 (period 1) and 1.0 x 2 (period 2)


def test_each_period_has_its_nodes_epochs_throughput_and_what_the_change_cost(home: Path) -> None:
    _elastic_run()
    f = comparison.build([RUN])[0]
    p1, p2 = f.periods
    assert (p1.period, p1.nodes, p1.world, p1.reason, p1.epochs) == (1, ["node1", "node2", "node3"], 3, None, [0, 1])
    assert (p1.from_epoch, p1.from_step, p1.started, p1.gap_s) == (0, 0, 100.0, None)
    assert p1.wall_s == 60.0 and p1.images_per_s == pytest.approx(2 * 4 * 96 / 60.0)
    assert (p2.period, p2.nodes, p2.world, p2.reason, p2.epochs) == (2, ["node2", "node3"], 2, REASON, [1, 2])
    assert (p2.from_epoch, p2.from_step, p2.started) == (1, 4, 200.0)
    assert p2.wall_s == 85.0 and p2.images_per_s == pytest.approx(2 * 4 * 64 / 85.0)
    assert p2.gap_s == pytest.approx(200.0 - 165.0)  # period 1's last record (a step of epoch 2) to the restart
    d = json.loads(json.dumps(f.to_dict()))
    assert d["periods"][1] == {"period": 2, "nodes": ["node2", "node3"], "world": 2, "from_epoch": 1, "from_step": 4,
                               "reason": REASON, "epochs": [1, 2], "started": 200.0, "wall_s": 85.0,
                               "images_per_s": p2.images_per_s, "gap_s": p2.gap_s}
    assert d["dropped"]["node1"]["came_back"] == 300.0


def test_end_to_end_throughput_counts_the_restart_and_each_epoch_once(home: Path) -> None:
    """Epoch 0 by three nodes (4 steps x 96), epochs 1 (redone) and 2 by two (4 x 64 each), over the wall time
    from period 1's start to period 2's end: the gap, the lost epoch 1 and the restart count as time."""
    _elastic_run()
    f = comparison.build([RUN], target_acc=0.9)[0]
    assert f.trained_samples == 4 * 96 + 2 * 4 * 64
    assert f.images_per_s_e2e == pytest.approx((4 * 96 + 2 * 4 * 64) / 185.0)
    assert f.images_per_s == 8.0 and f.images_per_s_e2e < f.images_per_s  # steady: period 2's epochs
    assert f.energy_to_target_kwh == pytest.approx(f.energy_kwh * 180.0 / 185.0)  # the same watts, 180 s
    assert "e2e images/s every epoch's samples once" in report.run_line(f)


def test_without_the_records_periods_the_start_records_give_them(home: Path) -> None:
    _elastic_run(membership=False)
    f = comparison.build([RUN])[0]
    assert [(p.period, p.nodes, p.world, p.reason) for p in f.periods] == [
        (1, ["node1", "node2", "node3"], 3, None), (2, ["node2", "node3"], 2, None)]
    assert [e["epoch"] for e in f.epochs] == [0, 1, 2] and f.wall_s == 185.0 and f.dropped == {}


def test_a_dead_node_never_collected_leaves_its_period_to_the_next_rank(home: Path) -> None:
    _elastic_run(node1_collected=False)
    f = comparison.build([RUN])[0]
    assert [(e["epoch"], e["time"]) for e in f.epochs] == [(0, 130.0), (1, 240.0), (2, 280.0)]
    assert f.wall_s == pytest.approx(285.0 - 100.1)  # rank 1's start of period 1
    assert f.world == 3 and [p.epochs for p in f.periods] == [[0, 1], [1, 2]]


def test_the_pages_show_the_periods_and_the_dropped_node(home: Path) -> None:
    _elastic_run()
    md, page = home / "r.md", home / "r.html"
    figs, _ = report.write_pages([RUN], html=page, markdown=md, price_kwh=None)
    head, rows = report.period_rows(figs[0])
    assert head == ["period", "nodes", "world", "from epoch / step", "epochs", "images/s", "wall s",
                    "lost to the change s", "why it began"]
    assert rows == [["1", "node1, node2, node3", "3", "0 / 0", "0-1", "12.8", "60", "-", "-"],
                    ["2", "node2, node3", "2", "1 / 4", "1-2", "6.0", "85", "35", REASON]]
    def clock(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))

    line = (f"node1 dropped at {clock(170.0)} (period 1): {WHY}; came back at {clock(300.0)}, "
            "kept out of this run")
    assert report.dropped_lines(figs[0]) == [line]
    text = md.read_text()
    assert "### Membership periods" in text and f"- {line}" in text
    assert "| 2 | node2, node3 | 2 | 1 / 4 | 1-2 | 6.0 | 85 | 35 | " + REASON + " |" in text
    assert "The membership changed: 2 periods" in text
    html = page.read_text()
    assert "<h3>Membership periods</h3>" in html and "<th>lost to the change s</th>" in html
    assert "<td>node2, node3</td>" in html and "kept out of this run</li>" in html


def test_a_run_that_kept_its_nodes_is_one_period_and_its_pages_do_not_change(home: Path) -> None:
    _record("plain", ["a", "b"], membership=False)
    for r, n in enumerate(["a", "b"]):
        _write(records.run_path("plain") / n / "out" / f"metrics-rank{r}.jsonl", _period1(r, n, world=2)[:5])
    f = comparison.build(["plain"])[0]
    assert [(p.period, p.nodes, p.world, p.epochs, p.gap_s) for p in f.periods] == [(1, ["a", "b"], 2, [0, 1], None)]
    assert f.wall_s == 60.0 and [e["epoch"] for e in f.epochs] == [0, 1] and f.dropped == {}
    assert "Membership" not in report.html_page([f], {}, None) and "membership" not in report.run_line(f)
    assert "Membership" not in report.markdown_page([f], home / "plots", {})


def test_a_node_that_kept_its_rank_appends_the_next_period_to_the_same_file(home: Path) -> None:
    """node1 died as rank 2: node1 and node2 keep ranks 0 and 1, each in one file across both periods."""
    _record("kept", ["n0", "n1", "n2"], membership=False)
    base = records.run_path("kept")
    _write(base / "n0" / "out" / "metrics-rank0.jsonl", _period1(0, "n0") + _period2(0, "n0"))
    _write(base / "n1" / "out" / "metrics-rank1.jsonl", _period1(1, "n1") + _period2(1, "n1"))
    _write(base / "n2" / "out" / "metrics-rank2.jsonl", _period1(2, "n2"))
    f = comparison.build(["kept"])[0]
    assert [(e["epoch"], e["time"]) for e in f.epochs] == [(0, 130.0), (1, 240.0), (2, 280.0)]
    assert [(p.nodes, p.epochs) for p in f.periods] == [(["n0", "n1", "n2"], [0, 1]), (["n0", "n1"], [1, 2])]
    assert [p.ranks for p in f.per_node] == [[0], [1], [2]]
    assert periods.split_periods(node_figures.read_metrics(base / "n0")[0]).keys() == {1, 2}


