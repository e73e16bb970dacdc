"""Rendered launch files: golden files for a mixed 4-node lab, and values that try to break out."""
from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from cluster import inventory, jobs, render
from cluster.jobs import JobError
from tests.conftest import ROOT

GOLDEN = ROOT / "tests" / "golden" / "launch"
MIXED = ROOT / "tests" / "fixtures" / "launch" / "mixed.yaml"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def mixed_targets() -> list[render.Target]:
    inv = inventory.load(MIXED, check_files=False)
    return [render.Target(h, h.gpu.count if h.gpu else 0, "gloo") for h in inv.ordered(inv.hosts.values())]


def plan_for(job: str) -> render.LaunchPlan:
    spec = jobs.load(job, ["epochs=2", "env.OMP_PROC_BIND=close"])
    ports = {"pc1": 29400} if spec.framework == "pytorch" else {f"pc{i}": 23450 + i for i in range(1, 5)}
    return render.render(spec, mixed_targets(), "resnet50-20261129-120000-abcd", "digits-0123456789abcdef.npz",
                         ports)


@pytest.mark.parametrize("job", ["resnet50-ddp", "resnet50-tf"])
def test_rendered_files_match_golden(job: str) -> None:
    plan = plan_for(job)
    for n in plan.nodes:
        for name, content in n.files.items():
            golden = GOLDEN / job / n.node / name
            if UPDATE:
                golden.parent.mkdir(parents=True, exist_ok=True)
                golden.write_text(content)
            assert golden.exists(), f"missing golden file {golden} (UPDATE_GOLDEN=1 writes it)"
            assert content == golden.read_text(), f"{job}/{n.node}/{name} differs from its golden file"
    names = {p.relative_to(GOLDEN / job).as_posix() for p in (GOLDEN / job).rglob("*") if p.is_file()}
    assert names == {f"{n.node}/{f}" for n in plan.nodes for f in n.files}  # no stale golden files


def test_ddp_plan_uses_one_process_per_gpu_and_one_on_cpu_nodes() -> None:
    plan = plan_for("resnet50-ddp")
    assert [(n.node, n.nproc) for n in plan.nodes] == [("pc1", 2), ("pc2", 1), ("pc3", 1), ("pc4", 1)]
    assert plan.world_size == 5 and plan.endpoint == "192.168.1.11:29400"
    assert plan.nodes[2].run_dir == "/home/student/cluster work/runs/resnet50-20261129-120000-abcd"
    assert "'/home/student/cluster work/clusterctl/nodeagent.py'" in plan.nodes[2].start_command


def test_tf_config_is_json_with_worker_zero_as_chief() -> None:
    plan = plan_for("resnet50-tf")
    configs = [json.loads(n.files["tf_config.json"]) for n in plan.nodes]
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in range(4)]
    assert all(c["cluster"] == {"worker": [f"192.168.1.1{i}:2345{i}" for i in range(1, 5)]} for c in configs)
    assert plan.world_size == 4


def test_tf_refuses_several_workers_per_node() -> None:
    spec = jobs.load("resnet50-tf", ["procs_per_node=2"])
    with pytest.raises(JobError, match="procs_per_node: TensorFlow runs one worker per node"):
        render.render(spec, mixed_targets(), "r", "d.npz", {f"pc{i}": 1 for i in range(1, 5)})


EVIL = "x'; touch {canary}; echo '$(touch {canary})`touch {canary}`\"\\\n$HOME"


@pytest.mark.parametrize("job", ["resnet50-ddp", "resnet50-tf"])
def test_hostile_values_arrive_literally_and_run_nothing(job: str, tmp_path: Path) -> None:
    """Workdir, host name, env values and dataset file full of shell syntax: the rendered launch.sh,
    really run by sh, passes them through as data and executes none of them."""
    canary = tmp_path / "pwned"
    evil = EVIL.format(canary=canary)
    workdir = tmp_path / f"work {evil[:20]}".replace("\n", " ").replace("/", "_")
    workdir = tmp_path / workdir.name
    host = inventory.Host(name=f"pc1{evil}", address="127.0.0.1", workdir=str(workdir))
    spec = jobs.load(job, [f"env.NOTE={json.dumps(evil)}"])
    plan = render.render(spec, [render.Target(host)], "run1", f"data {evil}.npz", {host.name: 29400})
    node = plan.nodes[0]
    rdir = Path(node.run_dir)
    (rdir / "program").mkdir(parents=True)
    for name, content in node.files.items():
        (rdir / name).write_text(content)
    recorder = tmp_path / "recorder.py"
    recorder.write_text("import json, os, sys\n"
                        "json.dump({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) for k in "
                        "('NOTE', 'CLUSTER_NODE_NAME', 'CLUSTER_RUN_ID', 'TF_CONFIG')}, 'cwd': os.getcwd()}, "
                        f"open({str(tmp_path / 'got.json')!r}, 'w'))\n")
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\nexec python3 {recorder} \"$@\"\n")
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
    (workdir / "cluster.env").write_text(f"CLUSTER_PYTHON={fake_python}\nCLUSTER_NODE_ADDRESS=127.0.0.1\n"
                                         "export CLUSTER_PYTHON CLUSTER_NODE_ADDRESS\n")
    assert subprocess.run(["sh", "-n", "launch.sh"], cwd=rdir).returncode == 0
    r = subprocess.run(["sh", "launch.sh"], cwd=rdir, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not canary.exists(), "a value from the inventory or spec was executed by the shell"
    got = json.loads((tmp_path / "got.json").read_text())
    assert got["env"]["NOTE"] == evil and got["env"]["CLUSTER_NODE_NAME"] == host.name
    assert got["cwd"] == str(rdir)
    assert f"{workdir}/datasets/data {evil}.npz" in got["argv"]
    if job == "resnet50-tf":
        assert json.loads(got["env"]["TF_CONFIG"])["task"] == {"type": "worker", "index": 0}
    else:
        assert got["argv"][:2] == ["-m", "torch.distributed.run"]


def test_env_from_secrets_reach_the_program_and_no_rendered_file(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A token from the head's environment and one from a file: on the node only in secrets.env (sourced by
    launch.sh), never in launch.sh, job.json or anything kept on the head."""
    from cluster import launch

    evil = EVIL.format(canary=tmp_path / "pwned")
    monkeypatch.setenv("LAB_TOKEN", f"tok-{evil}")
    (tmp_path / "hf").write_text("hf-secret-123\n")
    spec = jobs.load("resnet50-ddp", ["env_from.API_TOKEN={env: LAB_TOKEN}", f"env_from.HF_TOKEN={{file: {tmp_path / 'hf'}}}"])
    values = launch.secret_values(spec)
    assert values == {"API_TOKEN": f"tok-{evil}", "HF_TOKEN": "hf-secret-123"}
    host = inventory.Host(name="pc1", address="127.0.0.1", workdir=str(tmp_path / "w"))
    node = render.render(spec, [render.Target(host)], "run1", "d.npz", {"pc1": 29400}).nodes[0]
    for name, content in node.files.items():
        assert "hf-secret-123" not in content and "tok-" not in content, name
    rdir = Path(node.run_dir)
    rdir.mkdir(parents=True)
    (rdir / "launch.sh").write_text(node.files["launch.sh"].replace('exec "$CLUSTER_PYTHON"', "exec env #"))
    (rdir / "secrets.env").write_text(launch.secrets_file(values))
    (tmp_path / "w" / "cluster.env").write_text("")
    r = subprocess.run(["sh", "launch.sh"], cwd=rdir, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"API_TOKEN=tok-{evil}" in r.stdout and "HF_TOKEN=hf-secret-123" in r.stdout
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("value,match", [
    ("{file: /nonexistent/token}", "cannot read /nonexistent/token"),
    ("{env: CLUSTERCTL_TEST_UNSET_VAR}", "the head.s environment has no CLUSTERCTL_TEST_UNSET_VAR"),
])
def test_env_from_a_missing_source_names_the_field(value: str, match: str) -> None:
    from cluster import launch

    spec = jobs.load("resnet50-ddp", [f"env_from.TOKEN={value}"])
    with pytest.raises(JobError, match=f"env_from.TOKEN: {match}"):
        launch.secret_values(spec)


@pytest.mark.parametrize("value", ["x", "{file: a, env: b}", "{path: a}", "{env: ''}", "[a]"])
def test_env_from_refuses_what_it_cannot_read(value: str) -> None:
    with pytest.raises(JobError, match="env_from.TOKEN"):
        jobs.load("resnet50-ddp", [f"env_from.TOKEN={value}"])
