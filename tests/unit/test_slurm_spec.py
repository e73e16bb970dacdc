"""A job spec on Slurm: the `requeue:` field, the node count of the built-in jobs, the resources the command
line asks for (checked before an #SBATCH line), and what an SSH launch does that a Slurm job refuses."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.errors import UsageError
from cluster.inventory import loader
from cluster.runs import jobs, schema
from cluster.runs.schema import JobError
from cluster.slurm import submit
from cluster.slurm.resources import SlurmOverrides, mem_mb, time_minutes
from tests.conftest import FIXTURES, write

INV = """\
defaults: {user: student, ssh_config: none}
hosts:
  pc1: {address: 10.0.0.1}
  pc2: {address: 10.0.0.2}
  pc3: {address: 10.0.0.3}
groups:
  pair: {hosts: [pc1, pc2]}
slurm:
  uni:
    login: {address: login.example.edu}
    partition: batch
    account: lab
    workdir: /scratch/me/cc
"""


def prepare(tmp_path: Path, job: str = "resnet50-ddp", sets: list[str] | None = None, text: str = INV,
            **options: object) -> submit.SlurmRequest:
    inv = loader.load(write(tmp_path, text), check_files=False)
    return submit.prepare(inv, jobs.load(job, sets or []), "uni", SlurmOverrides(**options),  # type: ignore[arg-type]
                          run_id="resnet50-ddp-20261129-120000-abcd", data_file="digits-0.npz")


def test_requeue_is_a_job_setting_false_by_default() -> None:
    assert jobs.load("resnet50-ddp")["requeue"] is False
    assert jobs.load("resnet50-ddp", ["requeue=true"])["requeue"] is True
    assert schema.DEFAULTS["requeue"] is False


@pytest.mark.parametrize("value", ["1", "yes-please", "[true]", "null"])
def test_requeue_must_be_true_or_false(value: str) -> None:
    with pytest.raises(JobError) as e:
        jobs.load("resnet50-ddp", [f"requeue={value}"])
    assert e.value.field == "requeue" and "expected true or false" in str(e.value) and e.value.exit_code == 2


def test_requeue_in_a_spec_file_is_checked_with_its_line(tmp_path: Path) -> None:
    spec = write(tmp_path, "name: j\nframework: pytorch\nrequeue: sometimes\n", "j.yaml")
    with pytest.raises(JobError) as e:
        jobs.load(str(spec))
    assert (e.value.field, e.value.line) == ("requeue", 3)


def test_requeue_chooses_the_sbatch_option(tmp_path: Path) -> None:
    assert "#SBATCH --no-requeue\n" in prepare(tmp_path).script
    on = prepare(tmp_path, sets=["requeue=true"]).script
    assert "#SBATCH --requeue\n" in on and "--no-requeue" not in on


def test_the_node_count_of_a_built_in_job(tmp_path: Path) -> None:
    """--nodes, else as many nodes as the job's SSH launch would use on this inventory (docs/slurm.md)."""
    assert prepare(tmp_path).resources.nodes == 3  # nodes: all, three hosts
    assert prepare(tmp_path, sets=["nodes=pair"]).resources.nodes == 2  # a group
    assert prepare(tmp_path, sets=["nodes=[pc1]"]).resources.nodes == 1  # a list
    assert prepare(tmp_path, nodes=16).resources.nodes == 16  # the command line
    assert "#SBATCH --nodes=16\n" in prepare(tmp_path, nodes=16).script
    with pytest.raises(UsageError) as e:  # no host to count: the count must be given
        prepare(tmp_path, text="slurm:\n" + INV.split("slurm:\n")[1])
    assert "--nodes 2" in str(e.value.fix)
    with pytest.raises(UsageError):
        prepare(tmp_path, sets=["nodes=nosuchgroup"])


def test_processes_per_node_follow_the_gpus_asked_for(tmp_path: Path) -> None:
    assert prepare(tmp_path).resources.nproc_per_node == 1  # auto, no GPU
    assert prepare(tmp_path, gpus_per_node=4).resources.nproc_per_node == 4
    assert prepare(tmp_path, gpus_per_node=4).resources.world_size == 12
    assert prepare(tmp_path, sets=["procs_per_node=3"]).resources.nproc_per_node == 3  # CPU processes
    with pytest.raises(JobError) as e:
        prepare(tmp_path, sets=["procs_per_node=3"], gpus_per_node=2)
    assert e.value.field == "procs_per_node"
    assert prepare(tmp_path, "resnet50-tf", gpus_per_node=4).resources.nproc_per_node == 1  # one worker per node


def test_the_command_line_wins_over_the_inventory(tmp_path: Path) -> None:
    r = prepare(tmp_path).resources
    assert (r.partition, r.account, r.qos) == ("batch", "lab", None)
    r = prepare(tmp_path, partition="gpu", account="other", qos="long").resources
    assert (r.partition, r.account, r.qos) == ("gpu", "other", "long")


@pytest.mark.parametrize("text, minutes", [("30", 30), ("30:30", 30.5), ("2:00:00", 120), ("1-12", 2160),
                                           ("1-0:30", 1470), ("2-00:00:30", 2880.5)])
def test_slurm_time_forms(text: str, minutes: float) -> None:
    assert time_minutes(text) == minutes


@pytest.mark.parametrize("text", ["", "1h", "1:2:3:4", "-5", "0", "1-", "inf", "1 h"])
def test_times_sbatch_would_misread_are_refused(text: str) -> None:
    with pytest.raises(UsageError) as e:
        time_minutes(text)
    assert e.value.exit_code == 2 and "--time" in str(e.value)


@pytest.mark.parametrize("text, mb", [("4000", 4000), ("16G", 16384), ("16g", 16384), ("1T", 1048576), ("512K", 0.5)])
def test_memory_forms(text: str, mb: float) -> None:
    assert mem_mb(text) == mb


@pytest.mark.parametrize("option, value", [("mem", "16GB"), ("mem", "0"), ("time", "forever"), ("partition", "a b"),
                                           ("account", "x;y"), ("qos", "$(id)"), ("nodes", 0), ("gpus_per_node", 65),
                                           ("cpus_per_task", 0), ("nodes", True)])
def test_bad_resources_are_exit_2_naming_the_option(tmp_path: Path, option: str, value: object) -> None:
    with pytest.raises(UsageError) as e:
        prepare(tmp_path, **{option: value})
    assert e.value.exit_code == 2 and f"--{option.replace('_', '-')}" in str(e.value)


@pytest.mark.parametrize("sets, field", [(["min_nodes=2"], "min_nodes"), (["shares={pc1: 8, pc2: 8}"], "shares"),
                                         (["silent_grace_s=60"], "silent_grace_s")])
def test_what_a_slurm_job_does_otherwise_is_refused(tmp_path: Path, sets: list[str], field: str) -> None:
    with pytest.raises(JobError) as e:
        prepare(tmp_path, sets=sets)
    assert e.value.field == field and e.value.fix


def test_a_user_program_with_requirements_is_refused(tmp_path: Path) -> None:
    with pytest.raises(JobError) as e:
        prepare(tmp_path, str(FIXTURES / "own" / "own-ddp.yaml"), ["requirements=[tabulate==0.9.0]"])
    assert e.value.field == "requirements" and "python:" in str(e.value.fix)


def test_an_unknown_cluster_names_those_the_inventory_declares(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, INV.replace("  uni:", "  uni:\n    login: {address: b}\n    workdir: /b\n  hpc2:", 1)),
                      check_files=False)
    with pytest.raises(UsageError) as e:
        submit.prepare(inv, jobs.load("resnet50-ddp"), "nope")
    assert "declares no Slurm cluster 'nope' (it declares: hpc2, uni)" in str(e.value) and e.value.exit_code == 2
    bare = loader.load(write(tmp_path, INV.split("slurm:")[0], "bare.yaml"), check_files=False)
    with pytest.raises(UsageError) as e:
        submit.prepare(bare, jobs.load("resnet50-ddp"), "uni")
    assert "no `slurm:` section" in str(e.value) and "docs/slurm.md" in str(e.value.fix)
