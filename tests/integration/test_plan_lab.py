"""bench -> plan -> launch --plan -> report on a lab made heterogeneous by CPU quotas (cgroups)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import clusterctl_json, provisioned_lab, pytestmark  # noqa: F401

JOB = ["--set", "batch=8", "--set", "threads=1"]


@pytest.fixture(scope="module")
def qlab(tmp_path_factory: pytest.TempPathFactory):
    yield from provisioned_lab(tmp_path_factory, "p", 2, 8, cpu_quotas=[1.0, 0.3])


def test_bench_plan_and_a_planned_launch(qlab) -> None:
    state, env = qlab
    rc, b = clusterctl_json("bench", "--jobs", "resnet50-ddp", "--steps", "5", *JOB, env=env, timeout=900)
    assert rc == 0, b
    speeds = {n: r["images_per_s"] for n, r in b["compute"]["pytorch"]["nodes"].items()}
    assert set(speeds) == {"node1", "node2"} and speeds["node1"] > 1.5 * speeds["node2"]  # the quota is real
    net = b["network"]
    assert net["nodes"] == 2 and net["busbw_MBps"] > 0 and 0 < net["latency_s"] < 1
    rc, p = clusterctl_json("plan", "resnet50-ddp", *JOB, env=env)
    assert rc == 0, p
    two = next(c for c in p["candidates"] if len(c["nodes"]) == 2)
    assert sum(two["shares"].values()) == 16 and two["shares"]["node1"] > two["shares"]["node2"]
    assert two["planned_images_per_s"] > two["even_images_per_s"]  # the model sees the slow node's cost
    rec_nodes = p["recommended"]["nodes"]
    rc, run = clusterctl_json("launch", "resnet50-ddp", "--plan", *JOB, "--set", "epochs=2", "--set", "max_steps=3",
                              env=env, timeout=900)
    assert rc == 0 and run["state"] == "succeeded", json.dumps(run)[-2000:]
    assert run["prediction"]["nodes"] == rec_nodes and run["settings"]["shares"] == p["recommended"]["shares"]
    for i, n in enumerate(state.nodes):
        if n.name not in rec_nodes:
            continue
        metrics = Path(n.dir) / "srv" / "runs" / run["run_id"] / "out"
        start = json.loads(next(metrics.glob("metrics-rank*.jsonl")).read_text().splitlines()[0])
        assert start["batch"] == p["recommended"]["shares"][n.name]  # each node trains its planned share
        assert start["accumulate"] == p["recommended"]["accumulate"]  # and the scheme the plan picked
        assert start["grad_compression"] == p["recommended"]["grad_compression"]
        assert start["global_batch"] == p["recommended"]["accumulate"] * sum(p["recommended"]["shares"].values())
    rc, _ = clusterctl_json("collect", run["run_id"], env=env, timeout=600)
    assert rc == 0
    rc, rep = clusterctl_json("report", run["run_id"], env=env, timeout=300)
    assert rc == 0 and rep["runs"][0]["predicted_images_per_s"] == pytest.approx(
        p["recommended"]["planned_images_per_s"])
