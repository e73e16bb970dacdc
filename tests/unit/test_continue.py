"""`launch --continue RUN`: the job taken from the run's record, its checks, the copy on a node, and the
built-in programs resuming from a copied checkpoint with the longer schedule (real processes, no lab:
tests/integration/test_launch_lab.py runs it on real nodes)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.errors import UsageError
from cluster.runs import carryover, jobs, records, render
from cluster.runs.schema import JobError

WL = Path(__file__).resolve().parents[2] / "cluster" / "programs"


def _epochs(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics-rank0.jsonl").read_text().splitlines())
            if r["type"] in ("start", "epoch", "step")]


def _program(entry: str, out: Path, epochs: int, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(WL / entry), "--dataset", "digits", "--epochs", str(epochs), "--batch", "64",
           "--max-steps", "3", "--log-every", "1", "--threads", "1", "--out", str(out), *extra]
    if entry == "train_torch.py":
        cmd += ["--model", "resnet18"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TF_CONFIG", None)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # runs both training programs: left out of the quick tier
@pytest.mark.parametrize("entry,ckpt", [("train_torch.py", "checkpoint.pt"), ("train_tf.py", "checkpoint")])
def test_a_copied_checkpoint_goes_on_with_the_longer_schedule_and_nothing_to_train_is_refused(
        tmp_path: Path, entry: str, ckpt: str) -> None:
    first, whole = _program(entry, tmp_path / "a", 1), _program(entry, tmp_path / "w", 2)
    assert first.returncode == 0 and whole.returncode == 0, (first.stderr + whole.stderr)[-2000:]
    (tmp_path / "b").mkdir()
    src = tmp_path / "a" / ckpt
    (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp_path / "b" / ckpt)
    cont = _program(entry, tmp_path / "b", 2, "--continues", "job-a")
    assert cont.returncode == 0, cont.stderr[-2000:]
    recs = _epochs(tmp_path / "b")
    start = next(r for r in recs if r["type"] == "start")
    assert (start["start_epoch"], start["start_step"]) == (1, 3)
    assert [r["epoch"] for r in recs if r["type"] == "epoch"] == [1]  # only the epoch it adds
    # the rate of a 2-epoch run's second epoch: the schedule is that of the run in all, from where it stopped
    lr = {r["step"]: r["lr"] for r in _epochs(tmp_path / "w") if r["type"] == "step"}
    steps = [r for r in recs if r["type"] == "step"]
    assert steps and all(r["lr"] == pytest.approx(lr[r["step"]]) for r in steps)

    # a checkpoint already at the target (a few steps score well above 1%): nothing to train, though epochs remain
    reached = _program(entry, tmp_path / "b", 3, "--continues", "job-a", "--target-acc", "0.01")
    assert reached.returncode == 2 and "already at --target-acc 0.01: nothing to train" in reached.stderr
    assert "--set target_acc=0" in reached.stderr and [r["epoch"] for r in _epochs(tmp_path / "b")
                                                       if r["type"] == "epoch"] == [1]  # nothing trained, none lost
    again = _program(entry, tmp_path / "b", 2, "--continues", "job-a")  # its checkpoint ends epoch 2 now
    assert again.returncode == 2 and "nothing to train" in again.stderr and "--set epochs=3" in again.stderr
    empty = _program(entry, tmp_path / "c", 2, "--continues", "job-a")
    assert empty.returncode == 2 and "no checkpoint of it" in empty.stderr
    assert not (tmp_path / "c" / "metrics-rank0.jsonl").exists() or not [
        r for r in _epochs(tmp_path / "c") if r["type"] == "epoch"]  # it trained nothing from scratch


def _record(home: Path, run_id: str, state: str = "succeeded", names: tuple[str, str] = ("node1", "node2"),
            **kw: object) -> records.RunRecord:
    a, b = names
    spec = jobs.load("resnet18-ddp", ["grad_compression=powersgd", f"shares={{{a}: 40, {b}: 24}}",
                                      f"nodes=[{a}, {b}]", "epochs=2"])
    nodes = [records.RunNode(n, i, 1, f"lab/{n}/runs/{run_id}") for i, n in enumerate(names)]
    rec = records.RunRecord(run_id, spec.name, spec.framework, state, time.time(), nodes,
                            {"path": "x", "name": "lab", "hosts": []}, settings=spec.settings,
                            spec_file=str(spec.path), **kw)  # type: ignore[arg-type]
    records.save(rec)
    return rec


def test_the_continued_job_is_the_runs_own_on_its_nodes_and_an_unfit_run_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path))
    _record(tmp_path, "resnet18-ddp-1")
    spec = carryover.spec_for("resnet18-ddp-1", ["epochs=3"])
    assert spec["continues"] == "resnet18-ddp-1" and spec["epochs"] == 3
    assert spec["grad_compression"] == "powersgd" and spec["shares"] == {"node1": 40, "node2": 24}
    assert spec["nodes"] == ["node1", "node2"]
    assert spec.program_args("d", "out")[-2:] == ["--continues", "resnet18-ddp-1"]
    assert carryover.continued(spec) is not None
    _record(tmp_path, "resnet18-ddp-2", dropped={"node2": {"reason": "silent"}})
    assert carryover.spec_for("resnet18-ddp-2")["nodes"] == ["node1"]  # the one that went on holds the newest

    _record(tmp_path, "resnet18-ddp-3", state="running")
    with pytest.raises(UsageError, match="is running: a run is continued once it has ended"):
        carryover.continued(carryover.spec_for("resnet18-ddp-3"))
    _record(tmp_path, "resnet18-ddp-4", scheduler="slurm", target={"kind": "slurm", "cluster": "hpc"})
    with pytest.raises(UsageError, match="ran on slurm"):
        carryover.continued(carryover.spec_for("resnet18-ddp-4"))
    with pytest.raises(UsageError, match="is job resnet18-ddp .* a run continues the same job"):
        carryover.continued(jobs.load("resnet50-ddp", ["continues=resnet18-ddp-1"]))
    with pytest.raises(UsageError, match="no run 'nope'"):
        carryover.spec_for("nope")


def test_continues_is_a_run_id_and_an_own_program_names_what_it_resumes_from(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="continues: expected a run id"):
        jobs.load("resnet18-ddp", ["continues=../../etc"])
    assert jobs.load("resnet18-ddp").carried_over() == ["out/checkpoint.pt"]
    assert jobs.load("resnet50-tf").carried_over() == ["out/checkpoint"]
    (tmp_path / "train.py").write_text("print(1)\n")
    with pytest.raises(JobError, match="outputs: a program of your own continues from what it wrote"):
        jobs.from_command(["python", "train.py"], tmp_path, "torchrun", None, ["continues=x-1"])
    own = jobs.from_command(["python", "train.py"], tmp_path, "torchrun", None,
                            ["continues=x-1", 'outputs=["ckpt", "results/best model.pt"]'])
    assert own.carried_over() == ["ckpt", "results/best model.pt"]
    assert "--continues" not in render.program_words(own, "d")[1]  # a user's program reads job.json, not our flags


def test_the_copy_takes_what_the_old_folder_holds_and_skips_what_it_does_not(tmp_path: Path) -> None:
    old, new = tmp_path / "runs" / "a", tmp_path / "runs" / "b b"
    (old / "ckpt").mkdir(parents=True)
    (old / "ckpt" / "w.bin").write_bytes(b"\x00" * 10)
    (old / "results").mkdir()
    (old / "results" / "best model.pt").write_text("m")
    new.mkdir()
    (new / "ckpt").mkdir()
    (new / "ckpt" / "stale").write_text("old")  # a copy replaces, never merges into, what is there
    cmd = carryover.copy_command(str(old), str(new), ["ckpt", "results/best model.pt", "missing/x"])
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["ckpt", "results/best model.pt"]
    assert (new / "ckpt" / "w.bin").read_bytes() == b"\x00" * 10 and not (new / "ckpt" / "stale").exists()
    assert (new / "results" / "best model.pt").read_text() == "m" and not (new / "missing").exists()
    assert (old / "ckpt" / "w.bin").exists()  # the old run folder is left as it was



def _cli_continue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> subprocess.CompletedProcess[str]:
    """`clusterctl launch --continue resnet18-ddp-1 ARGS` as a user types it, on the two local nodes the
    recorded run (ResNet18, succeeded) ran on: what it says, and that no run was started or recorded."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"defaults: {{connection: local}}\nhosts:\n  a: {{address: 127.0.0.1, workdir: {tmp_path / 'a'}}}\n"
                   f"  b: {{address: 127.0.0.1, workdir: {tmp_path / 'b'}}}\n")
    home = tmp_path / "home"
    monkeypatch.setenv("CLUSTERCTL_HOME", str(home))
    _record(home, "resnet18-ddp-1", names=("a", "b"))
    r = subprocess.run([sys.executable, "-m", "cluster", "launch", "--continue", "resnet18-ddp-1", "-i", str(inv),
                        *args], capture_output=True, text=True, timeout=120)
    assert [p.name for p in (home / "runs").iterdir()] == ["resnet18-ddp-1"], r.stderr  # nothing started
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists(), r.stderr  # nothing sent to a node
    return r


def test_continue_with_plan_is_a_usage_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's plan (nodes, shares, scheme) comes with it: --plan is refused as docs/jobs.md says, exit 2."""
    r = _cli_continue(tmp_path, monkeypatch, "--plan")
    assert r.returncode == 2, r.stderr
    assert "--continue takes the job, its settings and nodes from the run it continues" in r.stderr
    assert "drop --plan" in r.stderr and "no plan for" not in r.stderr, r.stderr


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "launch"])
def test_continue_with_another_model_is_refused_on_the_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            dry: bool) -> None:
    """ResNet18's checkpoint cannot load into ResNet50: refused before any node is touched, --dry-run too."""
    r = _cli_continue(tmp_path, monkeypatch, "--set", "model=resnet50", *(["--dry-run"] if dry else []))
    assert r.returncode == 2, r.stderr
    assert "run resnet18-ddp-1 trained resnet18 (pytorch), this one would train resnet50" in r.stderr, r.stderr
    assert "drop --set model=resnet50 to continue resnet18-ddp-1, or train resnet50 in a new run" in r.stderr
