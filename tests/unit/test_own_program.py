"""A user's own program as a job (docs/jobs.md "Your own program"): the spec, the ad-hoc command form,
the launch files each launcher renders (golden), and the bad inputs refused before anything starts."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.runs import jobs, render
from cluster.runs.schema import JobError
from tests import goldens
from tests.conftest import ROOT
from tests.unit.test_render import RUN_ID, mixed_targets

OWN = ROOT / "tests" / "fixtures" / "own"
GOLDEN = ROOT / "tests" / "golden" / "launch"


def rendered(spec: jobs.JobSpec) -> render.LaunchRequest:
    return render.render(spec, mixed_targets(), RUN_ID, "", {f"pc{i}": 29400 + i for i in range(1, 5)})


@pytest.mark.parametrize("job", ["own-ddp", "own-plain"])
def test_own_programs_render_as_golden(job: str) -> None:
    """Only launch.sh is compared: job.json holds the absolute path of `code`, which differs per checkout."""
    request = rendered(jobs.load(str(OWN / f"{job}.yaml")))
    for n in request.nodes[:2]:
        goldens.check(GOLDEN / job / n.node / "launch.sh", n.files["launch.sh"], f"{job}/{n.node}/launch.sh")


def test_the_code_folder_defaults_to_the_spec_files_and_the_launcher_says_the_family() -> None:
    spec = jobs.load(str(OWN / "own-ddp.yaml"))
    assert spec.own and spec["code"] == str(OWN) and spec.launcher == "torchrun" and spec.framework == "pytorch"
    assert render.program_words(spec, "") == (True, ["train.py", "--steps", "3", "--out", "results"])
    builtin = jobs.load("resnet50-ddp")
    assert not builtin.own and builtin.launcher == "torchrun" and builtin["code"] is None


@pytest.mark.parametrize("argv, python, words", [
    (["python", "train.py", "--lr", "0.1"], True, ["train.py", "--lr", "0.1"]),
    (["python3", "-m", "pkg.hello", "x"], True, ["-m", "pkg.hello", "x"]),
    (["./run.sh", "--fast"], False, ["--no-python", "./run.sh", "--fast"]),
    (["python", "-u", "train.py"], False, ["--no-python", render.NODE_PYTHON, "-u", "train.py"]),
])
def test_the_ad_hoc_command_form(argv: list[str], python: bool, words: list[str]) -> None:
    """`clusterctl launch -- ARGV`: as torchrun reads it (a script, -m, or anything else with --no-python)."""
    spec = jobs.from_command(argv, OWN)
    assert spec.own and spec.name == "own" and render.program_words(spec, "") == (python, words)
    plain = jobs.from_command(argv, OWN, launcher="plain")
    assert render.program_words(plain, "")[1] == [w for w in words if w != "--no-python"]


def test_a_plain_node_is_told_where_it_stands() -> None:
    script = rendered(jobs.load(str(OWN / "own-plain.yaml"))).nodes[1].files["launch.sh"]
    for line in ("CLUSTER_NNODES=4", "CLUSTER_NODE_RANK=1", "CLUSTER_COORDINATOR=192.168.1.11:29401",
                 "MASTER_ADDR=192.168.1.11", "MASTER_PORT=29401", "RANK=1", "WORLD_SIZE=4", "cd program"):
        assert line in script.splitlines(), line
    assert "CLUSTER_NODE_ADDRS=192.168.1.11,192.168.1.12,192.168.1.13,192.168.1.14" in script


@pytest.mark.parametrize("override, field", [
    ("program=../outside.py", "program"),
    ("program=/etc/passwd", "program"),
    ("program=nosuch.py", "program"),
    ("module=pkg.hello", "program"),  # program and module both given
    ("launcher=mpirun", "launcher"),
    ("args=--lr 0.1", "args"),
    ("code=/nonexistent/folder", "code"),
    ("framework=tensorflow", "framework"),
    ("outputs=results", "outputs"),  # a list
    ("outputs=[../up]", "outputs"),
    ("outputs=[/abs]", "outputs"),
    ("outputs=[a/./b]", "outputs"),
    ("outputs=[]", "outputs"),
])
def test_bad_own_program_settings_name_the_field(override: str, field: str) -> None:
    with pytest.raises(JobError) as e:
        jobs.load(str(OWN / "own-ddp.yaml"), [override])
    assert e.value.field == field and e.value.exit_code == 2, str(e.value)


def test_outputs_are_paths_in_the_programs_folder() -> None:
    spec = jobs.load(str(OWN / "own-ddp.yaml"), ["outputs=[results, ckpt/last.pt, logs/]"])
    assert spec["outputs"] == ["results", "ckpt/last.pt", "logs/"]


def test_a_builtin_job_refuses_a_launcher_of_its_own() -> None:
    with pytest.raises(JobError, match="launcher"):
        jobs.load("resnet50-ddp", ["launcher=plain"])


def test_a_tensorflow_program_runs_one_worker_per_node(tmp_path: Path) -> None:
    (tmp_path / "tf.py").write_text("print('tf')\n")
    spec = jobs.from_command(["python", "tf.py"], tmp_path, launcher="tensorflow")
    request = rendered(spec)
    assert all(n.nproc == 1 and "tf_config.json" in n.files for n in request.nodes)
    assert 'exec "$CLUSTER_PYTHON" tf.py' in request.nodes[0].files["launch.sh"]
    with pytest.raises(JobError, match="procs_per_node"):
        jobs.from_command(["python", "tf.py"], tmp_path, launcher="tensorflow", overrides=["procs_per_node=2"])
