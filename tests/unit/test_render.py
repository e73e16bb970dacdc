"""Rendered launch files and the printed launch request (`launch --dry-run`, text and --json): golden files
for a mixed 4-node lab (UPDATE_GOLDEN=1 rewrites them; review the diff), and values that try to break out."""
from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from cluster.runs import jobs, launch, payload, render, schema
from cluster.inventory import loader, model
from cluster.errors import UsageError
from cluster.runs.schema import JobError
from tests import goldens
from tests.conftest import ROOT

GOLDEN = ROOT / "tests" / "golden" / "launch"
MIXED = ROOT / "tests" / "fixtures" / "launch" / "mixed.yaml"
REQUEST_FILES = ("request.txt", "request.json")  # the printed request, beside each node's files
RUN_ID, DATA_FILE = "resnet50-20261129-120000-abcd", "digits-0123456789abcdef.npz"


def mixed_targets() -> list[render.Target]:
    inv = loader.load(MIXED, check_files=False)
    return [render.Target(h, h.gpu.count if h.gpu else 0, "gloo") for h in inv.ordered(inv.hosts.values())]


def plan_for(job: str) -> render.LaunchRequest:
    spec = jobs.load(job, ["epochs=2", "env.OMP_PROC_BIND=close"])
    ports = {"pc1": 29400} if spec.framework == "pytorch" else {f"pc{i}": 23450 + i for i in range(1, 5)}
    return render.render(spec, mixed_targets(), RUN_ID, DATA_FILE, ports)


def request_for(job: str) -> render.LaunchRequest:
    """What `launch JOB --dry-run` prints for the mixed lab, the job as shipped (its port picked at start)."""
    inv = loader.load(MIXED, check_files=False)
    return launch.request_for(inv, jobs.load(job), mixed_targets(), RUN_ID, DATA_FILE)


@pytest.mark.parametrize("job", ["resnet50-ddp", "resnet50-tf"])
def test_rendered_files_match_golden(job: str) -> None:
    plan = plan_for(job)
    for n in plan.nodes:
        for name, content in n.files.items():
            goldens.check(GOLDEN / job / n.node / name, content, f"{job}/{n.node}/{name}")
    names = {p.relative_to(GOLDEN / job).as_posix() for p in (GOLDEN / job).rglob("*") if p.is_file()}
    assert names == {f"{n.node}/{f}" for n in plan.nodes for f in n.files} | set(REQUEST_FILES)  # none stale


@pytest.mark.parametrize("job", ["resnet50-ddp", "resnet50-tf"])
def test_printed_request_matches_golden(job: str) -> None:
    """`launch --dry-run` (text, 80 columns as on a pipe) and `launch --dry-run --json`, as printed."""
    request = request_for(job)
    goldens.check(GOLDEN / job / "request.txt", request.to_text(80), f"{job} --dry-run text")
    goldens.check(GOLDEN / job / "request.json", json.dumps(request.to_dict(), indent=2, default=str) + "\n",
                  f"{job} --dry-run --json")


def test_request_says_whether_the_port_is_chosen_or_picked_at_start() -> None:
    request = request_for("resnet50-ddp")
    assert request.port_picked_at_start and request.endpoint == "192.168.1.11:29400"  # the default, shown
    assert "picked when the run starts" in request.to_text()
    inv = loader.load(MIXED, check_files=False)
    chosen = launch.request_for(inv, jobs.load("resnet50-ddp", ["port=29555"]), mixed_targets(), RUN_ID, DATA_FILE)
    assert not chosen.port_picked_at_start and chosen.endpoint == "192.168.1.11:29555"
    assert "the job's `port:` is used" in chosen.to_text()
    assert chosen.to_dict()["files"]["pc4"]["job.json"] == chosen.nodes[3].files["job.json"]
    assert [h["name"] for h in chosen.inventory["hosts"]] == ["pc1", "pc2", "pc3", "pc4"]


@pytest.mark.parametrize("title", ["pc1: /x/launch.sh", "ab", "t" * 36, "t" * 37, "t" * 90])
def test_a_rule_is_drawn_as_rich_draws_it_on_a_pipe(title: str) -> None:
    """The text the CLI printed before the request had its own rendering: rich's rule, 40 or 80 wide."""
    import io

    from rich.console import Console

    for width in (40, 80):
        buf = io.StringIO()
        Console(file=buf, width=width, color_system=None).rule(title)
        assert render.rule(title, width) == buf.getvalue().rstrip("\n")


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


def run_launch_sh(spec: jobs.JobSpec, host: model.Host, tmp_path: Path, data: str = "data.npz",
                  env: dict[str, str] | None = None) -> tuple[dict, Path]:
    """The spec's launch.sh for `host`, rendered and really run by sh (`env`: what the node agent gives it),
    with a recording python: what the program got (argv, cwd and some of its environment), the run folder."""
    plan = render.render(spec, [render.Target(host)], "run1", data, {host.name: 29400})
    node = plan.nodes[0]
    rdir = Path(node.run_dir)
    (rdir / "program").mkdir(parents=True)
    for name, content in node.files.items():
        (rdir / name).write_text(content)
    recorder = tmp_path / "recorder.py"
    recorder.write_text("import json, os, sys\n"
                        "json.dump({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) for k in "
                        "('NOTE', 'CLUSTER_NODE_NAME', 'CLUSTER_RUN_ID', 'TF_CONFIG', 'TMPDIR')}, 'cwd': os.getcwd()}, "
                        f"open({str(tmp_path / 'got.json')!r}, 'w'))\n")
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\nexec python3 {recorder} \"$@\"\n")
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
    (Path(host.workdir) / "cluster.env").write_text(f"CLUSTER_PYTHON={fake_python}\nCLUSTER_NODE_ADDRESS=127.0.0.1\n"
                                                   "export CLUSTER_PYTHON CLUSTER_NODE_ADDRESS\n")
    assert subprocess.run(["sh", "-n", "launch.sh"], cwd=rdir).returncode == 0
    r = subprocess.run(["sh", "launch.sh"], cwd=rdir, capture_output=True, text=True, timeout=60,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return json.loads((tmp_path / "got.json").read_text()), rdir


@pytest.mark.parametrize("job", ["resnet50-ddp", "resnet50-tf"])
def test_hostile_values_arrive_literally_and_run_nothing(job: str, tmp_path: Path) -> None:
    """Workdir, host name, env values and dataset file full of shell syntax: the rendered launch.sh,
    really run by sh, passes them through as data and executes none of them."""
    canary = tmp_path / "pwned"
    evil = EVIL.format(canary=canary)
    workdir = tmp_path / f"work {evil[:20]}".replace("\n", " ").replace("/", "_")
    workdir = tmp_path / workdir.name
    host = model.Host(name=f"pc1{evil}", address="127.0.0.1", workdir=str(workdir))
    got, rdir = run_launch_sh(jobs.load(job, [f"env.NOTE={json.dumps(evil)}"]), host, tmp_path, f"data {evil}.npz")
    assert not canary.exists(), "a value from the inventory or spec was executed by the shell"
    assert got["env"]["NOTE"] == evil and got["env"]["CLUSTER_NODE_NAME"] == host.name
    assert got["cwd"] == str(rdir)
    assert f"{workdir}/datasets/data {evil}.npz" in got["argv"]
    if job == "resnet50-tf":
        assert json.loads(got["env"]["TF_CONFIG"])["task"] == {"type": "worker", "index": 0}
    else:
        assert got["argv"][:2] == ["-m", "torch.distributed.run"]


@pytest.mark.parametrize("own", [False, True], ids=["run's-own", "job's-env"])
def test_a_jobs_env_tmpdir_wins_over_the_runs_own(tmp_path: Path, own: bool) -> None:
    """docs/jobs.md: the node agent gives the programs the run's .tmp as TMPDIR; the job's env is exported
    after it, so `env: {TMPDIR: ...}` (or a cache's own variable) keeps what a program caches there."""
    host = model.Host(name="pc1", address="127.0.0.1", workdir=str(tmp_path / "w"))
    runs = str(tmp_path / "w" / "runs" / "run1" / ".tmp")
    spec = jobs.load("resnet50-ddp", [f"env.TMPDIR={tmp_path / 'keep'}"] if own else [])
    got, _ = run_launch_sh(spec, host, tmp_path, env={"TMPDIR": runs})
    assert got["env"]["TMPDIR"] == (str(tmp_path / "keep") if own else runs)


def test_env_from_secrets_reach_the_program_and_no_rendered_file(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A token from the head's environment and one from a file: on the node only in secrets.env (sourced by
    launch.sh), never in launch.sh, job.json or anything kept on the head."""

    evil = EVIL.format(canary=tmp_path / "pwned")
    monkeypatch.setenv("LAB_TOKEN", f"tok-{evil}")
    (tmp_path / "hf").write_text("hf-secret-123\n")
    spec = jobs.load("resnet50-ddp", ["env_from.API_TOKEN={env: LAB_TOKEN}", f"env_from.HF_TOKEN={{file: {tmp_path / 'hf'}}}"])
    values = payload.secret_values(spec)
    assert values == {"API_TOKEN": f"tok-{evil}", "HF_TOKEN": "hf-secret-123"}
    host = model.Host(name="pc1", address="127.0.0.1", workdir=str(tmp_path / "w"))
    node = render.render(spec, [render.Target(host)], "run1", "d.npz", {"pc1": 29400}).nodes[0]
    for name, content in node.files.items():
        assert "hf-secret-123" not in content and "tok-" not in content, name
    rdir = Path(node.run_dir)
    rdir.mkdir(parents=True)
    (rdir / "launch.sh").write_text(node.files["launch.sh"].replace('exec "$CLUSTER_PYTHON"', "exec env #"))
    (rdir / "secrets.env").write_text(payload.secrets_file(values))
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

    spec = jobs.load("resnet50-ddp", [f"env_from.TOKEN={value}"])
    with pytest.raises(JobError, match=f"env_from.TOKEN: {match}"):
        payload.secret_values(spec)


@pytest.mark.parametrize("value", ["x", "{file: a, env: b}", "{path: a}", "{env: ''}", "[a]"])
def test_env_from_refuses_what_it_cannot_read(value: str) -> None:
    with pytest.raises(JobError, match="env_from.TOKEN"):
        jobs.load("resnet50-ddp", [f"env_from.TOKEN={value}"])


@pytest.mark.parametrize("value, want", [("0,2", "0,2"), ([1], "1"), (0, "0"),
                                         ("GPU-5f3c9c2e-aaaa-bbbb-cccc-1234567890ab", "GPU-5f3c9c2e-aaaa-bbbb-cccc-1234567890ab")])
def test_the_inventorys_visible_devices_reach_every_launcher(value: object, want: str) -> None:
    for job in ("resnet50-ddp", "resnet50-tf"):
        host = model.Host(name="pc1", address="127.0.0.1", vars={"cuda_visible_devices": value})
        script = render.render(jobs.load(job), [render.Target(host, 1)], "run1", "d.npz",
                               {"pc1": 29400}).nodes[0].files["launch.sh"]
        assert f"CUDA_VISIBLE_DEVICES={want}" in script.splitlines() and "export CUDA_VISIBLE_DEVICES" in script
    plain = render.render(jobs.load("resnet50-ddp"), [render.Target(model.Host(name="pc1", address="127.0.0.1"))],
                          "run1", "d.npz", {"pc1": 29400}).nodes[0].files["launch.sh"]
    assert "CUDA_VISIBLE_DEVICES" not in plain  # not in the inventory: every GPU of the node


@pytest.mark.parametrize("value", ["0,0", "gpu0", "", "0;rm -rf /", True, [0, "x y"]])
def test_bad_visible_devices_are_refused_naming_the_node_and_the_var(value: object) -> None:
    host = model.Host(name="pc1", address="127.0.0.1", vars={"cuda_visible_devices": value})
    with pytest.raises(UsageError, match="pc1: inventory var cuda_visible_devices"):
        render.render(jobs.load("resnet50-ddp"), [render.Target(host)], "run1", "d.npz", {"pc1": 29400})


def test_a_relative_workdir_is_the_login_directorys_in_every_path_the_script_gives(tmp_path: Path) -> None:
    """workdir `clusterctl` (Ansible's default: no workdir): launch.sh runs from the run folder, so every path
    it gives the program (its data, metrics file, layer, torchrun's log dir) must not be relative."""
    home = tmp_path / "home"
    host = model.Host(name="pc1", address="127.0.0.1", workdir="clusterctl")
    spec = jobs.load("resnet50-ddp")
    node = render.render(spec, [render.Target(host)], "run1", "d.npz", {"pc1": 29400}, layer="clusterctl/layers/x").nodes[0]
    rdir = home / node.run_dir
    rdir.mkdir(parents=True)
    (home / "clusterctl" / "cluster.env").write_text("CLUSTER_NODE_ADDRESS=127.0.0.1\n")
    script = node.files["launch.sh"].replace('exec "$CLUSTER_PYTHON" -m torch.distributed.run', 'pwd; exec echo')
    (rdir / "launch.sh").write_text(script)
    r = subprocess.run(["sh", "launch.sh"], cwd=rdir, capture_output=True, text=True, timeout=60,
                       env={"HOME": str(home), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    cwd, words = r.stdout.splitlines()[0], r.stdout.split()
    assert cwd == str(rdir.resolve())
    assert f"{home.resolve()}/clusterctl/datasets/d.npz" in words  # the built-in program's --data
    assert f"{home.resolve()}/clusterctl/runs/run1/logs" in words  # torchrun's --log-dir


def test_a_users_program_job_json_holds_its_own_settings_not_the_built_in_programs_knobs(tmp_path: Path) -> None:
    """The dry run of `launch -- python train.py` shows the program's job: no batch, dataset or optimizer."""
    (tmp_path / "train.py").write_text("print(1)\n")
    own = jobs.from_command(["python", "train.py", "--steps", "3"], tmp_path)
    assert own.node_settings["program"] == "train.py" and own.node_settings["args"] == ["--steps", "3"]
    assert not set(own.node_settings) & {"batch", "dataset", "optimizer", "epochs", "grad_compression", "threads"}
    assert set(own.node_settings) | schema.BUILT_IN_KEYS == set(own.settings)
    assert jobs.load("resnet50-ddp").node_settings == jobs.load("resnet50-ddp").settings  # a built-in: all of it
