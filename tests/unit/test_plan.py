"""The placement model and the benchmark's reading of step records, on numbers worked out by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.planner import bench, placement, plans
from cluster.inventory import loader
from cluster.planner.bench import NetworkBench, StepRate
from cluster.errors import UsageError
from cluster.planner.placement import NodeSpeed
from cluster.programs import wlcommon

NET = NetworkBench(nodes=2, busbw_MBps=100.0, model_allreduce_s=0.2, per_node_busbw_MBps={}, latency_s=0.001)


def test_balance_equalises_finish_times_in_whole_samples() -> None:
    # no fixed part: proportional to speed (30 vs 10 images/s)
    assert placement.balance(32, {"a": NodeSpeed(0, 1 / 30), "b": NodeSpeed(0, 1 / 10)}) == {"a": 24, "b": 8}
    # same per-sample cost, b has 0.3 s more fixed work per step: a takes 0.3 s / 0.02 = 15 samples more
    sh = placement.balance(32, {"a": NodeSpeed(0.0, 0.02), "b": NodeSpeed(0.3, 0.02)})
    assert sum(sh.values()) == 32 and sh["a"] - sh["b"] in (15, 16)
    s = placement.balance(8, {"fast": NodeSpeed(0, 0.001), "slow": NodeSpeed(0, 1000.0)})
    assert s["slow"] == 2 and sum(s.values()) == 8  # at least two samples: BatchNorm fails on a batch of one
    assert placement.balance(3, {"fast": NodeSpeed(0, 0.001), "slow": NodeSpeed(0, 1000.0)})["slow"] == 1


def test_an_unknown_model_is_one_uncompressed_vector_priced_like_the_measured_all_reduce() -> None:
    # gradients of unknown shapes: the bench's payload as one tensor, one bucket, nothing hidden under backward
    assert NET.per_byte_s == pytest.approx(0.199 / bench.MODEL_BYTES)  # 2 ranks: each sends the payload once
    speeds = {n: NodeSpeed(0.0, 0.01) for n in "abcd"}
    assert placement.step_time({"a": 8}, speeds, NET) == (pytest.approx(0.08), 0.0)
    assert placement.step_time({"a": 8, "b": 8}, speeds, NET)[1] == pytest.approx(0.2)
    assert placement.step_time(dict.fromkeys("abcd", 8), speeds, NET)[1] == pytest.approx(0.001 + 0.199 * 1.5)


def test_candidates_prefer_the_split_that_keeps_the_slow_node_busy_not_late() -> None:
    speeds = {"fast": NodeSpeed(0.1, 0.025), "slow": NodeSpeed(0.1, 0.075)}
    one, two = placement.candidates(speeds, 16, NET, train_samples=1600)
    assert one.nodes == ["fast"] and one.even_images_per_s == pytest.approx(16 / (0.1 + 16 * 0.025))
    # even: 16 each -> the slow node takes 0.1 + 1.2 s; planned 24/8 -> both take 0.7 s
    assert two.even_images_per_s == pytest.approx(32 / (1.3 + 0.2))
    assert two.shares == {"fast": 24, "slow": 8}
    assert two.planned_images_per_s == pytest.approx(32 / (0.7 + 0.2))
    assert two.epoch_s == pytest.approx(50 * 0.9)


# bench recorded on a 4-node half-core lab (digits): four nodes of one speed,
# read 118-123 images/s apart by bench's spread; fixed_s, per_sample_s, powersgd_s, eval_image_s, save_s
DIGITS_LAB = {"node1": NodeSpeed(0.093532, 0.005563375, 0.137761, 0.0020313, 0.24686),
              "node2": NodeSpeed(0.087106, 0.0054255, 0.145193, 0.0018336, 0.29675),
              "node3": NodeSpeed(0.09354, 0.0054901875, 0.137331, 0.0020313, 0.33216),
              "node4": NodeSpeed(0.085669, 0.0054765, 0.148492, 0.0018348, 0.23591)}


def test_nodes_of_one_speed_keep_the_jobs_even_shares() -> None:
    """Balanced shares follow bench's spread on nodes of one speed: there they gave 33/33/31/31, which the
    model itself priced slower with PowerSGD (the node given more has the longest PowerSGD step), and a run
    on them is another draw than its even-share calibration. Kept even below SHARES_GAIN, balanced above."""
    from cluster.planner.commmodel import Scheme, param_shapes

    work = placement.Workload(param_shapes("resnet18", 10), schemes=(Scheme(), Scheme("powersgd", 4)),
                              train_samples=1438)
    psgd = Scheme("powersgd", 4)
    balanced, even = placement.balance(128, DIGITS_LAB), dict.fromkeys(DIGITS_LAB, 32)
    assert balanced == {"node1": 31, "node2": 33, "node3": 31, "node4": 33}
    t_balanced, t_even = (placement.step_time(shares, DIGITS_LAB, NET, work, psgd)[0] for shares in (balanced, even))
    assert t_balanced > t_even
    four = [c for c in placement.candidates(DIGITS_LAB, 32, NET, work=work) if len(c.nodes) == 4]
    assert len(four) == 2 and all(c.shares == even and c.planned_images_per_s == c.even_images_per_s for c in four)
    assert all(c.balanced == balanced and c.balanced_images_per_s < placement.SHARES_GAIN * c.even_images_per_s
               for c in four)
    kept = plans.even_kept(_choice(four[1], four))  # PowerSGD: balanced priced slower than even, and said so
    assert kept and "even ones (node2=32, node4=32, node3=32, node1=32)" in kept, kept  # fastest first
    assert "balanced ones (node2=33, node4=33, node3=31, node1=31)" in kept, kept
    assert f"at {four[1].balanced_images_per_s:.1f} images/s against {four[1].even_images_per_s:.1f} (-" in kept
    # one node a quarter slower a sample: balancing buys more than SHARES_GAIN and stands
    slow = dict(DIGITS_LAB, node4=NodeSpeed(0.085669, 0.0054765 * 1.25, 0.148492))
    four = [c for c in placement.candidates(slow, 32, NET, work=work) if len(c.nodes) == 4]
    assert len(four) == 2 and all(c.shares["node4"] < 32
                                  and c.planned_images_per_s >= placement.SHARES_GAIN * c.even_images_per_s
                                  for c in four)
    assert all(c.balanced is None for c in four) and plans.even_kept(_choice(four[1], four)) is None


def _choice(rec: placement.Placement, cands: list[placement.Placement]) -> placement.PlacementChoice:
    return placement.PlacementChoice("resnet50-ddp", "pytorch", "lab.yaml", 1.0, 1.0, DIGITS_LAB, NET, 32, cands, rec)


@pytest.mark.parametrize(("job", "start"), [("resnet50-ddp", str(bench.WARMUP_STEPS)), ("resnet50-tf", "1")])
def test_bench_times_powersgd_on_every_counted_step(job: str, start: str) -> None:
    """PyTorch's hook from the step after the warm-up; TensorFlow's from the first: its PowerSGD step is a
    tf.function of its own, whose tracing at a later start fell in the counted steps (1.2 s a step read)."""
    import shlex

    from cluster.inventory.model import Host
    from cluster.runs import jobs

    cmd = bench._node_cmd(Host("pc1", "127.0.0.1"), jobs.load(job), "d.npz", 12, 32, powersgd=True)
    words = shlex.split(cmd.split(" && ")[-1].split(">/dev/null")[0])
    assert words[0] == "CLUSTER_DDP_ALONE=1" and words[words.index("--grad-compression") + 1] == "powersgd"
    assert words[len(words) - 1 - words[::-1].index("--powersgd-start-step") + 1] == start  # the last one wins


def test_bench_fit_splits_a_step_into_fixed_and_per_sample_time() -> None:
    lines = [json.dumps({"type": "start"})] + [
        json.dumps({"type": "step", "data_s": 0.0, "compute_s": t}) for t in (5.0, 3.0, 1.0, 1.2, 0.8)]
    full = bench.step_rate("\n".join(lines), batch=16)
    assert full.step_s == 1.0 and full.images_per_s == 16.0 and full.steps == 3
    f = bench.fit(full, StepRate(batch=8, step_s=0.6, images_per_s=8 / 0.6, steps=3))
    assert f.per_sample_s == pytest.approx(0.05) and f.fixed_s == pytest.approx(0.2)
    assert NodeSpeed.from_bench(f).step(16) == pytest.approx(1.0)
    assert f.powersgd_s is None and "powersgd_s" not in f.to_dict()  # a bench from before the PowerSGD run

    # a rationed CPU: most steps short, one held back a quota period; an epoch of them takes the mean
    throttled = [json.dumps({"type": "step", "data_s": 0.01, "compute_s": t}) for t in (2.0, 2.0, 0.24, 0.24, 0.54)]
    rate = bench.step_rate("\n".join(throttled), batch=32)
    assert rate.step_s == pytest.approx(0.35) and rate.images_per_s == pytest.approx(32 / 0.35) and rate.steps == 3

    psgd = StepRate(batch=16, step_s=1.3, images_per_s=16 / 1.3, steps=3)  # DDP + the hook, one process
    g = bench.fit(full, StepRate(batch=8, step_s=0.6, images_per_s=8 / 0.6, steps=3), psgd)
    assert g.powersgd_s == pytest.approx(0.3) and bench.NodeBench.from_dict(g.to_dict()) == g
    assert NodeSpeed.from_bench(g).powersgd_s == pytest.approx(0.3)
    faster = StepRate(batch=16, step_s=0.9, images_per_s=16 / 0.9, steps=3)  # noise: never a negative cost
    assert bench.fit(full, StepRate(batch=8, step_s=0.6, images_per_s=8 / 0.6, steps=3), faster).powersgd_s == 0.0


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_bench_measures_an_epochs_end_from_the_runs_own_records() -> None:
    """A real bench run (tests/fixtures/bench): the evaluation is the epoch record's time less the last
    step's, over the images scored (the 359 validation images and 512 of the training shard), the
    checkpoint the end record's less the epoch record's; kept in the bench file and in the plan's speeds."""
    text = (FIXTURES / "bench" / "resnet18-epoch.jsonl").read_text()
    recs = [json.loads(x) for x in text.splitlines()]
    costs = bench.EpochCosts.from_records(text)
    assert costs is not None and costs.eval_images == 512 + 359
    epoch, end = next(r for r in recs if r["type"] == "epoch"), recs[-1]
    assert costs.eval_s == pytest.approx(epoch["time"] - [r for r in recs if r["type"] == "step"][-1]["time"])
    assert costs.save_s == pytest.approx(end["time"] - epoch["time"]) and 0 < costs.save_s < costs.eval_s
    full = bench.step_rate(text, 32)
    f = bench.fit(full, StepRate(batch=16, step_s=full.step_s * 0.7, images_per_s=1.0, steps=10), None, costs)
    assert f.eval_image_s == pytest.approx(costs.eval_s / 871) and f.save_s == costs.save_s
    assert bench.NodeBench.from_dict(f.to_dict()) == f
    speed = NodeSpeed.from_bench(f)
    assert speed.epoch_end(871) == pytest.approx(costs.eval_s + costs.save_s)
    assert NodeSpeed.from_dict(speed.to_dict()) == speed
    # a run cut short (no end record) or a program from before the fields: nothing, never a guess
    assert bench.EpochCosts.from_records("\n".join(text.splitlines()[:-1])) is None
    no_val = [json.dumps({k: v for k, v in recs[0].items() if k != "val_samples"}), *text.splitlines()[1:]]
    assert bench.EpochCosts.from_records("\n".join(no_val)) is None


def test_eval_images_shrink_with_the_ranks_down_to_the_training_sample() -> None:
    assert wlcommon.eval_images(1438, 359, 1) == 512 + 359
    assert wlcommon.eval_images(1438, 359, 4) == 128 + 90  # the training accuracy's 512 split over 4 ranks
    assert wlcommon.eval_images(1438, 359, 8) == 64 + 45
    assert wlcommon.eval_images(300, 359, 4) == 75 + 90  # a shard under its share: all of it
    assert wlcommon.eval_images(11_496, 360, 3) == 171 + 120  # 512 / 3 rounded up: every rank the same count


def test_precise_batchnorms_samples_are_split_over_the_ranks_as_the_training_accuracys() -> None:
    """bn_recompute is a total: each rank passes its share (the ranks' statistics are averaged, so n over W
    ranks is n on one node: test_workload_torch's two ranks against one), never under 2 (training-mode
    BatchNorm needs two samples), none where it is off."""
    assert [wlcommon.bn_samples(512, w) for w in (1, 2, 3, 4)] == [512, 256, 171, 128]
    assert wlcommon.bn_samples(0, 4) == 0 and wlcommon.bn_samples(3, 4) == 2
    assert wlcommon.eval_images(11_496, 360, 1, 512) == 512 + 512 + 360
    assert wlcommon.eval_images(11_496, 360, 4, 512) == 128 + 128 + 90  # 1,114 a rank until 2026-12-05
    assert wlcommon.eval_images(300, 359, 4, 512) == 75 + 75 + 90  # a shard under its share: all of it


# A benchmark file as `clusterctl bench` wrote it before the results were typed: node a with the two-size fit,
# node b from before the fit (images/s only), and the network. Loading and saving must keep it to the byte.
OLD_BENCH = {
    "inventory": "/labs/mixed.yaml", "time": 1764417600.5, "steps": 8,
    "compute": {"pytorch": {"job": "resnet50-ddp", "size": 32, "batch": 16, "nodes": {
        "a": {"images_per_s": 16.0, "step_s": 1.0, "steps": 6, "batch": 16, "fixed_s": 0.2, "per_sample_s": 0.05,
              "half": {"images_per_s": 13.333333333333334, "step_s": 0.6, "steps": 6, "batch": 8}},
        "b": {"images_per_s": 8.0, "step_s": 2.0, "steps": 6, "batch": 16}}}},
    "network": {"nodes": 2, "busbw_MBps": 110.5, "model_allreduce_s": 0.2,
                "per_node_busbw_MBps": {"a": 110.5, "b": 112.0}, "latency_s": 0.001},
    "errors": {"resnet50-tf/b": "exit 1"}, "unreachable": [],
}


def test_a_saved_benchmark_loads_typed_and_saves_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    inv = loader.load(_inventory(tmp_path), check_files=False)
    p = bench.bench_path(inv)
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(OLD_BENCH, indent=1))
    b = bench.load(inv)
    assert b.compute["pytorch"].nodes["a"].half == StepRate(13.333333333333334, 0.6, 6, 8)
    assert b.network is not None and b.network.per_node_busbw_MBps["b"] == 112.0
    assert json.dumps(b.to_dict(), indent=1) == p.read_text()
    speeds = {n: NodeSpeed.from_bench(r) for n, r in b.compute["pytorch"].nodes.items()}
    assert speeds == {"a": NodeSpeed(0.2, 0.05), "b": NodeSpeed(0.0, 1 / 8.0)}  # b: from before the fit


def test_a_plan_document_round_trips_and_a_damaged_one_names_its_file(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    inv = loader.load(_inventory(tmp_path), check_files=False)
    b = bench.BenchResult.from_dict(OLD_BENCH)
    speeds = {n: NodeSpeed.from_bench(r) for n, r in b.compute["pytorch"].nodes.items()}
    cands = placement.candidates(speeds, 16, b.network, train_samples=1600)
    choice = placement.PlacementChoice("resnet50-ddp", "pytorch", str(inv.path), 2.0, b.time, speeds, b.network,
                                       16, cands, max(cands, key=lambda c: c.planned_images_per_s))
    doc = json.loads(json.dumps(choice.to_dict()))
    assert placement.PlacementChoice.from_dict(doc) == choice
    assert list(doc["recommended"]) == ["nodes", "global_batch", "shares", "even_images_per_s",
                                        "planned_images_per_s", "step_s", "comm_s", "epoch_s", "grad_compression",
                                        "powersgd_rank", "accumulate", "bytes_per_step", "warnings", "run_s",
                                        "e2e_images_per_s", "powersgd_wire", "balanced", "balanced_images_per_s"]
    p = plans.choice_path(inv, "resnet50-ddp")
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(doc))
    assert plans.overrides_for(inv, "resnet50-ddp") == (
        [f"nodes=[{', '.join(choice.recommended.nodes)}]"]
        + [f"shares.{n}={s}" for n, s in choice.recommended.shares.items()]
        + ["grad_compression=none", "accumulate=1"])
    p.write_text('{"recommended": {"nodes": "a"}}')
    with pytest.raises(UsageError, match=str(p)):
        plans.load_recommended(inv, "resnet50-ddp")


def _inventory(tmp_path: Path) -> Path:
    f = tmp_path / "mixed.yaml"
    f.write_text("name: mixed\nhosts:\n  a: {address: 127.0.0.1}\n  b: {address: 127.0.0.1}\n")
    return f


def test_summary_rows_are_the_tables_bench_and_plan_print() -> None:
    b = bench.BenchResult.from_dict(OLD_BENCH)
    header, rows = bench.summary_rows(b)
    assert header == ["node", "pytorch images/s", "pytorch step s"]
    assert rows == [["a", "16.0", "1.000"], ["b", "8.0", "2.000"]]
    assert bench.summary_rows(b, ["b", "c"])[1] == [["b", "8.0", "2.000"], ["c", "-", "-"]]
    speeds = {n: NodeSpeed.from_bench(r) for n, r in b.compute["pytorch"].nodes.items()}
    cands = placement.candidates(speeds, 16, b.network, train_samples=1600)
    choice = placement.PlacementChoice("resnet50-ddp", "pytorch", "/labs/mixed.yaml", 2.0, b.time, speeds,
                                       b.network, 16, cands, cands[0])
    header, rows = plans.summary_rows(choice)
    assert header[:3] == ["nodes", "scheme", "global batch"] and len(rows) == 2
    assert all(len(r) == len(header) for r in rows)
    assert rows[0][0] == "a (recommended)" and rows[1][0] == "a,b" and rows[0][1] == "none" and rows[0][2] == "16"
    assert rows[0][3] == f"{16 / 1.0:.1f}" and rows[0][-1] == "a=16" and rows[0][header.index("MB/step")] == "0.00"
