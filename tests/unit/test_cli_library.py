"""What the CLI used to do itself and now asks the library for: collecting several runs and their combined
verdict, and following a run's logs (no node contacted: the calls underneath are replaced by recordings)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.runs import collect, logstream, records, state as runstate
from cluster.schedulers import api
from cluster.runs.collect import NodeCollect
from cluster.errors import UsageError


def record(run_id: str, state: str = "succeeded") -> records.RunRecord:
    return records.RunRecord.from_dict({
        "run_id": run_id, "job": "j", "framework": "pytorch", "state": state, "created": 1.0,
        "nodes": [{"node": n, "node_rank": i, "nproc": 1, "run_dir": f"/srv/runs/{run_id}"}
                  for i, n in enumerate(("a", "b"))],
        "inventory": {"hosts": [{"name": "a", "address": "127.0.0.1"}, {"name": "b", "address": "127.0.0.1"}]}})


@pytest.mark.parametrize("outcomes, verdict", [
    ({"r1": ("ok", "ok"), "r2": ("ok", "ok")}, "ok"),
    ({"r1": ("ok", "failed"), "r2": ("ok", "ok")}, "failed"),
    ({"r1": ("ok", "refused"), "r2": ("ok", "ok")}, "failed"),  # a refused file fails the run's collect
    ({"r1": ("ok", "failed"), "r2": ("unreachable", "ok")}, "unreachable"),  # the worst of the runs
    ({"r1": ("unreachable", "failed")}, "unreachable"),
])
def test_collect_runs_gives_each_run_and_the_worst_verdict(monkeypatch: pytest.MonkeyPatch,
                                                           outcomes: dict[str, tuple[str, str]], verdict: str) -> None:
    seen: list[tuple[str, str, int]] = []

    def fake(rec: records.RunRecord, checkpoints: bool = False, forks: int = 32, on_bytes: Any = None,
             inventory_hosts: Any = None) -> dict[str, NodeCollect]:
        nodes = {}
        for node, status in zip(("a", "b"), outcomes[rec.run_id]):
            c = NodeCollect(node, status="ok" if status == "refused" else status)
            if status == "refused":
                c.refused.append({"path": "../x", "reason": "climbs out"})
            on_bytes(node, 10)
            nodes[node] = c
        return nodes

    monkeypatch.setattr(collect, "collect", fake)
    summary = api.collect_runs([record(r) for r in outcomes],
                                   on_bytes=lambda run, node, n: seen.append((run, node, n)))
    assert [r.run_id for r in summary.runs] == list(outcomes) and summary.verdict == verdict
    assert seen == [(r, n, 10) for r in outcomes for n in ("a", "b")]
    doc = summary.runs[0].to_dict()
    assert doc["run_id"] == "r1" and Path(doc["folder"]) == records.run_path("r1")
    assert [n["node"] for n in doc["nodes"]] == ["a", "b"]


def test_collect_runs_of_nothing_is_ok() -> None:
    assert api.collect_runs([]).verdict == "ok"


def test_chosen_runs_all_skips_dry_runs_and_refuses_a_run_too() -> None:
    for rid, state in (("r1", "succeeded"), ("r2", "dry-run"), ("r3", "failed")):
        records.save(record(rid, state))
    assert sorted(r.run_id for r in collect.chosen_runs(None, True)) == ["r1", "r3"]
    assert [r.run_id for r in collect.chosen_runs("r2", False)] == ["r2"]
    with pytest.raises(UsageError, match="not both"):
        collect.chosen_runs("r1", True)


def test_logstream_follows_until_the_run_is_no_longer_active(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each node's new text from its last offset, line by line; one more read after the run ended."""
    logs = {"a": ["one\ntwo\n", "three\n", "four\n"], "b": ["x\n", "", ""]}
    reads: list[dict[str, int]] = []
    states = iter(["running", "succeeded"])
    slept: list[float] = []

    def fake_logs(rec: records.RunRecord, node: str | None = None, offsets: dict[str, int] | None = None,
                  lines: int = 50) -> dict[str, tuple[str, int]]:
        assert offsets is not None
        reads.append(dict(offsets))
        i = len(reads) - 1
        return {n: (chunks[i], sum(len(c) for c in chunks[:i + 1])) for n, chunks in logs.items()
                if node in (None, n)}

    def fake_refresh(rec: records.RunRecord) -> records.RunRecord:
        rec.state = next(states)
        return rec

    monkeypatch.setattr(runstate, "logs", fake_logs)
    monkeypatch.setattr(runstate, "refresh", fake_refresh)
    got = list(logstream.follow(record("r1", "running"), sleep=slept.append))
    assert got == [("a", "one"), ("a", "two"), ("b", "x"), ("a", "three"), ("a", "four")]
    assert reads == [{}, {"a": 8, "b": 2}, {"a": 14, "b": 2}] and slept == [1.0, 1.0]


def test_logstream_of_an_ended_run_reads_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runstate, "logs", lambda rec, node=None, offsets=None, lines=50: {"a": ("last\n", 5)})
    monkeypatch.setattr(runstate, "refresh", lambda rec: pytest.fail("an ended run is not asked again"))
    assert list(logstream.follow(record("r1"), "a", sleep=lambda s: pytest.fail("no wait"))) == [("a", "last")]

