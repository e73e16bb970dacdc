"""Continuing without a lost node (cluster/runs/elastic.py): the global-batch rule and when a run may go on,
judged on records and agent replies as the lab's real runs produce them (tests/integration/test_elastic_lab.py
runs it for real)."""
from __future__ import annotations

import time
from typing import Any

import pytest

from cluster.runs.nodestatus import NodeStatus
from cluster.runs import elastic, records, state


def rec(min_nodes: int = 2, nodes: int = 3, **kw: Any) -> records.RunRecord:
    names = [f"node{i + 1}" for i in range(nodes)]
    r = records.RunRecord(run_id="r-1", job="resnet50-ddp", framework="pytorch", state="running",
                          created=time.time() - 100, started=time.time() - 90,
                          nodes=[records.RunNode(n, i, 1, "/srv/runs/r-1") for i, n in enumerate(names)],
                          inventory={"hosts": [{"name": n} for n in names]},
                          settings={"min_nodes": min_nodes, "batch": 8, "shares": {}, "code": None}, **kw)
    r.periods = [{"period": 1, "nodes": names, "world_size": nodes, "node_batch": {n: 8 for n in names}}]
    return r


def st(node: str, s: str, **kw: Any) -> NodeStatus:
    return NodeStatus(node, s, **kw)


@pytest.mark.parametrize("before,survivors,want", [
    ({"node1": 8, "node2": 8, "node3": 8}, ["node1", "node2"], {"node1": 12, "node2": 12}),
    ({"node1": 8, "node2": 8, "node3": 8, "node4": 8}, ["node1", "node2", "node3"], {"node1": 11, "node2": 11,
                                                                                       "node3": 10}),
    ({"node1": 48, "node2": 16, "node3": 32}, ["node2", "node3"], {"node2": 32, "node3": 64}),
    ({"node1": 1, "node2": 1, "node3": 1}, ["node3"], {"node3": 3}),
])
def test_the_global_batch_is_kept_in_proportion(before: dict[str, int], survivors: list[str],
                                                want: dict[str, int]) -> None:
    got = elastic.keep_global_batch(before, survivors)
    assert got == want and sum(got.values()) == sum(before.values())


def test_even_batches_stay_batch_uneven_ones_become_shares() -> None:
    s = {"batch": 8, "shares": {}, "code": None}
    assert elastic._settings_for(s, {"node1": 12, "node2": 12}, {"node1": 1, "node2": 1})["batch"] == 12
    uneven = elastic._settings_for(s, {"node1": 11, "node2": 11, "node3": 10}, {"node1": 1, "node2": 1, "node3": 1})
    assert uneven["shares"] == {"node1": 11, "node2": 11, "node3": 10} and uneven["batch"] == 8
    assert elastic.node_batches({"code": "/x", "batch": 8}, {"node1": 1}) is None  # a user's program: its own


def test_a_node_silent_past_the_grace_restarts_the_run_without_it() -> None:
    r = rec()
    now = time.time()
    r.last_seen = {"node1": now, "node2": now, "node3": now - state.UNREACHABLE_GRACE_S - 1}
    statuses = {"node1": st("node1", "running"), "node2": st("node2", "running"),
                "node3": st("node3", "unreachable", error="timed out")}
    state._apply(r, statuses)
    assert r.state == "restarting" and r.reform is not None and r.reform["lost"] == ["node3"]
    assert r.members() == ["node1", "node2"] and r.dropped["node3"]["period"] == 1
    assert "node3" in r.stop_pending and r.failure is None


def test_a_failure_while_a_peer_is_silent_waits_for_the_grace() -> None:
    """node3's PC died: node1's program fails at once on the broken connection; the run waits for node3's
    grace instead of failing on node1, then goes on without node3 (node1 and node2 restart)."""
    r = rec()
    now = time.time()
    r.last_seen = {"node1": now, "node2": now, "node3": now - 5}
    statuses = {"node1": st("node1", "failed", exit_code=1), "node2": st("node2", "running"),
                "node3": st("node3", "unreachable", error="refused")}
    state._apply(r, statuses)
    assert r.state == "running" and r.failure is None
    r.last_seen["node3"] = now - state.UNREACHABLE_GRACE_S - 1
    state._apply(r, statuses)
    assert r.state == "restarting" and r.reform["lost"] == ["node3"]


@pytest.mark.parametrize("min_nodes,nodes", [(0, 3), (3, 3), (2, 2)])
def test_without_min_nodes_or_below_it_the_run_fails_as_before(min_nodes: int, nodes: int) -> None:
    r = rec(min_nodes, nodes)
    now = time.time()
    r.last_seen = {n: now for n in r.members()}
    r.last_seen[f"node{nodes}"] = now - state.UNREACHABLE_GRACE_S - 1
    statuses = {n: st(n, "running") for n in r.members()}
    statuses[f"node{nodes}"] = st(f"node{nodes}", "unreachable", error="timed out")
    state._apply(r, statuses)
    assert r.state == "failed" and r.failure is not None and r.failure.node == f"node{nodes}"


def test_a_program_failure_with_every_node_answering_fails_the_run() -> None:
    """A bug or an OOM is not a lost node: restarting would repeat it."""
    r = rec()
    statuses = {"node1": st("node1", "failed", exit_code=1), "node2": st("node2", "running"),
                "node3": st("node3", "running")}
    state._apply(r, statuses)
    assert r.state == "failed" and r.failure.node == "node1"


def test_a_dropped_node_has_no_say_and_its_return_is_noted() -> None:
    r = rec()
    r.dropped = {"node3": {"why": "x", "at": 1.0, "period": 1, "came_back": None}}
    r.periods.append({"period": 2, "nodes": ["node1", "node2"], "world_size": 2, "from_epoch": None})
    statuses = {"node1": st("node1", "succeeded", period=2, start_epoch=1, start_step=8),
                "node2": st("node2", "succeeded", period=2, start_epoch=1, start_step=8),
                "node3": st("node3", "failed", exit_code=1)}
    state._apply(r, statuses)
    assert r.state == "succeeded" and r.dropped["node3"]["came_back"]
    assert (r.periods[-1]["from_epoch"], r.periods[-1]["from_step"]) == (1, 8)
    assert "period 2: node1, node2 (world 2) from epoch 1 (step 8)" in elastic.describe(r)
