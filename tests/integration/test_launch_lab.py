"""`clusterctl launch` and the run lifecycle on a real 2-node lab, as a user runs them.

The nodes are provisioned with `python_env: existing` (the head's .venv, reached through the
shared filesystem): launch reads the same verified state a venv provision writes, in seconds
(test_provision.py covers the venv path).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import clusterctl, clusterctl_json, provisioned_lab, pytestmark  # noqa: F401

# batch 8: what is tested is the same at any batch, and ResNet50 steps at 32 on one thread cost minutes in CI
TINY = ["--set", "epochs=2", "--set", "threads=1", "--set", "max_steps=4", "--set", "log_every=1", "--set", "batch=8"]


@pytest.fixture(scope="module")
def plab(tmp_path_factory: pytest.TempPathFactory):
    yield from provisioned_lab(tmp_path_factory, "l", 2, 5)


def node_run_dir(state, node: int, run_id: str) -> Path:
    return Path(state.nodes[node].dir) / "srv" / "runs" / run_id


def records(state, run_id: str) -> dict[int, list[dict]]:
    """rank -> its metrics records, read from every node's run folder."""
    out = {}
    for i in range(len(state.nodes)):
        for f in (node_run_dir(state, i, run_id) / "out").glob("metrics-rank*.jsonl"):
            out[int(f.stem.removeprefix("metrics-rank"))] = [json.loads(x) for x in f.read_text().splitlines()]
    return out


def run_processes(state, run_id: str) -> dict[str, list[str]]:
    """Processes carrying the run's id, asked on every node with `clusterctl exec`."""
    cmd = (f"for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -qx "
           f"CLUSTER_RUN_ID={run_id} && echo ${{p#/proc/}}; done; true")
    rc, res = clusterctl_json("exec", state.inventory, "--", cmd)
    assert rc == 0, res
    return {n["host"]: n["stdout"].split() for n in res["nodes"]}


@pytest.mark.parametrize("job", ["resnet50-ddp", "resnet50-tf"])
def test_job_runs_to_completion_with_one_command(plab, job: str) -> None:
    state, env = plab
    start = time.monotonic()
    rc, rec = clusterctl_json("launch", job, *TINY, env=env, timeout=900)  # the lab is the current context
    took = time.monotonic() - start
    assert rc == 0 and rec["state"] == "succeeded", json.dumps(rec)[-3000:]
    assert rec["world_size"] == 2 and [n["node"] for n in rec["nodes"]] == ["node1", "node2"]
    by_rank = records(state, rec["run_id"])
    assert sorted(by_rank) == [0, 1]
    starts = {r: next(x for x in recs if x["type"] == "start") for r, recs in by_rank.items()}
    ends = {r: next(x for x in recs if x["type"] == "end") for r, recs in by_rank.items()}
    assert {s["world"] for s in starts.values()} == {2}  # every rank / worker sees the same world
    assert {e["step"] for e in ends.values()} == {8}  # and the same global step count: 2 epochs x 4
    assert {s["node"] for s in starts.values()} == {"node1", "node2"}
    assert {s["run_id"] for s in starts.values()} == {rec["run_id"]}
    head_run = Path(env["CLUSTERCTL_HOME"]) / "runs" / rec["run_id"]
    saved = json.loads((head_run / "run.json").read_text())
    assert saved["state"] == "succeeded" and saved["settings"]["epochs"] == 2
    assert saved["inventory"]["hosts"][0]["address"] == state.nodes[0].address
    assert all(n["pids"]["pgid"] > 0 for n in saved["nodes"])
    launch_file = (head_run / "rendered" / "node2" / "launch.sh").read_text()
    assert launch_file == (node_run_dir(state, 1, rec["run_id"]) / "launch.sh").read_text()
    rc, listed = clusterctl_json("runs", env=env)
    assert rec["run_id"] in [r["run_id"] for r in listed]
    rc, logs = clusterctl_json("logs", rec["run_id"], env=env)
    assert rc == 0 and set(logs) == {"node1", "node2"}
    print(f"{job}: launch to end {took:.1f} s")


def wait_for_step(state, run_id: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = records(state, run_id)
        if len(recs) == 2 and all(any(x["type"] == "step" for x in r) for r in recs.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"no training step on every node within {timeout} s")


def test_stop_leaves_no_process_on_any_node(plab) -> None:
    state, env = plab
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "--detach", "--set", "threads=1", env=env, timeout=300)
    assert rc == 0 and rec["state"] == "running", rec
    run_id = rec["run_id"]
    wait_for_step(state, run_id)
    assert all(run_processes(state, run_id).values())  # it really runs on both nodes
    rc, stopped = clusterctl_json("stop", env=env, timeout=120)  # the latest run is the default
    assert rc == 0 and stopped["state"] == "stopped", stopped
    assert run_processes(state, run_id) == {"node1": [], "node2": []}
    rc, st = clusterctl_json("status", run_id, env=env)
    assert st["state"] == "stopped" and {s["state"] for s in st["last_status"].values()} == {"stopped"}
    assert records(state, run_id)  # what the run wrote stays on the nodes


def test_a_killed_training_process_fails_the_run_and_stops_the_others(plab) -> None:
    state, env = plab
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "launch", "resnet50-ddp", "--json", "--set", "threads=1"],
                            cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        run_dir = None
        deadline = time.monotonic() + 120
        while run_dir is None and time.monotonic() < deadline:
            found = sorted((Path(state.nodes[1].dir) / "srv" / "runs").glob("resnet50-ddp-*/pid.json"))
            fresh = [p.parent for p in found if p.stat().st_mtime > time.time() - 120 and
                     not (p.parent / "exit.json").exists()]
            run_dir = fresh[-1] if fresh else None
            time.sleep(0.3)
        assert run_dir is not None, "the run did not start on node2"
        run_id = run_dir.name
        wait_for_step(state, run_id)
        victims = [int(p) for p in run_processes(state, run_id)["node2"]
                   if "train_torch.py" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                   and b"CLUSTER_NODE_NAME=node2" in Path(f"/proc/{p}/environ").read_bytes()
                   and b"torch.distributed.run" not in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        killed_at = time.monotonic()
        out, errs = proc.communicate(timeout=120)
        ended_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    rec = json.loads(out)
    assert proc.returncode == 1 and rec["state"] == "failed", (errs[-2000:], rec.get("stop_results"), rec.get("failure"), rec.get("state"))
    assert rec["failure"]["node"] == "node2" and rec["failure"]["log"], rec["failure"]
    assert ended_after < 60, f"the run took {ended_after:.0f} s to fail and stop"
    assert run_processes(state, run_id) == {"node1": [], "node2": []}
    assert "run failed on node2" in errs or rec["failure"]["node"] == "node2"
    print(f"killed on node2: run failed and node1 stopped {ended_after:.1f} s later")


def test_launch_refuses_unprovisioned_or_differing_nodes(plab) -> None:
    state, env = plab
    st = Path(state.nodes[1].dir) / "srv" / "clusterctl" / "state.json"
    original = st.read_text()
    try:
        st.unlink()
        r = clusterctl("launch", "resnet50-ddp", env=env)
        assert r.returncode == 1 and "not provisioned" in r.stderr and "node2" in r.stderr, r.stderr
        assert "clusterctl provision" in r.stderr
        doc = json.loads(original)
        doc["fingerprint"]["torch"] = "2.13.0"
        st.write_text(json.dumps(doc))
        r = clusterctl("launch", "resnet50-ddp", env=env)
        assert r.returncode == 1 and "torch: node1 = " in r.stderr and "node2 = 2.13.0" in r.stderr, r.stderr
    finally:
        st.write_text(original)


def test_bad_job_settings_name_the_field(plab) -> None:
    _, env = plab
    r = clusterctl("launch", "resnet50-tf", "--set", "optimizer.lr=-1", env=env)
    assert r.returncode == 2 and "command line (--set): optimizer.lr: expected a number > 0, got -1" in r.stderr, r.stderr


def test_a_run_with_a_target_trains_on_past_its_epochs_on_every_node_and_ends_at_max_epochs(plab) -> None:
    """target_acc and max_epochs reach both nodes' programs through launch: short of an accuracy it cannot
    reach, every rank trains on past the job's 1 epoch, together, and ends at max_epochs; every end record
    says the target was not reached. Detached, nobody watching: a `stop` sent after both programs ended by
    themselves finds nothing to stop, and the run is recorded succeeded (exit 0)."""
    state, env = plab
    tiny = [a if a != "epochs=2" else "epochs=1" for a in TINY]
    rc, rec = clusterctl_json("launch", "resnet18-ddp", *tiny, "--set", "target_acc=1.0", "--set", "max_epochs=2",
                              "--detach", env=env, timeout=900)
    assert rc == 0 and rec["state"] == "running", json.dumps(rec)[-3000:]
    exits = [node_run_dir(state, i, rec["run_id"]) / "exit.json" for i in (0, 1)]
    deadline = time.monotonic() + 600
    while not all(f.exists() for f in exits) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(json.loads(f.read_text())["code"] == 0 for f in exits)
    r = clusterctl("stop", rec["run_id"], env=env, timeout=300)
    said = " ".join(r.stdout.split())  # as the terminal wrapped it
    assert r.returncode == 0 and "succeeded: every node's program had ended by itself" in said, r.stdout + r.stderr
    rc, st = clusterctl_json("status", rec["run_id"], env=env)
    assert st["state"] == "succeeded", json.dumps(st)[-3000:]
    by_rank = records(state, rec["run_id"])
    assert sorted(by_rank) == [0, 1]
    for recs in by_rank.values():
        start, end = recs[0], recs[-1]
        assert (start["epochs"], start["target_acc"], start["max_epochs"]) == (1, 1.0, 2)
        assert [x["epoch"] for x in recs if x["type"] == "epoch"] == [0, 1]
        assert (end["type"], end["step"], end["epochs_done"], end["target_reached"]) == ("end", 8, 2, False)


def test_continue_takes_an_ended_run_further_from_its_checkpoint_and_leaves_it_as_it_was(plab) -> None:
    """`launch --continue RUN --set epochs=N`: RUN's job, settings and nodes; each node's checkpoint copied
    into the new run folder; the program resumes after it. RUN's folders and record are not touched."""
    state, env = plab
    tiny = [a if a != "epochs=2" else "epochs=1" for a in TINY]
    rc, first = clusterctl_json("launch", "resnet18-ddp", *tiny, "--set", "shares={node1: 5, node2: 3}", env=env,
                                timeout=900)
    assert rc == 0 and first["state"] == "succeeded", json.dumps(first)[-3000:]
    rid = first["run_id"]
    kept = {i: (node_run_dir(state, i, rid) / "out" / "checkpoint.pt").read_bytes() for i in (0, 1)}
    before = records(state, rid)

    r = clusterctl("launch", "--continue", rid, "--set", "epochs=2", "--dry-run", env=env)
    assert r.returncode == 0 and f"continues run {rid}: out/checkpoint.pt copied" in r.stdout, r.stderr
    rc, cont = clusterctl_json("launch", "--continue", rid, "--set", "epochs=2", env=env, timeout=900)
    assert rc == 0 and cont["state"] == "succeeded", json.dumps(cont)[-3000:]
    assert cont["continues"] == {"run": rid, "copied": {"node1": ["out/checkpoint.pt"],
                                                                 "node2": ["out/checkpoint.pt"]}}
    assert cont["settings"]["shares"] == {"node1": 5, "node2": 3} and cont["settings"]["epochs"] == 2
    by_rank = records(state, cont["run_id"])
    assert sorted(by_rank) == [0, 1]
    for recs in by_rank.values():
        start = next(x for x in recs if x["type"] == "start")
        assert (start["start_epoch"], start["start_step"]) == (1, 4)
        assert [x["epoch"] for x in recs if x["type"] == "epoch"] == [1]
        assert next(x for x in recs if x["type"] == "end")["step"] == 8
    assert records(state, rid) == before  # the continued run is left as it was
    assert all((node_run_dir(state, i, rid) / "out" / "checkpoint.pt").read_bytes() == kept[i] for i in (0, 1))
    # report joins them: one run, timed from the first one's training start, the restart between included
    for x in (rid, cont["run_id"]):
        assert clusterctl_json("collect", x, env=env, timeout=600)[0] == 0
    rc, rep = clusterctl_json("report", rid, cont["run_id"], "--target-acc", "0.01", env=env, timeout=300)
    assert rc == 0, rep
    one, two = rep["runs"]
    j = two["joined"]
    assert one["joined"] is None and j["runs"] == [rid, cont["run_id"]] and j["epochs"] == 2, j
    assert j["wall_s"] == pytest.approx(two["training_start"] + two["wall_s"] - one["training_start"])
    assert j["wall_s"] > one["wall_s"] + two["wall_s"]  # the end, collect, launch and start between them
    assert j["trained_samples"] == one["trained_samples"] + two["trained_samples"]
    assert j["time_to_target_s"] == pytest.approx(one["time_to_target_s"])  # reached in the first run's epoch

    # nothing to train: the programs refuse, and the run says why
    rc, again = clusterctl_json("launch", "--continue", rid, env=env, timeout=900)
    assert rc != 0 and again["state"] == "failed", json.dumps(again)[-3000:]
    rc, logs = clusterctl_json("logs", again["run_id"], env=env)
    assert "nothing to train" in json.dumps(logs), json.dumps(logs)[-3000:]
    # what cannot be continued is refused before any node is touched
    r = clusterctl("launch", "resnet18-ddp", "--continue", rid, env=env)
    assert r.returncode == 2 and "takes the job, its settings and nodes from the run" in r.stderr, r.stderr
    r = clusterctl("launch", "--continue", "resnet18-ddp-nope", env=env)
    assert r.returncode == 2 and "no run 'resnet18-ddp-nope'" in r.stderr, r.stderr
    # no node holds a checkpoint of it any more: the start fails, nothing trains from scratch
    for i in (0, 1):
        (node_run_dir(state, i, rid) / "out" / "checkpoint.pt").unlink()
    r = clusterctl("launch", "--continue", rid, "--set", "epochs=3", env=env, timeout=300)
    said = f"no node of this run holds what run {rid} left (out/checkpoint.pt): nothing to continue from"
    assert r.returncode == 1 and said in r.stderr and r.stderr.count(said) == 1, r.stderr
    assert "nothing of it runs on node1, node2" in r.stderr, r.stderr
    rc, none = clusterctl_json("status", env=env)  # the latest run
    assert none["state"] == "failed" and said in none["failure"]["reason"], json.dumps(none)[-3000:]
    assert not records(state, none["run_id"])
