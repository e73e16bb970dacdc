"""Following a program of one's own, on recorded real output (tests/fixtures/own_run): its $CLUSTER_METRICS
in `status` and the live table, its last line where it writes none, progress bars shown once, and torchrun's
harmless shutdown lines marked in `logs` of a succeeded run."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from cluster import cli
from cluster.agent.runfiles import screen, tail_lines
from cluster.cli.output import NOISE_NOTES, last_line, with_noise_notes
from cluster.cli.runs import run_table
from cluster.runs import logstream, records, state as runstate
from cluster.runs.nodestatus import NodeStatus
from tests.conftest import ROOT
from tests.unit.test_nodeagent import agent, make_run, wait_state

RUN = ROOT / "tests" / "fixtures" / "own_run"
HOST, NONHOST, PLAIN = RUN / "torchrun-tqdm-host.log", RUN / "torchrun-tqdm-nonhost.log", RUN / "tqdm-plain.log"


def lines_of(path: Path) -> list[str]:
    return path.read_bytes().decode().rstrip("\n").split("\n")


def test_a_progress_bar_shows_once_as_its_last_drawing() -> None:
    assert tail_lines(PLAIN, 50) == ["epoch 1", "train: 100%|██████████| 5/5 [00:01<00:00,  4.97it/s]", "done"]
    got = screen(lines_of(HOST))  # torchrun's --tee: every redraw a line, unended drawings with a lone prefix
    assert got[2:] == ["[rank0]:rank 0 starts", "[rank0]:train:  95%|█████████▌| 19/20 [00:01<00:00,  9.86it/s]",
                       "[rank0]:rank 0 done", "[rank0]:train: 100%|██████████| 20/20 [00:02<00:00,  9.83it/s]"]
    assert len(lines_of(HOST)) == 27 and got[:2] == lines_of(HOST)[:2]
    nonhost = screen(lines_of(NONHOST))
    assert sum("train: 100%" in x for x in nonhost) == 1 and not [x for x in nonhost if x.endswith("]:")]
    assert nonhost[-17:] == lines_of(NONHOST)[-17:] and "recvVector" in nonhost[-17]  # torchrun's shutdown trace untouched


def test_logs_marks_torchruns_known_noise_only_in_a_succeeded_run(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`clusterctl logs` on nodes it reads for real (a local connection): every line kept, a note before the
    hostname warnings and before the shutdown trace; a failed run's log gets none."""
    for rid, state in (("ok1", "succeeded"), ("bad1", "failed")):
        run_dir = tmp_path / rid
        run_dir.mkdir()
        shutil.copy(NONHOST, run_dir / "node.log")
        records.save(records.RunRecord.from_dict({
            "run_id": rid, "job": "own", "framework": "pytorch", "state": state, "created": 1.0,
            "nodes": [{"node": "node2", "node_rank": 1, "nproc": 1, "run_dir": str(run_dir)}],
            "inventory": {"hosts": [{"name": "node2", "address": "127.0.0.1", "connection": "local"}]}}))
    assert cli.main(["logs", "ok1", "-n", "200"]) == 0
    shown = capsys.readouterr().out.splitlines()[1:]
    kept = screen(lines_of(NONHOST))
    notes = [NOISE_NOTES["hostname"].format(where="below"), NOISE_NOTES["shutdown"].format(where="below")]
    assert [x for x in shown if x not in notes] == kept and [x for x in shown if x in notes] == notes
    assert shown[shown.index(notes[1]) + 1].startswith("[W1207 14:34:05.104997317 TCPStore.cpp:115] [c10d] "
                                                       "recvVector failed on SocketImpl")
    assert shown[shown.index(notes[0]) + 1].endswith("The hostname of the client socket cannot be retrieved. err=-3")
    assert cli.main(["logs", "ok1", "-f"]) == 0  # the run is over: one read, the notes after its lines
    followed = capsys.readouterr().out.splitlines()
    assert followed[-2:] == [f"node2| {NOISE_NOTES[k].format(where='above')}" for k in ("hostname", "shutdown")]
    assert cli.main(["logs", "bad1", "-n", "200"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == kept


def test_logs_follow_shows_a_bar_drawn_across_reads_without_its_redraws(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain launcher's node.log read as `logs -f` reads it, in pieces that end mid-drawing."""
    text = PLAIN.read_bytes().decode()
    cuts = [0, 20, text.index("40%"), len(text)]
    states = iter(["running", "succeeded"])

    def fake_logs(rec: records.RunRecord, node: str | None = None, offsets: dict[str, int] | None = None,
                  lines: int = 50) -> dict[str, tuple[str, int]]:
        i = len(reads)
        reads.append(i)
        return {"a": (text[cuts[i]:cuts[i + 1]], cuts[i + 1])}

    def fake_refresh(rec: records.RunRecord) -> records.RunRecord:
        rec.state = next(states, "succeeded")
        return rec

    reads: list[int] = []
    monkeypatch.setattr(runstate, "logs", fake_logs)
    monkeypatch.setattr(runstate, "refresh", fake_refresh)
    rec = records.RunRecord.from_dict({"run_id": "r1", "job": "j", "framework": "pytorch", "state": "running",
                                       "created": 1.0, "nodes": [], "inventory": {"hosts": []}})
    monkeypatch.setattr(runstate, "stop_answered", lambda r: len(reads) == 3)
    got = [line for _, line in logstream.follow(rec, sleep=lambda s: None)]
    assert got == ["epoch 1", "train:  20%|██        | 1/5 [00:00<00:00,  5.00it/s]",
                   "train: 100%|██████████| 5/5 [00:01<00:00,  4.97it/s]", "done"]


def test_status_reads_the_programs_cluster_metrics_and_else_its_last_line(tmp_path: Path) -> None:
    """The node agent, run for real on a run folder holding the recorded files: node1's newest step, loss and
    every number it wrote; node2 (no metrics) its last line in the table, torchrun's shutdown trace passed over."""
    shown = {}
    for node, log, metrics in (("node1", HOST, RUN / "user-metrics.jsonl"), ("node2", NONHOST, None)):
        d = make_run(tmp_path, f"cat {log}\n" + (f"cp {metrics} out/user-metrics.jsonl\n" if metrics else ""), node)
        agent("start", str(d))
        shown[node] = NodeStatus.from_agent(node, wait_state(d, "succeeded"))
    one, two = shown["node1"], shown["node2"]
    assert (one.step, one.loss, one.epoch, one.images_per_s) == (51, 0.0196078431372549, None, None)
    assert one.user_metrics == {"step": 51, "loss": 0.0196078431372549, "sum": 153.0}
    assert two.step is None and two.user_metrics == {} and two.log[-1].startswith("W1207 14:34:05.952000")
    assert last_line(two.log, True) == "[rank1]:train: 100%|██████████| 20/20 [00:02<00:00,  9.83it/s]"
    assert last_line(two.log, False) == two.log[-1]  # not succeeded: nothing passed over
    rec = records.RunRecord.from_dict({"run_id": "r1", "job": "own", "framework": "pytorch", "state": "succeeded",
                                       "created": 1.0, "nodes": [], "inventory": {"hosts": []}})
    from rich.console import Console

    console = Console(width=250, record=True, file=io.StringIO())
    console.print(run_table(rec, shown))
    text = console.export_text()
    rows = {n: next(x for x in text.splitlines() if n in x) for n in shown}
    assert "│ 51   │ 0.0196 │" in rows["node1"] and "│ -    │ -      │" in rows["node2"], text
    assert rows["node2"].split("│")[-2].strip() == "[rank1]:train: 100%|██████████| 20/20 [00:02<00:00,  9.83it/s]"


def test_a_user_metrics_line_of_the_wrong_types_is_passed_over() -> None:
    doc = {"state": "running", "metrics": {}, "user_metrics": {"step": 3.5, "loss": "low", "epoch": True, "lr": 0.1}}
    s = NodeStatus.from_agent("n", doc)
    assert (s.step, s.loss, s.epoch) == (None, None, None) and s.user_metrics == {"step": 3.5, "lr": 0.1}
    assert with_noise_notes(["a", "b"]) == ["a", "b"] and json.dumps(s.to_dict())
