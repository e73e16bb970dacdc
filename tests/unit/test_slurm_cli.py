"""`clusterctl launch JOB --on NAME ... --dry-run` as a user meets it: the script printed, the JSON document,
exit 2 for what cannot be (nothing is contacted), exit 3 for a login node out of reach (a closed loopback port)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, write

INV = """\
defaults: {user: student, ssh_config: none}
hosts:
  pc1: {address: 10.0.0.1}
  pc2: {address: 10.0.0.2}
slurm:
  slurm:
    login: {address: 10.77.0.200}
    partition: debug
    workdir: /srv/slurm-shared/clusterctl
  other:
    login: {address: 10.88.0.1}
    workdir: /scratch/cc
"""


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "80"}, timeout=120)


def test_dry_run_prints_the_sbatch_script(tmp_path: Path) -> None:
    inv = str(write(tmp_path, INV))
    r = run("launch", "resnet50-ddp", "-i", inv, "--on", "slurm", "--nodes", "2", "--time", "30", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1] == "#!/bin/bash" and "#SBATCH --nodes=2\n" in r.stdout
    assert "#SBATCH --time=30\n" in r.stdout and "#SBATCH --partition=debug\n" in r.stdout
    assert "exec srun --kill-on-bad-exit=1" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("dry run: 2 nodes x 1 processes (world size 2) on the Slurm "
                                                         "cluster slurm, partition debug")


def test_dry_run_json_has_the_script_and_the_resolved_settings(tmp_path: Path) -> None:
    inv = str(write(tmp_path, INV))
    r = run("launch", "resnet50-tf", "-i", inv, "--on", "other", "--partition", "cpu", "--account", "lab",
            "--qos", "short", "--mem", "8G", "--cpus-per-task", "4", "--set", "requeue=true", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["cluster"] == "other" and doc["launcher"] == "tensorflow" and doc["workdir"] == "/scratch/cc"
    assert {k: doc["resources"][k] for k in ("nodes", "partition", "account", "qos", "mem", "cpus_per_task", "requeue")} \
        == {"nodes": 2, "partition": "cpu", "account": "lab", "qos": "short", "mem": "8G", "cpus_per_task": 4,
            "requeue": True}
    script = doc["files"]["job.sbatch"]
    assert "#SBATCH --requeue\n" in script and "#SBATCH --mem=8G\n" in script
    assert json.loads(doc["files"]["job.json"])["run_id"] == doc["run_id"]
    assert doc["run_dir"] == f"/scratch/cc/runs/{doc['run_id']}"


def test_what_cannot_be_is_exit_2(tmp_path: Path) -> None:
    inv = str(write(tmp_path, INV))
    cases = [
        (["--on", "nope", "--dry-run"], "declares no Slurm cluster 'nope' (it declares: other, slurm)"),
        (["--on", "slurm", "--limit", "pc1", "--dry-run"], "--limit does not go with --on slurm"),
        (["--on", "slurm", "--plan", "--dry-run"], "--plan does not go with --on slurm"),
        (["--partition", "debug", "--dry-run"], "--partition goes with --on NAME"),
        (["--on", "slurm", "--time", "soon", "--dry-run"], "--time: expected a Slurm time limit, got 'soon'"),
        (["--on", "slurm", "--nodes", "0", "--dry-run"], "argument --nodes"),
        (["--on", "slurm", "--set", "requeue=maybe", "--dry-run"], "requeue: expected true or false"),
    ]
    for extra, words in cases:
        r = run("launch", "resnet50-ddp", "-i", inv, *extra)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr)


def test_a_login_node_out_of_reach_submits_nothing_exit_3(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inv = str(write(tmp_path, INV.replace("login: {address: 10.77.0.200}",
                                          f"login: {{address: 127.0.0.1, port: {port}, connect_timeout: 3}}")))
    r = run("launch", "resnet50-ddp", "-i", inv, "--on", "slurm")
    assert r.returncode == 3 and f"127.0.0.1:{port} refused the connection" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "submitted" not in r.stderr


def test_help_lists_the_slurm_options() -> None:
    r = run("launch", "--help")
    assert r.returncode == 0
    for option in ("--on NAME", "--partition P", "--account A", "--qos Q", "--nodes N", "--time T", "--mem M",
                   "--gpus-per-node G", "--cpus-per-task C"):
        assert option in r.stdout, option
