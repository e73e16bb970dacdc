"""The planner's model and the benchmark's reading of step records, on numbers worked out by hand."""
from __future__ import annotations

import json

import pytest

from cluster import bench, plan

NET = {"latency_s": 0.001, "busbw_MBps": 100.0, "nodes": 2}


def test_split_is_proportional_whole_and_complete() -> None:
    assert plan.split(32, {"a": 30.0, "b": 10.0}) == {"a": 24, "b": 8}
    assert plan.split(10, {"a": 1.0, "b": 1.0, "c": 1.0}) in ({"a": 4, "b": 3, "c": 3}, {"a": 3, "b": 4, "c": 3},
                                                             {"a": 3, "b": 3, "c": 4})
    s = plan.split(8, {"fast": 1000.0, "slow": 0.001})
    assert s["slow"] == 1 and sum(s.values()) == 8  # every chosen node gets at least one sample


def test_comm_time_is_a_ring_all_reduce_of_the_model() -> None:
    assert plan.comm_time(NET, 1) == 0.0
    assert plan.comm_time(NET, 2) == pytest.approx(0.001 + bench.MODEL_BYTES * 1 / 100e6)
    assert plan.comm_time(NET, 4) == pytest.approx(0.001 + bench.MODEL_BYTES * 1.5 / 100e6)


def test_candidates_prefer_the_split_that_keeps_the_slow_node_busy_not_late() -> None:
    speeds = {"fast": 30.0, "slow": 10.0}
    cands = plan.candidates(speeds, 16, NET, train_samples=1600)
    one, two = cands
    assert one.nodes == ["fast"] and one.even_images_per_s == pytest.approx(30.0)
    comm = plan.comm_time(NET, 2)
    # even: 16 each -> the slow node takes 1.6 s; planned: 24/8 -> both take 0.8 s
    assert two.even_images_per_s == pytest.approx(32 / (1.6 + comm))
    assert two.shares == {"fast": 24, "slow": 8}
    assert two.planned_images_per_s == pytest.approx(32 / (0.8 + comm))
    assert two.epoch_s == pytest.approx(50 * (0.8 + comm))


def test_step_rate_skips_warm_up_steps() -> None:
    lines = [json.dumps({"type": "start"})] + [
        json.dumps({"type": "step", "data_s": 0.0, "compute_s": t}) for t in (5.0, 3.0, 1.0, 1.2, 0.8)]
    r = bench.step_rate("\n".join(lines), batch=16)
    assert r["step_s"] == 1.0 and r["images_per_s"] == 16.0 and r["steps"] == 3
