"""Job specs: defaults, overrides, and errors that name the file, line, field and fix."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster import jobs
from cluster.jobs import JobError


def test_shipped_jobs_load_and_differ_only_where_the_frameworks_do() -> None:
    ddp, tf = jobs.load("resnet50-ddp"), jobs.load("resnet50-tf")
    assert (ddp.framework, ddp.entry, tf.framework, tf.entry) == ("pytorch", "train_torch.py", "tensorflow", "train_tf.py")
    same = {k for k in ddp.settings if ddp[k] == tf[k]}
    assert same >= {"dataset", "epochs", "batch", "optimizer", "seed", "nodes", "threads"}  # one study
    assert set(jobs.available()) >= {"resnet50-ddp", "resnet50-tf"}


def test_overrides_reach_nested_settings_and_env() -> None:
    spec = jobs.load("resnet50-ddp", ["epochs=2", "optimizer.lr=0.05", "env.NCCL_DEBUG=INFO", "nodes=[pc1, pc2]"])
    assert spec["epochs"] == 2 and spec["optimizer"]["lr"] == 0.05 and spec["optimizer"]["momentum"] == 0.9
    assert spec["env"] == {"NCCL_DEBUG": "INFO"} and spec["nodes"] == ["pc1", "pc2"]
    args = spec.program_args("/d/x.npz", "out")
    assert args[args.index("--lr") + 1] == "0.05" and args[args.index("--epochs") + 1] == "2"


@pytest.mark.parametrize("text, where, message", [
    ("epochs: two\n", ":4: epochs", "expected a whole number >= 1, got 'two'"),
    ("optimizer: {lr: 0}\n", ":4: optimizer.lr", "expected a number > 0"),
    ("batchsize: 32\n", ":4: batchsize", "unknown setting"),
    ("dataset: {name: imagenet}\n", ":4: dataset.name", "expected one of digits, cifar10"),
    ("dataset: {name: cifar10}\n", ": dataset.path", "cifar10 needs an existing path on the head"),
    ("env: {1BAD: x}\n", ": env.1BAD", "not a valid environment variable name"),
    ("procs_per_node: 0\n", ":4: procs_per_node", "expected auto or a whole number >= 1"),
    ("nodes: []\n", ":4: nodes", "expected all, a group name or a list of host names"),
])
def test_bad_specs_name_file_line_and_field(tmp_path: Path, text: str, where: str, message: str) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("# a job\nname: j\nframework: pytorch\n" + text)
    with pytest.raises(JobError) as e:
        jobs.load(str(f))
    assert f"{f}{where}: {message}" in e.value.message and e.value.fix


def test_bad_override_says_it_came_from_the_command_line() -> None:
    with pytest.raises(JobError, match=r"^command line \(--set\): batch: expected a whole number >= 1, got -3"):
        jobs.load("resnet50-ddp", ["batch=-3"])
    with pytest.raises(JobError, match="settable keys: .*optimizer.lr"):
        jobs.load("resnet50-ddp", ["optimizer.lrate=1"])


def test_unknown_job_lists_the_known_ones() -> None:
    with pytest.raises(JobError, match="cannot read the job spec") as e:
        jobs.load("resnet51")
    assert "resnet50-ddp" in (e.value.fix or "")
