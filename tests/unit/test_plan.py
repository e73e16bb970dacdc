"""The planner's model and the benchmark's reading of step records, on numbers worked out by hand."""
from __future__ import annotations

import json

import pytest

from cluster import bench, plan
from cluster.plan import NodeSpeed

NET = {"latency_s": 0.001, "model_allreduce_s": 0.2, "nodes": 2}


def test_balance_equalises_finish_times_in_whole_samples() -> None:
    # no fixed part: proportional to speed (30 vs 10 images/s)
    assert plan.balance(32, {"a": NodeSpeed(0, 1 / 30), "b": NodeSpeed(0, 1 / 10)}) == {"a": 24, "b": 8}
    # same per-sample cost, b has 0.3 s more fixed work per step: a takes 0.3 s / 0.02 = 15 samples more
    sh = plan.balance(32, {"a": NodeSpeed(0.0, 0.02), "b": NodeSpeed(0.3, 0.02)})
    assert sum(sh.values()) == 32 and sh["a"] - sh["b"] in (15, 16)
    s = plan.balance(8, {"fast": NodeSpeed(0, 0.001), "slow": NodeSpeed(0, 1000.0)})
    assert s["slow"] == 1 and sum(s.values()) == 8  # every chosen node gets at least one sample


def test_comm_time_scales_the_measured_all_reduce_by_the_ring_volume() -> None:
    assert plan.comm_time(NET, 1) == 0.0
    assert plan.comm_time(NET, 2) == pytest.approx(0.2)
    assert plan.comm_time(NET, 4) == pytest.approx(0.001 + 0.199 * 1.5)


def test_candidates_prefer_the_split_that_keeps_the_slow_node_busy_not_late() -> None:
    speeds = {"fast": NodeSpeed(0.1, 0.025), "slow": NodeSpeed(0.1, 0.075)}
    one, two = plan.candidates(speeds, 16, NET, train_samples=1600)
    assert one.nodes == ["fast"] and one.even_images_per_s == pytest.approx(16 / (0.1 + 16 * 0.025))
    # even: 16 each -> the slow node takes 0.1 + 1.2 s; planned 24/8 -> both take 0.7 s
    assert two.even_images_per_s == pytest.approx(32 / (1.3 + 0.2))
    assert two.shares == {"fast": 24, "slow": 8}
    assert two.planned_images_per_s == pytest.approx(32 / (0.7 + 0.2))
    assert two.epoch_s == pytest.approx(50 * 0.9)


def test_bench_fit_splits_a_step_into_fixed_and_per_sample_time() -> None:
    lines = [json.dumps({"type": "start"})] + [
        json.dumps({"type": "step", "data_s": 0.0, "compute_s": t}) for t in (5.0, 3.0, 1.0, 1.2, 0.8)]
    full = bench.step_rate("\n".join(lines), batch=16)
    assert full["step_s"] == 1.0 and full["images_per_s"] == 16.0 and full["steps"] == 3
    f = bench.fit(full, {"batch": 8, "step_s": 0.6, "images_per_s": 8 / 0.6})
    assert f["per_sample_s"] == pytest.approx(0.05) and f["fixed_s"] == pytest.approx(0.2)
    assert NodeSpeed.from_bench(f).step(16) == pytest.approx(1.0)
