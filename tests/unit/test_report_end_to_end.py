"""End-to-end figures: a 2-node run whose first epoch is slow against a 1-node run of the same job, on run
folders written here with records shaped as the training programs write them (docs/metrics.md)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from cluster.runs import records
from cluster.study import comparison, figures, plots, report
from tests.conftest import ROOT

FACTS = ROOT / "tests" / "fixtures" / "report" / "runs" / "resnet50-ddp-20261130-145756-1prc" / "node1" / "facts.json"
T0 = 1000.0
SAMPLES = 320  # per epoch in both runs: 10 steps x 32 on one node, 5 steps x 64 on two
WATTS = 40.0 + 65.0 * 0.5  # per node: no GPU in the facts, CPU half loaded (docs/report.md)
START_FIELDS = {"schema": 1, "framework": "pytorch", "local_rank": 0, "device": "cpu", "amp": False,
                "dataset": "digits", "synthetic": False, "train_samples": 1438, "val_samples": 359, "batch": 32,
                "epochs": 3, "peak_lr": 0.01, "momentum": 0.9, "weight_decay": 0.0005, "schedule": "cosine",
                "warmup_epochs": 1.0, "start_epoch": 0, "start_step": 0, "period": 1, "grad_compression": "none",
                "powersgd_rank": None, "powersgd_start_step": None, "accumulate": 1,
                "allreduce_payload_bytes": 94114088}


def _records(run_id: str, rank: int, world: int, epoch_ends: list[float], epoch_s: list[float],
             val: list[float]) -> list[dict[str, Any]]:
    """One rank's metrics: start at T0, a step record per step, an epoch record ending at each of `epoch_ends`
    (its training steps took `epoch_s`, the rest is evaluation and the checkpoint), the end a second later."""
    steps = SAMPLES // (32 * world)
    recs: list[dict[str, Any]] = [{
        "type": "start", **START_FIELDS, "rank": rank, "time": T0, "mono": T0, "host": f"pc{rank}", "pid": 100,
        "node": f"pc{rank}", "run_id": run_id, "world": world, "batches": [32] * world, "global_batch": 32 * world,
        "steps_per_epoch": steps, "micro_batch": 32, "micro_global_batch": 32 * world,
        "bytes_sent_per_step_ring": round(94114088 * 2 * (world - 1) / world)}]
    for e, (end, secs, acc) in enumerate(zip(epoch_ends, epoch_s, val)):
        for s in range(steps):
            recs.append({"type": "step", "schema": 1, "framework": "pytorch", "rank": rank,
                         "time": end - secs + (s + 1) * secs / steps, "mono": 0.0, "epoch": e,
                         "step": e * steps + s + 1, "loss": 2.0, "lr": 0.01,
                         "images_per_s": round(32 * world * steps / secs, 2), "data_s": 0.001,
                         "compute_s": secs / steps - 0.001, "bytes_sent_ring": 0})
        recs.append({"type": "epoch", "schema": 1, "framework": "pytorch", "rank": rank, "time": end, "mono": 0.0,
                     "epoch": e, "step": (e + 1) * steps, "train_loss": 1.0 / (e + 1), "train_acc": acc,
                     "val_loss": 1.5 / (e + 1), "val_acc": acc, "epoch_s": secs,
                     "images_per_s": round(steps * 32 * world / secs, 2), "data_s": 0.01, "compute_s": secs - 0.01,
                     "bytes_sent_per_step_ring": 0, "cpu_s_process": 0.5 * secs, "cpu_cores_process": 0.5,
                     "cpu_percent_node": 50.0})
    recs.append({"type": "end", "schema": 1, "framework": "pytorch", "rank": rank, "time": epoch_ends[-1] + 1.0,
                 "mono": 0.0, "epochs_done": len(val), "step": len(val) * steps, "wall_s": epoch_ends[-1] + 1.0 - T0,
                 "cpu_s_process": 10.0, "cpu_cores_process": 0.5})
    return recs


def _run(run_id: str, world: int, epoch_ends: list[float], epoch_s: list[float], val: list[float]) -> None:
    nodes = [f"pc{r}" for r in range(world)]
    records.save(records.RunRecord.from_dict({
        "run_id": run_id, "job": "resnet50-ddp", "framework": "pytorch", "state": "succeeded", "created": T0 - 5,
        "started": T0 - 2, "ended": epoch_ends[-1] + 2, "world_size": world, "settings": {"epochs": 3, "batch": 32},
        "nodes": [{"node": n, "node_rank": i, "nproc": 1, "run_dir": f"/srv/runs/{run_id}"} for i, n in enumerate(nodes)],
        "inventory": {"hosts": [{"name": n, "address": f"10.0.0.{i + 1}"} for i, n in enumerate(nodes)]}}))
    for r, n in enumerate(nodes):
        d = records.run_path(run_id) / n
        (d / "out").mkdir(parents=True)
        shutil.copy(FACTS, d / "facts.json")
        (d / "out" / f"metrics-rank{r}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in _records(run_id, r, world, epoch_ends, epoch_s, val)))


VAL = [0.5, 0.8, 0.92]  # 0.9 first reached at the end of epoch 2, in every run but "never"


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, figures.RunFigures]:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    # one node: 10 s of steps per epoch, 2 s of evaluation; ends at 1037
    _run("one", 1, [T0 + 12, T0 + 24, T0 + 36], [10.0, 10.0, 10.0], VAL)
    # two nodes, slow first epoch (warm-up): 30 s, then 4 s; ends at 1045
    _run("slow", 2, [T0 + 32, T0 + 38, T0 + 44], [30.0, 4.0, 4.0], VAL)
    # two nodes without the slow start: ends at 1019
    _run("fast", 2, [T0 + 6, T0 + 12, T0 + 18], [4.0, 4.0, 4.0], VAL)
    # two nodes, fast, but never at 0.9
    _run("never", 2, [T0 + 6, T0 + 12, T0 + 18], [4.0, 4.0, 4.0], [0.5, 0.8, 0.85])
    return {f.run_id: f for f in comparison.build(["one", "slow", "fast", "never"], target_acc=0.9)}


def test_end_to_end_throughput_counts_the_slow_first_epoch(runs: dict[str, figures.RunFigures]) -> None:
    one, slow = runs["one"], runs["slow"]
    assert slow.trained_samples == 3 * SAMPLES and one.trained_samples == 3 * SAMPLES  # steps x global batch, exact
    assert slow.wall_s == 45.0 and one.wall_s == 37.0
    assert slow.images_per_s == 80.0 and one.images_per_s == 32.0  # steady: the epochs after the first
    assert slow.images_per_s_e2e == pytest.approx(960 / 45) and one.images_per_s_e2e == pytest.approx(960 / 37)
    assert slow.images_per_s_e2e < slow.images_per_s
    assert slow.time_to_target_s == 44.0 and one.time_to_target_s == 36.0
    assert slow.energy_to_target_kwh == pytest.approx(2 * WATTS * 44 / 3.6e6)
    assert one.energy_to_target_kwh == pytest.approx(WATTS * 36 / 3.6e6)


def test_the_ratios_against_one_node(runs: dict[str, figures.RunFigures]) -> None:
    s = runs["slow"].scaling
    assert s is not None and s["baseline"] == "one"
    assert s["speedup"] == pytest.approx(80 / 32) and s["efficiency"] == pytest.approx(80 / (2 * 32))  # steady
    assert s["e2e_speedup"] == pytest.approx((960 / 45) / (960 / 37))  # below 1: one node trains faster
    assert s["time_to_target_ratio"] == pytest.approx(44 / 36)
    assert s["energy_to_target_ratio"] == pytest.approx((2 * 44) / 36)
    assert s["wall_ratio"] == pytest.approx(45 / 37)
    assert s["baseline_images_per_s_e2e"] == pytest.approx(960 / 37) and s["baseline_time_to_target_s"] == 36.0
    f = runs["fast"].scaling
    assert f is not None and f["time_to_target_ratio"] == pytest.approx(18 / 36)
    assert f["e2e_speedup"] == pytest.approx((960 / 19) / (960 / 37)) and f["wall_ratio"] == pytest.approx(19 / 37)
    assert runs["one"].scaling is None
    d = json.loads(json.dumps(runs["slow"].to_dict()))
    assert d["images_per_s_e2e"] == pytest.approx(960 / 45) and d["scaling"]["wall_ratio"] == pytest.approx(45 / 37)


def test_the_summary_and_the_paragraph_say_which_is_faster(runs: dict[str, figures.RunFigures]) -> None:
    figs = [runs[k] for k in ("one", "slow", "fast", "never")]
    head, rows = report.summary_rows(figs)
    assert head.index("e2e images/s") == head.index("images/s") + 1
    cells = {r[0]: dict(zip(head, r)) for r in rows}
    assert (cells["slow"]["images/s"], cells["slow"]["e2e images/s"]) == ("80.0", "21.3")
    assert [cells[k]["time to target vs 1 node"] for k in ("one", "slow", "fast", "never")] == \
        ["-", "1.22x", "0.50x", "not reached"]
    slow = report.run_line(runs["slow"])
    assert "End to end 21.3 images/s" in slow and "steady 80.0" in slow and "0.82x one node's" in slow
    assert "reaches 0.9 in 1.22x the time of one node (one): one node is faster end to end" in slow
    fast = report.run_line(runs["fast"])
    assert "reaches 0.9 in 0.50x the time of one node (one): 2.0x faster end to end" in fast
    assert "one node is faster" not in fast
    assert "one node" not in report.run_line(runs["one"]).lower()


def test_a_run_that_never_reaches_the_target(runs: dict[str, figures.RunFigures]) -> None:
    never = runs["never"]
    assert never.time_to_target_s is None and never.energy_to_target_kwh is None
    assert never.scaling is not None and never.scaling["time_to_target_ratio"] is None
    assert never.scaling["energy_to_target_ratio"] is None and never.scaling["e2e_speedup"] is not None
    assert "It does not reach 0.9; one node (one) does, after 36 s: one node is faster end to end." in \
        report.run_line(never)
    head, rows = report.summary_rows([never])
    assert dict(zip(head, rows[0]))["s to val acc 0.9"] == "not reached"


def test_neither_reaching_the_target_and_the_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _run("one", 1, [T0 + 12, T0 + 24, T0 + 36], [10.0, 10.0, 10.0], VAL)
    _run("slow", 2, [T0 + 32, T0 + 38, T0 + 44], [30.0, 4.0, 4.0], VAL)
    md = tmp_path / "r.md"
    figs, _ = report.write_pages(["one", "slow"], html=tmp_path / "r.html", markdown=md, price_kwh=None,
                                 target_acc=0.99)
    slow = figs[1]
    assert slow.scaling is not None and slow.scaling["time_to_target_ratio"] is None
    head, rows = report.summary_rows(figs)
    assert dict(zip(head, rows[1]))["time to target vs 1 node"] == "not reached"
    assert "Neither it nor one node (one) reaches 0.99: one node is faster end to end." in report.run_line(slow)
    text = md.read_text()
    assert "below 1x this run is faster" in text and "e2e images/s" in text
    page = (tmp_path / "r.html").read_text()
    # the per-epoch table keeps every epoch's time, the slow first one included
    assert "<td>0</td><td>5</td>" in page and "<td>30.0</td><td>10.7</td>" in page
    assert "time to target vs 1 node" in page


def test_without_steps_per_epoch_the_samples_are_images_per_s_times_epoch_s(
        runs: dict[str, figures.RunFigures]) -> None:
    path = records.run_path("slow") / "pc0" / "out" / "metrics-rank0.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    recs[0].pop("steps_per_epoch")
    path.write_text("".join(json.dumps(x) + "\n" for x in recs))
    f = figures.run_figures(records.load("slow"))
    assert f.trained_samples == pytest.approx(10.67 * 30 + 80.0 * 4 + 80.0 * 4)  # the records' rounded figures


def _continued(run_id: str, of: str, shift: float, epoch_ends: list[float], val: list[float], world: int = 2) -> None:
    """A `world`-node run that continues `of` (`launch --continue`): records as _run's, `shift` seconds later,
    its epochs numbered after the 2 that `of` trained."""
    _run(run_id, world, [t + shift for t in epoch_ends], [4.0] * len(val), val)
    r = records.load(run_id)
    nodes = [f"pc{i}" for i in range(world)]
    r.extra["continues"] = {"run": of, "copied": nodes}
    r.settings = {**r.settings, "continues": of}
    records.save(r)
    for n in nodes:
        path = next((records.run_path(run_id) / n / "out").glob("metrics-rank*.jsonl"))
        recs = [json.loads(x) for x in path.read_text().splitlines()]
        for x in recs:
            x["time"] += shift if x["type"] == "start" else 0.0
            if "epoch" in x:
                x["epoch"] += 2
        path.write_text("".join(json.dumps(x) + "\n" for x in recs))


def test_a_continued_run_is_timed_with_the_runs_it_continues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 epochs that end short of 0.9 (at T0 + 13), 27 s to end, collect and start again, a third epoch that
    reaches it (T0 + 46): what the user waited is 46 s from the first run's start, not the continuation's 6."""
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _run("one", 1, [T0 + 12, T0 + 24, T0 + 36], [10.0, 10.0, 10.0], VAL)
    _run("first", 2, [T0 + 6, T0 + 12], [4.0, 4.0], [0.5, 0.8])
    _continued("cont", "first", 40.0, [T0 + 6], [0.92])
    figs = {f.run_id: f for f in comparison.build(["one", "first", "cont"], target_acc=0.9)}
    cont, first = figs["cont"], figs["first"]
    assert first.joined is None and first.time_to_target_s is None
    assert cont.time_to_target_s == 6.0 and cont.wall_s == 7.0  # its own, from its start
    j = cont.joined
    assert j is not None and j["runs"] == ["first", "cont"] and j["epochs"] == 3
    assert j["time_to_target_s"] == 46.0 and j["wall_s"] == 47.0 and j["trained_samples"] == 3 * SAMPLES
    assert j["images_per_s_e2e"] == pytest.approx(960 / 47)
    assert j["energy_to_target_kwh"] == pytest.approx(2 * WATTS * 46 / 3.6e6)
    ts, points, label = plots.curve(cont)  # the plot draws the 3 epochs from the first run's start
    assert [p["epoch"] for p in points] == [0, 1, 2] and label.endswith("(cont, 2 runs)")
    assert ts == pytest.approx([4 / 60, 10 / 60, 44 / 60])  # from the first epoch's start (T0 + 6 - its 4 s)
    assert plots.curve(first)[1] == first.epochs and plots.curve(first)[2].endswith("(irst)")
    s = cont.scaling
    assert s is not None and s["baseline"] == "one" and s["joined"] is True  # compared by the first run's settings
    assert s["time_to_target_ratio"] == pytest.approx(46 / 36) and s["wall_ratio"] == pytest.approx(47 / 37)
    assert s["e2e_speedup"] == pytest.approx((960 / 47) / (960 / 37))
    assert s["energy_to_target_ratio"] == pytest.approx(2 * 46 / 36)
    head, rows = report.summary_rows([figs["one"], first, cont])
    cells = dict(zip(head, rows[2]))
    assert cells["s to val acc 0.9"] == "46 (2 runs)" and cells["time to target vs 1 node"] == "1.28x"
    assert cells["e2e images/s"] == "20.4 (2 runs)" and cells["wall s"] == "7"  # the wall column: its own
    line = report.run_line(cont)
    assert "Validation accuracy 0.9 reached after 46 s (the 2 runs together)" in line
    assert "It continues first: its time to the target and end-to-end figures are the 2 runs as one, 3 epochs" in line
    assert "End to end 20.4 images/s (every trained sample / the 47 s wall time" in line
    assert "reaches 0.9 in 1.28x the time of one node (one): one node is faster end to end" in line
    assert json.loads(json.dumps(cont.to_dict()))["joined"]["time_to_target_s"] == 46.0
    # the run it continues gone from the head: said, and nothing joined
    shutil.rmtree(records.run_path("first"))
    gone = comparison.build(["cont"], target_acc=0.9)[0]
    assert gone.joined is not None and "error" in gone.joined and "first" in gone.joined["error"]
    assert "It continues first; their figures are not joined: run first:" in report.run_line(gone)
    head, rows = report.summary_rows([gone])
    assert dict(zip(head, rows[0]))["s to val acc 0.9"] == "6"  # its own time, said as such in the line
    # collected nowhere: the fix is said
    _run("first", 2, [T0 + 6, T0 + 12], [4.0, 4.0], [0.5, 0.8])
    shutil.rmtree(records.run_path("first") / "pc0")
    shutil.rmtree(records.run_path("first") / "pc1")
    line = report.run_line(comparison.build(["cont"], target_acc=0.9)[0])
    assert "not joined: run first:" in line and "clusterctl collect first" in line


def test_a_run_continued_on_fewer_pcs_counts_each_runs_own_draw_to_the_target(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 PCs for the first run (to its end at T0 + 13), 1 PC from then to the target at T0 + 46 (its gap before
    it included): 2 x 13 + 1 x 33 PC-seconds, not the continuation's one PC over all 46 s."""
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _run("first", 2, [T0 + 6, T0 + 12], [4.0, 4.0], [0.5, 0.8])
    _continued("cont", "first", 40.0, [T0 + 6], [0.92], world=1)
    figs = {f.run_id: f for f in comparison.build(["first", "cont"], target_acc=0.9)}
    first, cont = figs["first"], figs["cont"]
    assert first.training_start == T0 and first.wall_s == 13.0  # the spans the draws apply to
    assert cont.joined is not None and cont.joined["time_to_target_s"] == 46.0
    assert cont.joined["energy_to_target_kwh"] == pytest.approx(WATTS * (2 * 13 + 1 * 33) / 3.6e6)
