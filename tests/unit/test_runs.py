"""Run records under concurrency, and the verdict on a run from its nodes' states."""
from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from cluster.runs import preflight, records as runs, state as runstate
from cluster.nodes.replies import agent_reply
from cluster.runs.nodestatus import AGENT_STATES, NodeStatus
from cluster.runs.state import judge


def _record(run_id: str = "r1", nodes: tuple[str, ...] = ("a", "b"), state: str = "running") -> runs.RunRecord:
    return runs.RunRecord(
        run_id=run_id, job="j", framework="pytorch", state=state, created=100.0, started=100.0,
        nodes=[runs.RunNode(n, i, 1, f"/srv/runs/{run_id}") for i, n in enumerate(nodes)],
        inventory={"path": "inv.yaml", "name": "lab",
                   "hosts": [{"name": n, "address": "127.0.0.1", "port": 1} for n in nodes]})


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    return tmp_path


def _bump(home: str, key: str, n: int) -> None:
    os.environ["CLUSTERCTL_HOME"] = home
    for _ in range(n):
        runs.update("r1", lambda r: r.extra.__setitem__(key, r.extra.get(key, 0) + 1))


def _read_many(home: str, n: int, q: multiprocessing.Queue) -> None:
    os.environ["CLUSTERCTL_HOME"] = home
    bad = 0
    for _ in range(n):
        try:
            json.loads((Path(home) / "runs" / "r1" / "run.json").read_text())
        except ValueError:
            bad += 1
    q.put(bad)


def test_concurrent_updates_lose_nothing_and_readers_never_see_a_torn_record(home: Path) -> None:
    runs.save(_record())
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue = ctx.Queue()
    procs = [ctx.Process(target=_bump, args=(str(home), k, 150)) for k in ("x", "y")]
    procs.append(ctx.Process(target=_read_many, args=(str(home), 1500, q)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert q.get(timeout=5) == 0
    rec = runs.load("r1")
    assert rec.extra == {"x": 150, "y": 150}  # every read-modify-write kept: no lost update, no crash
    assert not list((home / "runs" / "r1").glob("*.tmp"))


def test_a_damaged_record_is_reported_never_skipped(home: Path) -> None:
    runs.save(_record("good"))
    bad = home / "runs" / "bad"
    bad.mkdir()
    (bad / "run.json").write_text('{"run_id": "bad", "state": "runn')
    records, damaged = runs.scan()
    assert [r.run_id for r in records] == ["good"]
    assert len(damaged) == 1 and "bad/run.json" in damaged[0].message and damaged[0].fix
    with pytest.raises(runs.RecordError):
        runs.list_runs()
    with pytest.raises(preflight.LaunchRefused, match="cannot tell whether the nodes are free"):
        preflight.refuse_busy(_record("new").hosts())
    (bad / "run.json").write_text(json.dumps({"run_id": 3, "nodes": "x"}))
    with pytest.raises(runs.RecordError, match="damaged run record"):
        runs.load("bad")


def test_unknown_fields_of_a_newer_version_survive_a_round_trip(home: Path) -> None:
    d = _record().to_dict() | {"from_the_future": {"a": 1}}
    rec = runs.RunRecord.from_dict(d)
    runs.save(rec)
    assert json.loads((home / "runs" / "r1" / "run.json").read_text())["from_the_future"] == {"a": 1}


def test_the_lock_wait_is_bounded(home: Path) -> None:
    runs.save(_record())
    with runs.lock("r1"):
        t0 = time.monotonic()
        with pytest.raises(runs.ClusterError, match="locked by another clusterctl"):
            with runs.file_lock(runs.run_path("r1") / ".lock", "run r1", wait=0.3):
                pass
        assert time.monotonic() - t0 < 2


def test_judge_names_the_first_node_to_fail() -> None:
    rec = _record(nodes=("a", "b", "c"))
    st = {"a": NodeStatus("a", "running"), "b": NodeStatus("b", "failed", exit_code=1, ended=20.0, log=["x"]),
          "c": NodeStatus("c", "failed", exit_code=1, ended=10.0)}
    assert judge(rec, st) == "failed"
    assert rec.failure is not None and rec.failure.node == "c" and rec.failure.also == ["b"]
    assert judge(_record(), {"a": NodeStatus("a", "succeeded"), "b": NodeStatus("b", "succeeded")}) == "succeeded"
    assert judge(_record(), {"a": NodeStatus("a", "stopped"), "b": NodeStatus("b", "succeeded")}) == "stopped"


@pytest.mark.parametrize("silent", ["unreachable", "unanswered"])
def test_a_silent_node_fails_the_run_after_the_grace_counted_from_its_last_answer(silent: str) -> None:
    """A slow or garbled agent reply is not a failure at once; silence longer than the grace is."""
    rec = _record()
    grace = runstate.UNREACHABLE_GRACE_S
    ok = {"a": NodeStatus("a", "running"), "b": NodeStatus("b", "running", log=["epoch 3 loss 0.5"])}
    assert judge(rec, ok, now=200.0) == "running"
    runstate._remember(rec, ok)
    quiet = {"a": NodeStatus("a", "running"), "b": NodeStatus("b", silent, error="no answer")}
    assert judge(rec, quiet, now=200.0 + grace - 1) == "running"
    # the clock lives in the record: it survives a save and a load by another process
    rec = runs.RunRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert judge(rec, quiet, now=200.0 + grace + 1) == "failed"
    assert rec.failure is not None and rec.failure.node == "b" and silent in rec.failure.reason
    assert rec.failure.log == ["epoch 3 loss 0.5"]  # the last lines it was seen with


def test_a_node_that_answers_again_restarts_its_clock() -> None:
    rec = _record()
    grace = runstate.UNREACHABLE_GRACE_S
    quiet = {"a": NodeStatus("a", "running"), "b": NodeStatus("b", "unanswered")}
    assert judge(rec, quiet, now=100.0 + grace - 5) == "running"
    assert judge(rec, {"a": NodeStatus("a", "running"), "b": NodeStatus("b", "running")},
                 now=100.0 + grace - 4) == "running"
    assert judge(rec, quiet, now=100.0 + grace + 5) == "running"


def test_a_silent_node_keeps_its_last_known_log_and_metrics() -> None:
    rec = _record()
    runstate._remember(rec, {"a": NodeStatus("a", "running"), "b": NodeStatus("b", "running", epoch=2, log=["l"])})
    runstate._remember(rec, {"a": NodeStatus("a", "running"), "b": NodeStatus("b", "unreachable", error="timeout")})
    assert rec.last_status is not None
    assert rec.last_status["b"]["state"] == "unreachable" and rec.last_status["b"]["epoch"] == 2
    assert rec.last_status["b"]["log"] == ["l"]


@pytest.mark.parametrize("stdout", ["", "garbage", "[1, 2]", '{"state": 3}', "Traceback...\n"])
def test_agent_replies_that_cannot_be_read_are_unanswered_not_failed(stdout: str) -> None:
    assert agent_reply(stdout) is None or not isinstance(agent_reply(stdout).get("state"), str)


# --------------------------------------------------------------------------- any input, no traceback

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=20)
AGENT_KEYS = st.sampled_from(["state", "exit", "metrics", "log", "processes", "error", "pid"])
AGENT_DOCS = st.dictionaries(AGENT_KEYS, JSON | st.sampled_from(["running", "failed", "succeeded"]), max_size=7) | \
    st.fixed_dictionaries({"state": st.sampled_from(AGENT_STATES)},
                          optional={"exit": st.dictionaries(st.sampled_from(["code", "ended"]), JSON),
                                    "metrics": st.dictionaries(st.text(max_size=3) | st.sampled_from(["0", "1"]),
                                                               st.dictionaries(st.sampled_from(["start", "step", "end"]),
                                                                               JSON | st.dictionaries(
                                                                                   st.sampled_from(["world", "epoch", "step", "loss", "images_per_s"]),
                                                                                   JSON))),
                                    "log": JSON, "processes": JSON})


@settings(max_examples=150, deadline=None)
@given(AGENT_DOCS)
def test_any_agent_reply_gives_a_status_never_an_exception(doc: dict) -> None:
    s = NodeStatus.from_agent("n", doc)
    assert s.state in (*AGENT_STATES, "unanswered")
    assert all(isinstance(x, str) for x in s.log)
    assert s.step is None or isinstance(s.step, int)
    judge(_record(nodes=("n",)), {"n": s}, now=1000.0)


RECORD_KEYS = st.sampled_from(["run_id", "job", "framework", "state", "created", "nodes", "inventory", "failure",
                               "last_seen", "stop_pending", "settings", "x"])


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(RECORD_KEYS, JSON, max_size=10) | JSON)
def test_any_run_json_loads_or_is_refused_as_damaged(doc: object) -> None:
    try:
        rec = runs.RunRecord.from_dict(doc)
    except runs.RecordError as e:
        assert "run.json" in e.message and e.fix
        return
    rec.to_dict()


@pytest.mark.parametrize("change", [{"created": "yesterday"}, {"nodes": [{"node": "a", "node_rank": "0", "nproc": 1,
                                                                          "run_dir": "/x"}]},
                                    {"run_id": "../etc"}, {"last_seen": {"a": "x"}}, {"failure": {"node": 1, "reason": "r"}},
                                    {"inventory": {"hosts": [["a"]]}}, {"stop_pending": "node2"}])
def test_a_record_with_a_wrong_type_is_refused_naming_the_field(change: dict) -> None:
    with pytest.raises(runs.RecordError, match="damaged run record"):
        runs.RunRecord.from_dict(_record().to_dict() | change)


@pytest.mark.parametrize("name", sorted(runs.RUN_FOLDER_ENTRIES))
def test_a_host_named_like_a_run_folder_entry_is_refused(tmp_path: Path, name: str) -> None:
    """Each node's results are collected into runs/<id>/<node>/, beside run.json and rendered/."""
    from cluster.runs import jobs
    from cluster.inventory import loader
    from cluster.errors import UsageError
    from tests.conftest import write

    inv = loader.load(write(tmp_path, f"hosts:\n  {name}: {{address: 127.0.0.1}}\n", "inv.yaml"),
                         check_files=False)
    with pytest.raises(UsageError, match=f"host name '{name}' is the name of a file clusterctl keeps"):
        preflight.select_hosts(inv, jobs.load("resnet50-ddp"), None)


# --------------------------------------------------------------------------- the state machine


def test_a_final_or_stopping_state_is_never_overwritten() -> None:
    """RunRecord.move is the one place a state changes: a late step cannot undo a stop or a verdict."""
    r = _record(state="starting")
    assert r.move("stopping") and r.state == "stopping" and r.ended is None
    assert not r.move("running") and not r.move("failed") and r.state == "stopping"
    assert r.move("stopped") and r.ended is not None
    for later in ("running", "starting", "stopping", "failed", "succeeded"):
        assert not r.move(later) and r.state == "stopped"
    done = _record(state="failed")
    assert not done.move("running") and not done.move("stopping") and done.move("failed")


def _statuses(**states: str) -> dict[str, NodeStatus]:
    return {n: NodeStatus(n, s) for n, s in states.items()}


@pytest.mark.parametrize("after, final", [(("succeeded", "succeeded"), "succeeded"),
                                          (("succeeded", "stopped"), "stopped"),
                                          (("stopped", "stopped"), "stopped")])
def test_a_stop_that_finds_every_program_ended_by_itself_leaves_the_run_succeeded(
        home: Path, monkeypatch: pytest.MonkeyPatch, after: tuple[str, str], final: str) -> None:
    """The nodes' agents write no stop where the program had ended (nodeagent.stop), so after the stop they
    say `succeeded` only for a program that ended by itself with exit 0. Every node so: the run succeeded
    (a run that ended at its target_acc, stopped by a script that saw its last epoch); any node stopped:
    the run is stopped."""
    runs.save(_record())
    monkeypatch.setattr(runstate, "stop_nodes", lambda record, grace=10.0, only=None: {n: {"ok": True}
                                                                                      for n in only or []})
    monkeypatch.setattr(runstate, "poll", lambda record, group=None, lines=20: _statuses(a=after[0], b=after[1]))
    rec = runstate.stop(runs.load("r1"))
    assert (rec.state, rec.stop_pending, rec.stopped_by_user) == (final, [], True) and rec.ended is not None
    assert runs.load("r1").state == final


def test_a_pending_stop_whose_nodes_turn_out_to_have_succeeded_ends_succeeded_with_nothing_pending(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node b unreachable when the user stopped; it answers again: its program had ended by itself, exit 0,
    as had a's. Nothing is left to stop: the run succeeded and no node stays pending (which would refuse
    the next launch there)."""
    rec = _record(state="stopping")
    rec.stopped_by_user, rec.stop_pending, rec.stop_tried = True, ["b"], time.time() - 60
    runs.save(rec)
    monkeypatch.setattr(runstate, "stop_nodes", lambda record, grace=10.0, only=None: {n: {"ok": True}
                                                                                      for n in only or []})
    monkeypatch.setattr(runstate, "poll", lambda record, group=None, lines=20: _statuses(a="succeeded", b="succeeded"))
    rec = runstate.settle(rec, _statuses(a="succeeded", b="succeeded"))
    assert (rec.state, rec.stop_pending) == ("succeeded", [])


def test_a_users_stop_is_retried_on_the_pending_nodes_that_answer_again(home: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A `stopping` run (node b unreachable when the user stopped it): each poll that finds b answering
    sends b the stop again (spaced by STOP_RETRY_S) and the run ends `stopped` once b confirms; while b
    stays silent, nothing is sent to it."""
    rec = _record(state="stopping")
    rec.stopped_by_user, rec.stop_pending, rec.stop_tried = True, ["b"], time.time() - 60
    rec.stop_results = {"a": {"ok": True}, "b": {"ok": False, "status": "unreachable"}}
    runs.save(rec)
    sent: list[list[str]] = []

    def stop_nodes(record: runs.RunRecord, grace: float = 10.0, only: list[str] | None = None) -> dict:
        sent.append(list(only or []))
        return {n: {"ok": True} for n in only or []}

    monkeypatch.setattr(runstate, "stop_nodes", stop_nodes)
    monkeypatch.setattr(runstate, "poll", lambda record, group=None, lines=20: _statuses(a="stopped", b="stopped"))
    rec = runstate.settle(rec, _statuses(a="stopped", b="unreachable"))
    assert sent == [] and rec.state == "stopping" and runstate.stop_answered(rec)
    rec = runstate.settle(rec, _statuses(a="stopped", b="running"))
    assert sent == [["b"]] and rec.state == "stopped" and rec.stop_pending == []
    assert not runs.load("r1").move("running")


def test_follow_returns_once_the_users_stop_was_answered_and_the_watcher_retries(home: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The foreground `launch` and `logs -f` return once the stop has its answer (node b pending: exit 3);
    the watcher (retry_for) goes on until b is back and confirmed, or its bound runs out."""
    rec = _record(state="stopping")
    rec.stopped_by_user, rec.stop_pending, rec.stop_tried = True, ["b"], 0.0
    rec.stop_results = {"a": {"ok": True}, "b": {"ok": False, "status": "unreachable"}}
    runs.save(rec)
    answers = iter(["unreachable", "unreachable", "running"])
    monkeypatch.setattr(runstate, "poll", lambda record, group=None, lines=20:
                        _statuses(a="stopped", b=next(answers, "stopped")))
    monkeypatch.setattr(runstate, "stop_nodes", lambda record, grace=10.0, only=None: {n: {"ok": True} for n in only or []})
    monkeypatch.setattr(runstate.time, "sleep", lambda s: None)
    fg = runstate.follow(rec, interval=0)
    assert fg.state == "stopping" and fg.stop_pending == ["b"]
    watched = runstate.follow(rec, interval=0, retry_for=3600)
    assert watched.state == "stopped" and watched.stop_pending == []
    answers = iter(["unreachable"] * 1000)
    runs.save(rec)
    t = [0.0]
    monkeypatch.setattr(runstate.time, "monotonic", lambda: t.__setitem__(0, t[0] + 10) or t[0])
    bounded = runstate.follow(rec, interval=0, retry_for=100)
    assert bounded.state == "stopping" and bounded.stop_pending == ["b"]


def test_an_interrupted_stop_leaves_every_node_pending_not_a_silent_stopping(home: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`stop` marks the run `stopping` with every node pending before it sends anything: a stop cut short
    (Ctrl-C, a crash) leaves a record that the watcher, `status` and the busy check finish."""
    runs.save(_record())

    def interrupted(record: runs.RunRecord, grace: float = 10.0, only: list[str] | None = None) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(runstate, "stop_nodes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runstate.stop(runs.load("r1"))
    rec = runs.load("r1")
    assert rec.state == "stopping" and rec.stopped_by_user and rec.stop_pending == ["a", "b"]


def test_the_watcher_survives_a_surprise_and_a_bug_that_repeats_ends_it(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A detached run's watcher is its only judge: an unexpected error while following is logged and the
    run looked at again (not left unjudged until someone runs `status`); one that repeats ends the watcher."""
    from cluster.runs import watch
    runs.save(_record())
    calls = []

    def follow(record: runs.RunRecord, interval: float = 2.0, retry_for: float = 0.0) -> runs.RunRecord:
        calls.append(record.state)
        if len(calls) == 1:
            raise KeyError("a surprise")
        return runs.update(record.run_id, lambda r: r.move("succeeded"))

    monkeypatch.setattr(runstate, "follow", follow)
    done = watch.watch("r1", interval=0)
    assert done is not None and done.state == "succeeded" and calls == ["running", "running"]
    assert "unexpected error (1 of" in capsys.readouterr().out
    runs.save(_record())
    monkeypatch.setattr(runstate, "follow", lambda record, interval=2.0, retry_for=0.0: {}["always"])
    with pytest.raises(KeyError):
        watch.watch("r1", interval=0)
    assert capsys.readouterr().out.count("unexpected error") == watch.MAX_SURPRISES


def test_a_foreground_follow_waits_for_a_stop_another_process_is_making() -> None:
    """A failed run whose watcher is stopping node a (no stop result for it yet) while a answers: the
    launcher's follow waits (two STOP_RETRY_S at most) instead of calling a "not confirmed" (exit 3).
    Once a has a result, or a is silent, or the bound has passed, it returns as before. Found in a full
    suite: a killed training process's launch exited 3 while the watcher was still stopping the others."""
    rec = _record(state="failed")
    rec.stop_pending = ["a"]
    answering = {"a": NodeStatus("a", "running")}
    assert runstate._stop_in_flight(rec, answering, 0.0)
    assert not runstate._stop_in_flight(rec, answering, 2 * runstate.STOP_RETRY_S)
    assert not runstate._stop_in_flight(rec, {"a": NodeStatus("a", "unreachable")}, 0.0)
    rec.stop_results = {"a": {"ok": False, "error": "the agent did not confirm"}}
    assert not runstate._stop_in_flight(rec, answering, 0.0)


def test_a_host_whose_key_is_gone_is_reached_as_the_current_inventory_reaches_its_address(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lab rebuilt while a stop was pending: the record's key and known_hosts are gone with the old lab, so
    the pending stop could never be retried and the next launch on that address refused for ever. The
    current inventory's way to the same address and port is used; the record's name, workdir and python stay."""
    new = tmp_path / "new"
    new.mkdir()
    (new / "id").write_text("key\n")
    (new / "id").chmod(0o600)
    (new / "known_hosts").write_text("")
    (new / "lab.yaml").write_text(json.dumps({"name": "lab", "hosts": {
        "n2": {"address": "10.9.0.12", "identity_file": str(new / "id"), "known_hosts": str(new / "known_hosts"),
               "user": "root", "workdir": "/elsewhere"},
        "n3": {"address": "10.9.0.13", "identity_file": str(new / "id"), "known_hosts": str(new / "known_hosts")}}}))
    monkeypatch.setenv("CLUSTERCTL_INVENTORY", str(new / "lab.yaml"))
    old = tmp_path / "old"  # never created: the rebuilt lab's folder is gone
    rec = _record(nodes=("node2", "node4"))
    rec.inventory["hosts"] = [
        {"name": "node2", "address": "10.9.0.12", "port": 22, "user": "root", "identity_file": str(old / "id"),
         "known_hosts": str(old / "known_hosts"), "workdir": "/srv/cluster", "python": "/opt/py"},
        {"name": "node4", "address": "10.9.0.14", "port": 22, "identity_file": str(old / "id"),
         "known_hosts": str(old / "known_hosts"), "workdir": "/srv/cluster"}]
    node2, node4 = rec.hosts()
    assert (node2.name, node2.workdir, node2.python) == ("node2", "/srv/cluster", "/opt/py")
    assert (node2.identity_file, node2.known_hosts) == (str(new / "id"), str(new / "known_hosts"))
    assert node4.identity_file == str(old / "id")  # no host at its address now: as it was (and unreachable)
    (old).mkdir()
    for f in ("id", "known_hosts"):
        (old / f).write_text("")
    assert rec.hosts()[0].identity_file == str(old / "id")  # its files there: the run's own way, always
    gone = {"name": "gw", "address": "10.9.0.1", "port": 22, "identity_file": str(old / "id"),
            "known_hosts": str(tmp_path / "gw-gone" / "known_hosts")}
    rec.inventory["hosts"][0]["jumps"] = [gone]  # its own files there, its gateway's known_hosts gone
    node2 = rec.hosts()[0]
    assert (node2.identity_file, node2.jumps, node2.workdir) == (str(new / "id"), (), "/srv/cluster")


def test_a_pending_stop_on_a_machine_without_the_run_is_confirmed_only_where_nothing_can_start(
        tmp_path: Path) -> None:
    """A PC reinstalled (a lab rebuilt) at a pending node's address has neither the run's folder nor the agent:
    for a run that is over, or stopped by the user with no launcher or restarter at work, that answers the
    stop (before, the missing agent failed it for ever). Where the folder is there, the agent must answer; an
    active run's launch may be about to make both: no shortcut, nor while a stopped run's launcher or
    restarter is still at work."""
    import dataclasses
    import shutil
    import sys

    from cluster.inventory.model import Host

    wd = tmp_path / "wd"
    rec = _record(nodes=("a",), state="failed")
    rec.inventory["hosts"] = [Host("a", "127.0.0.1", connection="local", workdir=str(wd),
                                   python=sys.executable).to_dict()]
    rec.nodes = [dataclasses.replace(rec.nodes[0], run_dir=str(wd / "runs" / "r1"))]
    res = runstate.stop_nodes(rec, grace=0.1)["a"]
    assert res["ok"] and "absent" in res and res["left"] == []
    (wd / "runs" / "r1").mkdir(parents=True)  # its folder there, the agent not: nothing is taken for stopped
    res = runstate.stop_nodes(rec, grace=0.1)["a"]
    assert not res["ok"] and "nodeagent.py" in res["error"]
    shutil.rmtree(wd)
    rec.state = "starting"
    assert not runstate.stop_nodes(rec, grace=0.1)["a"]["ok"]
    rec.state, rec.stopped_by_user = "stopping", True  # the user's stop, pending there: nothing at work
    assert runstate.stop_nodes(rec, grace=0.1)["a"]["ok"]
    rec.extra["launcher"] = {"pid": os.getpid()}  # its launcher still at work
    assert not runstate.stop_nodes(rec, grace=0.1)["a"]["ok"]
    rec.extra["launcher"], rec.reform = {}, {"pid": os.getpid()}  # a restarter at work
    assert not runstate.stop_nodes(rec, grace=0.1)["a"]["ok"]
