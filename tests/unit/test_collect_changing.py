"""collect of a running run: its program deletes and rewrites files while the agent lists them and the head
copies them. A file gone before it is read is not listed; one that changes under its copy is fetched again as
the node has it then, or named in the node's `changed`; the node's other files come all the same."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from cluster.cli import results
from cluster.inventory.model import Host
from cluster.runs import collect, payload, render
from cluster.transport.local import LocalTransport
from cluster.agent import runfiles


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "r1"
    (run / "out").mkdir(parents=True)
    (run / "scratch").mkdir()
    (run / "node.log").write_text("epoch 1\n")
    (run / "out" / "metrics.jsonl").write_text('{"step": 1}\n')
    for name in ("gone-before-stat.dat", "gone-before-read.dat", "shrinks.log"):
        (run / "out" / name).write_bytes(b"x" * 100)
    (run / "scratch" / "a.dat").write_bytes(b"a")
    return run


def test_a_file_deleted_between_the_walk_and_its_stat_or_read_is_not_listed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.lstat is wrapped so that each race window is hit exactly once, at the moment it opens: the real
    file is deleted (or shortened) just before or just after the agent's own lstat of it. A program doing this
    in a loop hits the windows only sometimes; here the test cannot pass by luck."""
    run = _run_folder(tmp_path)
    out = run / "out"
    real_lstat = os.lstat

    def racing_lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        p = Path(os.fsdecode(path))
        if p == run / "node.log" and (run / "scratch").exists():
            shutil.rmtree(run / "scratch")  # a folder the walk has listed, gone before it is entered
        if p == out / "gone-before-stat.dat":
            p.unlink()
        st = real_lstat(path, *args, **kwargs)
        if p == out / "gone-before-read.dat":
            p.unlink()
        elif p == out / "shrinks.log":
            p.write_bytes(b"y" * 10)  # rewritten shorter after its size was taken
        return st

    monkeypatch.setattr(os, "lstat", racing_lstat)
    got = runfiles.manifest(run)
    monkeypatch.undo()
    listed = {f["path"]: f for f in got["files"]}
    assert got["ok"] and got["skipped"] == [], got
    assert set(listed) == {"node.log", "out/metrics.jsonl", "out/shrinks.log"}, got
    # the size and the sha256 describe the same bytes: the head can verify its copy against them
    assert listed["out/shrinks.log"] == {"path": "out/shrinks.log", "size": 10,
                                         "sha256": hashlib.sha256(b"y" * 10).hexdigest()}


def test_a_listing_under_a_program_rotating_files_never_fails(tmp_path: Path) -> None:
    """The same race for real: another process rotates 32 files of 64 KiB (writes a new one, deletes the
    oldest) and short-lived folders in a tight loop while the agent lists the folder again and again (bounded:
    3 s or 300 listings). Whether a listing meets a deletion is up to the scheduler: most runs do."""
    run = tmp_path / "r1"
    (run / "rot").mkdir(parents=True)
    churn = subprocess.Popen([sys.executable, "-c", (
        "import collections, os, shutil, sys\n"
        "rot, live, i = os.path.join(sys.argv[1], 'rot'), collections.deque(), 0\n"
        "while True:\n"
        "    i += 1\n"
        "    name = os.path.join(rot, '%08x' % (i * 2654435761 % 2 ** 32))  # listed in no useful order\n"
        "    with open(name, 'wb') as f:\n"
        "        f.write(b'x' * 65536)\n"
        "    live.append(name)\n"
        "    if len(live) > 32:\n"
        "        os.unlink(live.popleft())\n"
        "    if i % 16 == 0:  # a folder with a file in it, there for a moment\n"
        "        sub = os.path.join(rot, 'sub%d' % i)\n"
        "        os.mkdir(sub)\n"
        "        open(os.path.join(sub, 'f'), 'wb').close()\n"
        "        shutil.rmtree(os.path.join(rot, 'sub%d' % (i - 16)), ignore_errors=True)\n"), str(run)])
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(run / "rot")) < 32 and time.monotonic() < deadline:  # it is at work
            time.sleep(0.01)
        deadline, listings = time.monotonic() + 3, 0
        while time.monotonic() < deadline and listings < 300:
            got = runfiles.manifest(run)
            assert got["ok"] and got["skipped"] == [], got
            listings += 1
    finally:
        churn.kill()
        churn.wait()
    assert listings > 10


# --------------------------------------------------------------------------- the head's copy


class RacingNode(LocalTransport):
    """This machine as a node whose program acts on one file just before each of the head's copies of it:
    the real file is changed at the one moment that matters, by the real agent's listing and a real copy."""

    def __init__(self, host: Host, path: str, act: Callable[[Path, int], None]) -> None:
        super().__init__(host)
        self.path, self.act, self.copies = path, act, 0

    def get_range(self, remote_path: str, offset: int, length: int, sink: Callable[[bytes], None]) -> None:
        if remote_path == self.path:
            self.copies += 1
            self.act(Path(remote_path), self.copies)
        super().get_range(remote_path, offset, length, sink)


def _node(tmp_path: Path) -> tuple[Host, Path]:
    """A node workdir holding the real agent and a run folder of three files."""
    workdir = tmp_path / "node"
    (workdir / render.AGENT).parent.mkdir(parents=True)
    for name, content in payload.agent_files().items():
        (workdir / render.AGENT).with_name(name).write_bytes(content)
    run = workdir / "runs" / "r1"
    (run / "out").mkdir(parents=True)
    (run / "node.log").write_text("epoch 1 loss 0.5\n")
    (run / "out" / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "out" / "state.json").write_text('{"step": 1}\n')
    host = Host(name="node1", address="127.0.0.1", connection="local", workdir=str(workdir), python=sys.executable)
    return host, run


def _collect(t: LocalTransport, run: Path, head: Path) -> collect.NodeCollect:
    return collect.collect_node(t, str(run), head / "node1", checkpoints=False)


def test_a_file_rewritten_during_its_copy_is_fetched_again_as_it_is_now(tmp_path: Path) -> None:
    host, run = _node(tmp_path)

    def rewrite_once(p: Path, copy: int) -> None:
        if copy == 1:
            p.write_text('{"step": 2}\n')  # same length, other bytes: only the sha256 can tell

    t = RacingNode(host, str(run / "out" / "state.json"), rewrite_once)
    res = _collect(t, run, tmp_path / "head")
    assert res.status == "ok" and res.changed == [] and res.files == 3 and t.copies == 2, res
    assert (tmp_path / "head" / "node1" / "out" / "state.json").read_text() == '{"step": 2}\n'
    assert not list((tmp_path / "head").rglob("*.part"))


def test_a_file_that_keeps_changing_or_vanishes_is_named_and_the_rest_collected(tmp_path: Path) -> None:
    host, run = _node(tmp_path)

    def rewrite_always(p: Path, copy: int) -> None:
        p.write_text('{"step": %d}\n' % (copy + 1))

    t = RacingNode(host, str(run / "out" / "state.json"), rewrite_always)
    res = _collect(t, run, tmp_path / "head")
    assert res.status == "ok" and res.files == 2 and t.copies == 2, res
    assert [c["path"] for c in res.changed] == ["out/state.json"]
    assert "rewritten on the node during its copy" in res.changed[0]["reason"]
    assert "again after a fresh listing" in res.changed[0]["reason"]
    got = tmp_path / "head" / "node1"
    assert (got / "node.log").read_text() == "epoch 1 loss 0.5\n" and (got / "out" / "metrics.jsonl").exists()
    assert not (got / "out" / "state.json").exists() and not list(got.rglob("*.part"))

    gone = RacingNode(host, str(run / "node.log"), lambda p, copy: p.unlink())
    (run / "out" / "state.json").write_text("final\n")
    res = _collect(gone, run, tmp_path / "head2")
    assert res.status == "ok" and res.files == 2 and gone.copies == 1, res
    assert res.changed == [{"path": "node.log", "reason": "gone from the node during the collect (deleted)"}]
    summary = collect.CollectSummary([collect.RunCollect("r1", tmp_path / "head2", {"node1": res})])
    assert summary.verdict == "ok"  # a note: the run's program at work, not a failed node


def test_collect_prints_the_changed_files_with_their_reason(capsys: pytest.CaptureFixture[str]) -> None:
    node = collect.NodeCollect("node1", files=2, changed=[{"path": "out/state.json", "reason": "rewritten"}])
    results._print_collect(collect.RunCollect("r1", Path("/head/runs/r1"), {"node1": node}))
    printed = capsys.readouterr().out
    assert "changed node1: out/state.json (rewritten)" in printed
    assert collect.CHANGED_FIX in " ".join(printed.split())
