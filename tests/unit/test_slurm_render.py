"""The sbatch script of a job (`launch JOB --on NAME --dry-run`): golden files for the three launchers
(UPDATE_GOLDEN=1 rewrites them; review the diff), the #SBATCH lines, quoting, and the script's syntax."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cluster.inventory import loader
from cluster.runs import jobs, render as run_render
from cluster.slurm import layout, render, submit
from cluster.slurm.resources import SlurmOverrides
from tests import goldens
from tests.conftest import FIXTURES, ROOT, write

GOLDEN = ROOT / "tests" / "golden" / "slurm"
RUN_ID, DATA_FILE = "resnet50-20261129-120000-abcd", "digits-0123456789abcdef.npz"
INVENTORY = """\
name: campus
defaults: {user: student, ssh_config: none, workdir: /srv/cluster}
hosts:
  pc1: {address: 192.168.1.11}
  pc2: {address: 192.168.1.12}
slurm:
  uni:
    login: {address: login.hpc.example.edu, proxy_jump: student@gate.example.edu}
    partition: gpu
    account: ml-lab
    qos: null
    workdir: /scratch/student/clusterctl
    python: /opt/venvs/torch/bin/python
    env_setup: |
      module purge
      module load pytorch/2.3
"""
# job -> (spec, its --set overrides, the command line's Slurm options)
CASES = {
    "resnet50-ddp": ("resnet50-ddp", ["epochs=2", "env.OMP_PROC_BIND=close", "requeue=true"],
                     SlurmOverrides(nodes=2, gpus_per_node=2, cpus_per_task=8, mem="32G", time="2:00:00")),
    "resnet50-tf": ("resnet50-tf", ["epochs=2", "port=23456"], SlurmOverrides(partition="cpu", qos="short")),
    "own-plain": (str(FIXTURES / "own" / "own-plain.yaml"), [], SlurmOverrides(nodes=3, account="other")),
}


def inventory(tmp_path: Path) -> loader.Inventory:
    return loader.load(write(tmp_path, INVENTORY), check_files=False)


def request(tmp_path: Path, case: str) -> submit.SlurmRequest:
    job, sets, options = CASES[case]
    return submit.prepare(inventory(tmp_path), jobs.load(job, sets), "uni", options, run_id=RUN_ID,
                          data_file=DATA_FILE)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sbatch_scripts_match_golden(tmp_path: Path, case: str) -> None:
    req = request(tmp_path, case)
    goldens.check(GOLDEN / case / layout.BATCH_SCRIPT, req.script, f"{case} sbatch script")
    if case != "own-plain":  # a user program's request names its folder on this PC: only its script is golden
        goldens.check(GOLDEN / case / "request.txt", req.to_text(80), f"{case} --on --dry-run text")
        goldens.check(GOLDEN / case / "request.json", json.dumps(req.to_dict(), indent=2, default=str) + "\n",
                      f"{case} --on --dry-run --json")
    names = {p.name for p in (GOLDEN / case).iterdir()}
    assert names == ({layout.BATCH_SCRIPT} if case == "own-plain" else
                     {layout.BATCH_SCRIPT, "request.txt", "request.json"})  # none stale


def sbatch_lines(script: str) -> list[str]:
    """The options sbatch reads: #SBATCH lines before the first command (sbatch stops reading there)."""
    out = []
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH "):
            out.append(line.removeprefix("#SBATCH "))
        elif line.strip() and not line.startswith("#"):
            break
    return out


def test_sbatch_lines_say_the_resources_the_job_and_command_line_ask_for(tmp_path: Path) -> None:
    ddp = sbatch_lines(request(tmp_path, "resnet50-ddp").script)
    rdir = f"/scratch/student/clusterctl/runs/{RUN_ID}"
    assert ddp == [f"--job-name={RUN_ID}", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=2",
                   "--cpus-per-task=8", "--mem=32G", "--time=2:00:00", "--partition=gpu", "--account=ml-lab",
                   f"--chdir={rdir}", f"--output={rdir}/batch.log", f"--error={rdir}/batch.log",
                   "--open-mode=append", "--requeue"]
    tf = sbatch_lines(request(tmp_path, "resnet50-tf").script)
    assert "--nodes=2" in tf  # the inventory's two hosts: as many nodes as the SSH launch would use
    assert "--partition=cpu" in tf and "--qos=short" in tf and "--account=ml-lab" in tf  # CLI over inventory
    assert "--no-requeue" in tf and not any(o.startswith(("--gpus", "--mem", "--time")) for o in tf)
    plain = sbatch_lines(request(tmp_path, "own-plain").script)
    assert "--nodes=3" in plain and "--account=other" in plain and "--partition=gpu" in plain


def test_the_program_runs_with_the_arguments_of_an_ssh_launch(tmp_path: Path) -> None:
    """Same spec, same command line: the Slurm task's program words are render.program_words' (SSH's)."""
    req = request(tmp_path, "resnet50-ddp")
    python, words = run_render.program_words(req.job, layout.dataset(req.cluster.workdir, DATA_FILE))
    assert python and words[0] == "program/train_torch.py"
    assert " ".join(words) in req.script
    assert "--nproc-per-node 2" in req.script  # procs_per_node auto: one per GPU asked
    assert '--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' in req.script


def test_batch_and_task_scripts_are_valid_shell(tmp_path: Path) -> None:
    for case in CASES:
        req = request(tmp_path, case)
        assert subprocess.run(["bash", "-n"], input=req.script, text=True).returncode == 0, case
        task = render.task_script(req.job, req.cluster, req.resources, RUN_ID, DATA_FILE)
        assert subprocess.run(["sh", "-n"], input=task, text=True).returncode == 0, case
        if shutil.which("dash"):
            assert subprocess.run(["dash", "-n"], input=task, text=True).returncode == 0, case


def test_the_task_script_is_carried_whole_in_a_quoted_here_document(tmp_path: Path) -> None:
    req = request(tmp_path, "resnet50-ddp")
    task = render.task_script(req.job, req.cluster, req.resources, RUN_ID, DATA_FILE)
    m = re.search(r"<<'(CLUSTERCTL_TASK_[0-9a-f]{16})'\n(.*?)^\1$", req.script, re.S | re.M)
    assert m is not None and m.group(2) == task
    assert req.script.count(m.group(1)) == 2  # opened and closed, nowhere else


def test_a_hostile_env_value_stays_one_word(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = f"x'; touch {marker}; echo '\nCLUSTERCTL_TASK_0\n$(touch {marker})`touch {marker}`"
    spec = jobs.load("resnet50-ddp", [f"env.EVIL={json.dumps(evil)}"])
    assert spec["env"]["EVIL"] == evil
    req = submit.prepare(inventory(tmp_path), spec, "uni", SlurmOverrides(), run_id=RUN_ID, data_file=DATA_FILE)
    task = render.task_script(req.job, req.cluster, req.resources, RUN_ID, DATA_FILE)
    start = task.index("\nEVIL=") + 1
    snippet = task[start:task.index("\nexport EVIL\n", start)] + '\nprintf %s "$EVIL"\n'
    out = subprocess.run(["sh", "-c", snippet], capture_output=True, text=True)
    assert out.stdout == evil and not marker.exists()
    assert task in req.script  # still carried whole (the here-document's end word is not in it)


def test_no_job_port_uses_one_derived_from_the_job_id_a_job_port_is_used_as_is(tmp_path: Path) -> None:
    assert "CLUSTER_PORT=$((15000 + SLURM_JOB_ID % 10000))" in request(tmp_path, "resnet50-ddp").script
    tf = request(tmp_path, "resnet50-tf").script
    assert "CLUSTER_PORT=23456" in tf and "SLURM_JOB_ID % 10000" not in tf


def test_env_setup_runs_in_the_batch_step_before_srun(tmp_path: Path) -> None:
    script = request(tmp_path, "resnet50-ddp").script
    setup = script.index("module load pytorch/2.3")
    assert script.index("set +u") < script.index("module purge") < setup < script.index("exec srun")
    assert "CLUSTER_PYTHON=/opt/venvs/torch/bin/python" in script
