"""The rendered Slurm scripts RUN, without Slurm: what each task's program gets (its environment, its command
line, its folder) is checked, not the scripts' text.

Slurm's part is played by the variables srun gives a task (SLURM_PROCID, SLURM_NODEID, SLURMD_NODENAME,
SLURM_JOB_NODELIST, ...) and by a fake `scontrol` (and `ip`) on PATH that print recorded outputs of real
slurm-wlm 22.05 (tests/fixtures/slurm/ and tests/fixtures/slurm/launch/, README.md there). The cluster's
Python is a shim: the scripts' own `python -c` snippets and the sampler run for real; the program's start
is recorded (argv, working directory, environment) in the task's call.json, and exits FAKE_EXIT.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.inventory import loader
from cluster.runs import jobs, render as ssh_render
from cluster.slurm import layout, render, submit
from cluster.slurm.resources import SlurmOverrides
from tests.conftest import FIXTURES, ROOT, write

RECORDED = FIXTURES / "slurm"
RUN_ID, DATA_FILE, JOB_ID = "job-20261201-120000-abcd", "digits-0123456789abcdef.npz", "4242"
PORT = 15000 + int(JOB_ID) % 10000  # the port of a job without `port:`
LAB_ADDRS = ["10.196.77.11", "10.196.77.12"]  # NodeAddr of node1 and node2 in the lab's recordings

SHIM = """#!/bin/sh
# the cluster's Python for the tests: the scripts' snippets and the sampler for real, the program recorded
case "$1" in
  -c|*/slurm_sampler.py) exec "$REAL_PYTHON" "$@" ;;
esac
exec "$REAL_PYTHON" "$RECORDER" "$@"
"""
RECORDER = """import json, os, sys, time
with open(os.path.join(os.environ["CLUSTER_TASK_DIR"], "call.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}, f)
time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""
SCONTROL = """#!/bin/sh
# fake scontrol: recorded outputs of `scontrol show hostnames LIST` and `scontrol show node LIST`
echo "$*" >>"$FAKE_SLURM/scontrol.calls"
case "$1 $2" in
  "show hostnames") cat "$FAKE_SLURM/hostnames" ;;
  "show node") cat "$FAKE_SLURM/show_node" ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""
IP = """#!/bin/sh
cat "$FAKE_SLURM/ip"
"""
SRUN = """#!/bin/sh
# fake srun: starts its command once per node of the allocation (the recorded hostnames), as srun would with
# one task per node, each with the variables srun gives a task; exits with the highest task exit code
echo "$*" >"$FAKE_SLURM/srun.args"
while [ $# -gt 0 ]; do case $1 in --*) shift ;; *) break ;; esac; done
i=0
for node in $(cat "$FAKE_SLURM/hostnames"); do
  SLURM_PROCID=$i SLURM_NODEID=$i SLURMD_NODENAME=$node "$@" &
  eval "pid$i=$!"
  i=$((i + 1))
done
rc=0
j=0
while [ $j -lt $i ]; do
  eval "p=\\$pid$j"
  if wait "$p"; then :; else c=$?; if [ "$c" -gt "$rc" ]; then rc=$c; fi; fi
  j=$((j + 1))
done
exit $rc
"""


class Cluster:
    """A fake cluster in tmp_path: its shared folder, the fake commands, the inventory that names it."""

    def __init__(self, tmp_path: Path, hostnames: str, show_node: str, ip: str | None = None,
                 env_setup: str | None = None) -> None:
        self.root = tmp_path
        self.workdir = tmp_path / "shared" / "clusterctl"
        self.fake = tmp_path / "fake"
        self.bin = tmp_path / "bin"
        for d in (self.workdir, self.fake, self.bin):
            d.mkdir(parents=True)
        (self.fake / "hostnames").write_text(hostnames)
        (self.fake / "show_node").write_text(show_node)
        scripts = {"scontrol": SCONTROL, "srun": SRUN, "python": SHIM}
        if ip is not None:
            (self.fake / "ip").write_text(ip)
            scripts["ip"] = IP
        for name, text in scripts.items():
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        (tmp_path / "recorder.py").write_text(RECORDER)
        setup = f"    env_setup: {json.dumps(env_setup)}\n" if env_setup else ""
        self.inv = loader.load(write(tmp_path, f"""\
defaults: {{user: student, ssh_config: none}}
hosts:
  pc1: {{address: 192.168.1.11}}
  pc2: {{address: 192.168.1.12}}
slurm:
  fake:
    login: {{address: 127.0.0.1}}
    workdir: {self.workdir}
    python: {self.bin / 'python'}
{setup}"""), check_files=False)

    def request(self, job: str, sets: list[str] | None = None, **options: Any) -> submit.SlurmRequest:
        spec = jobs.load(job, sets or [])
        return submit.prepare(self.inv, spec, "fake", SlurmOverrides(**options), run_id=RUN_ID, data_file=DATA_FILE)

    def stage(self, req: submit.SlurmRequest, helpers: bool = False) -> Path:
        """What submission stages (cluster/slurm/layout.py), as far as a task reads it."""
        rdir = Path(req.run_dir)
        (rdir / "program").mkdir(parents=True, exist_ok=True)
        for name, content in req.files.items():
            (rdir / name).write_text(content)
        if helpers:
            for dest, src in layout.HELPERS.items():
                (rdir / dest).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, rdir / dest)
        return rdir

    def env(self, **extra: str) -> dict[str, str]:
        env = {"PATH": f"{self.bin}:{os.environ['PATH']}", "HOME": str(self.root), "REAL_PYTHON": sys.executable,
               "RECORDER": str(self.root / "recorder.py"), "FAKE_SLURM": str(self.fake), "SLURM_JOB_ID": JOB_ID,
               "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_RESTART_COUNT": "0"}
        return {**env, **extra}

    def run_task(self, req: submit.SlurmRequest, task: int, node: str, **extra: str) -> subprocess.CompletedProcess[str]:
        """One task as srun starts it: the task script, with the variables srun gives task `task`."""
        rdir = self.stage(req, helpers="CLUSTERCTL_SAMPLE_S" in extra)
        script = rdir / layout.TASK_SCRIPT
        script.write_text(render.task_script(req.job, req.cluster, req.resources, req.run_id, req.data_file))
        env = self.env(SLURM_PROCID=str(task), SLURM_NODEID=str(task), SLURMD_NODENAME=node, **extra)
        return subprocess.run(["/bin/sh", str(script)], env=env, capture_output=True, text=True, timeout=60)


def lab_cluster(tmp_path: Path, **kw: Any) -> Cluster:
    """The lab's 2 nodes, as its recordings show them (`scontrol show node` of node1, then node2)."""
    show = (RECORDED / "scontrol_show_node_idle.txt").read_text() + (RECORDED / "scontrol_show_node_down.txt").read_text()
    return Cluster(tmp_path, (RECORDED / "scontrol_show_hostnames.txt").read_text(), show, **kw)


def call(req: submit.SlurmRequest, task: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((Path(req.run_dir) / f"task-{task}" / "call.json").read_text())
    return doc


def exit_code(req: submit.SlurmRequest, task: int) -> int:
    doc = json.loads((Path(req.run_dir) / f"task-{task}" / "exit.json").read_text())
    assert set(doc) == {"code", "ended"} and isinstance(doc["ended"], int)
    return int(doc["code"])


def test_plain_tasks_get_the_cluster_variables_of_an_ssh_node(tmp_path: Path) -> None:
    c = lab_cluster(tmp_path)
    req = c.request(str(FIXTURES / "own" / "own-plain.yaml"))
    for task, node in enumerate(["node1", "node2"]):
        r = c.run_task(req, task, node)
        assert r.returncode == 0, (r.stdout, r.stderr, (Path(req.run_dir) / f"task-{task}" / "node.log").read_text())
        env = call(req, task)["env"]
        assert {k: env[k] for k in ("CLUSTER_NODE_RANK", "CLUSTER_NNODES", "CLUSTER_NODE_ADDRS", "CLUSTER_COORDINATOR",
                                    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "CLUSTER_NODE_NAME",
                                    "CLUSTER_NODE_ADDRESS", "CLUSTER_RUN_ID")} == {
            "CLUSTER_NODE_RANK": str(task), "CLUSTER_NNODES": "2", "CLUSTER_NODE_ADDRS": ",".join(LAB_ADDRS),
            "CLUSTER_COORDINATOR": f"{LAB_ADDRS[0]}:{PORT}", "MASTER_ADDR": LAB_ADDRS[0], "MASTER_PORT": str(PORT),
            "RANK": str(task), "WORLD_SIZE": "2", "CLUSTER_NODE_NAME": node, "CLUSTER_NODE_ADDRESS": LAB_ADDRS[task],
            "CLUSTER_RUN_ID": RUN_ID}
        tdir = Path(req.run_dir) / f"task-{task}"
        assert env["CLUSTER_METRICS"] == f"{tdir}/out/user-metrics.jsonl" and env["PYTHONUNBUFFERED"] == "1"
        # a user program runs in the run's shared program/ folder, reached through its task folder
        assert call(req, task)["argv"] == ["plain_job.py"]
        assert Path(call(req, task)["cwd"]).resolve() == (Path(req.run_dir) / "program").resolve()
        assert exit_code(req, task) == 0
        doc = json.loads((tdir / "task.json").read_text())
        assert {k: doc[k] for k in ("run_id", "task", "node", "address", "nodes", "addresses", "job_id", "restart")} == {
            "run_id": RUN_ID, "task": task, "node": node, "address": LAB_ADDRS[task], "nodes": ["node1", "node2"],
            "addresses": LAB_ADDRS, "job_id": JOB_ID, "restart": 0}
        assert f"clusterctl: task {task} of Slurm job {JOB_ID} (restart 0) on {node}" in (tdir / "node.log").read_text()
    assert (c.fake / "scontrol.calls").read_text().splitlines() == ["show hostnames node[1-2]", "show node node[1-2]"] * 2


def ssh_plain_names() -> set[str]:
    """The variables an SSH node's plain launch sets (its golden launch.sh, and cluster.env's own names)."""
    text = (ROOT / "tests" / "golden" / "launch" / "own-plain" / "pc1" / "launch.sh").read_text()
    names = {w for line in text.splitlines() if line.startswith("export ") for w in line.split()[1:]}
    env = (ROOT / "templates" / "node.env.j2").read_text()
    names |= set(re.findall(r"^(CLUSTER_[A-Z_]+)=", env, re.M)) - {"CLUSTER_HOSTNAME_ON_LOOPBACK", "CLUSTER_BACKEND",
                                                                    "CLUSTER_AMP"}
    return names


def test_a_plain_task_sets_every_variable_an_ssh_plain_launch_sets(tmp_path: Path) -> None:
    """The same names (docs/jobs.md): a program written for the room's PCs finds them all on Slurm."""
    c = lab_cluster(tmp_path)
    req = c.request(str(FIXTURES / "own" / "own-plain.yaml"))
    assert c.run_task(req, 1, "node2").returncode == 0
    names = ssh_plain_names()
    assert {"CLUSTER_NODE_ADDRS", "CLUSTER_COORDINATOR", "CLUSTER_NODE_ADDRESS", "CLUSTER_PYTHON"} <= names
    assert names - set(call(req, 1)["env"]) == set()


def test_the_real_plain_program_reads_where_it_stands(tmp_path: Path) -> None:
    """The own-program fixture itself (tests/fixtures/own/plain_job.py), run by each task with a real Python."""
    c = lab_cluster(tmp_path)
    (c.bin / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    req = c.request(str(FIXTURES / "own" / "own-plain.yaml"))
    prog = Path(req.run_dir) / "program"
    prog.mkdir(parents=True)
    shutil.copy(FIXTURES / "own" / "plain_job.py", prog)
    for task, node in enumerate(["node1", "node2"]):
        assert c.run_task(req, task, node).returncode == 0
        seen = json.loads((prog / "results" / f"node{task}.json").read_text())
        assert seen["RANK"] == str(task) and seen["CLUSTER_NODE_NAME"] == node
        assert seen["CLUSTER_NODE_ADDRS"] == ",".join(LAB_ADDRS) and seen["WORLD_SIZE"] == "2"
        assert f"plain {task} of 2" in (Path(req.run_dir) / f"task-{task}" / "node.log").read_text()


@pytest.mark.parametrize("port", [0, 23456])
def test_tensorflow_tasks_get_tf_config_from_the_allocation(tmp_path: Path, port: int) -> None:
    c = lab_cluster(tmp_path)
    req = c.request("resnet50-tf", [f"port={port}"])
    want = port or PORT
    for task, node in enumerate(["node1", "node2"]):
        assert c.run_task(req, task, node).returncode == 0
        got = call(req, task)
        assert json.loads(got["env"]["TF_CONFIG"]) == {
            "cluster": {"worker": [f"{a}:{want}" for a in LAB_ADDRS]}, "task": {"type": "worker", "index": task}}
        _, words = ssh_render.program_words(req.job, layout.dataset(str(c.workdir), DATA_FILE))
        assert got["argv"] == [str(w) for w in words]  # the SSH launch's command line
        assert got["argv"][:3] == ["program/train_tf.py", "--data", f"{c.workdir}/datasets/{DATA_FILE}"]
        assert Path(got["cwd"]) == Path(req.run_dir) / f"task-{task}"  # --out out: the task's own out/
        assert (Path(got["cwd"]) / "program").resolve() == (Path(req.run_dir) / "program").resolve()


def test_torchrun_tasks_rendezvous_at_the_first_node(tmp_path: Path) -> None:
    c = lab_cluster(tmp_path)
    req = c.request("resnet50-ddp", ["max_restarts=2"], gpus_per_node=2)
    for task, node in enumerate(["node1", "node2"]):
        assert c.run_task(req, task, node).returncode == 0
        argv = call(req, task)["argv"]
        assert argv[:2] == ["-m", "torch.distributed.run"]
        opts = dict(zip(argv[2:argv.index("program/train_torch.py")][::2], argv[3:argv.index("program/train_torch.py")][::2]))
        assert opts["--nnodes"] == "2" and opts["--nproc-per-node"] == "2" and opts["--max-restarts"] == "2"
        assert opts["--rdzv-backend"] == "c10d" and opts["--rdzv-endpoint"] == f"{LAB_ADDRS[0]}:{PORT}"
        assert opts["--rdzv-id"] == RUN_ID and opts["--rdzv-conf"] == f"is_host={1 if task == 0 else 0}"
        assert opts["--local-addr"] == LAB_ADDRS[task]
        assert opts["--log-dir"] == f"{req.run_dir}/task-{task}/logs"


def test_gloo_is_pinned_to_the_interface_that_carries_the_node_address(tmp_path: Path) -> None:
    """cn1's recorded `ip -o -4 addr show` carries cn1's NodeAddr (eth0) and not cn2's."""
    rec = RECORDED / "launch"
    c = Cluster(tmp_path, (rec / "scontrol_show_hostnames_cn.txt").read_text(),
                (rec / "scontrol_show_node_list.txt").read_text(), ip=(rec / "ip_o_4_addr_show_cn1.txt").read_text())
    req = c.request("resnet50-ddp")
    assert c.run_task(req, 0, "cn1", SLURM_JOB_NODELIST="cn[1-2]").returncode == 0
    assert call(req, 0)["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
    assert call(req, 0)["env"]["CLUSTER_NODE_ADDRS"] == "10.199.7.11,10.199.7.12"
    assert c.run_task(req, 1, "cn2", SLURM_JOB_NODELIST="cn[1-2]").returncode == 0  # not on this node's interfaces
    assert "GLOO_SOCKET_IFNAME" not in call(req, 1)["env"]
    assert "no interface here carries 10.199.7.12" in (Path(req.run_dir) / "task-1" / "node.log").read_text()


@pytest.mark.skipif(shutil.which("getent") is None, reason="needs getent")
def test_a_node_address_that_is_a_name_is_resolved_for_the_interface(tmp_path: Path) -> None:
    show = (RECORDED / "scontrol_show_node_idle.txt").read_text().replace("NodeAddr=10.196.77.11", "NodeAddr=localhost")
    c = Cluster(tmp_path, "node1\n", show, ip=(RECORDED / "launch" / "ip_o_4_addr_show_cn1.txt").read_text())
    req = c.request("resnet50-ddp", nodes=1)
    assert c.run_task(req, 0, "node1", SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES="1").returncode == 0
    env = call(req, 0)["env"]
    assert env["CLUSTER_NODE_ADDRESS"] == "localhost" == env["MASTER_ADDR"] and env["GLOO_SOCKET_IFNAME"] == "lo"


def test_the_program_exit_code_is_the_task_exit_code_and_recorded(tmp_path: Path) -> None:
    c = lab_cluster(tmp_path)
    req = c.request("resnet50-ddp")
    r = c.run_task(req, 1, "node2", FAKE_EXIT="3")
    assert r.returncode == 3 and exit_code(req, 1) == 3


def test_a_tasks_programs_get_a_tmpdir_of_their_own_under_the_nodes_and_it_goes_with_the_task(tmp_path: Path) -> None:
    """As on the room's PCs (docs/jobs.md): a folder of the task's own, under the node's TMPDIR (a site's, or
    /tmp), removed when the task ends, whatever its exit code."""
    c = lab_cluster(tmp_path)
    req = c.request("resnet50-ddp")
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    for task, code in ((0, "0"), (1, "3")):
        assert c.run_task(req, task, f"node{task + 1}", FAKE_EXIT=code, TMPDIR=str(node_tmp)).returncode == int(code)
        mine = Path(call(req, task)["env"]["TMPDIR"])
        assert mine.parent == node_tmp and mine.name.startswith(f"clusterctl-{JOB_ID}.")
        assert not mine.exists()
    assert list(node_tmp.iterdir()) == []


def test_a_node_without_nodeaddr_fails_the_task_before_the_program(tmp_path: Path) -> None:
    c = Cluster(tmp_path, (RECORDED / "scontrol_show_hostnames.txt").read_text(),
                (RECORDED / "scontrol_show_node_idle.txt").read_text())  # node2 missing from scontrol's answer
    req = c.request("resnet50-ddp")
    r = c.run_task(req, 0, "node1")
    assert r.returncode == 1 and exit_code(req, 0) == 1
    assert not (Path(req.run_dir) / "task-0" / "call.json").exists()
    assert "scontrol shows no NodeAddr for node2" in (Path(req.run_dir) / "task-0" / "node.log").read_text()


def test_a_task_that_is_not_one_per_node_refuses_to_start(tmp_path: Path) -> None:
    c = lab_cluster(tmp_path)
    req = c.request("resnet50-ddp")
    rdir = c.stage(req)
    (rdir / "task.sh").write_text(render.task_script(req.job, req.cluster, req.resources, RUN_ID, DATA_FILE))
    r = subprocess.run(["/bin/sh", str(rdir / "task.sh")], capture_output=True, text=True, timeout=60,
                       env=c.env(SLURM_PROCID="1", SLURM_NODEID="0", SLURMD_NODENAME="node1"))
    assert r.returncode == 2 and "one task per node expected" in (rdir / "task-1" / "node.log").read_text()


def test_a_requeued_job_appends_its_output_and_writes_its_exit_anew(tmp_path: Path) -> None:
    c = lab_cluster(tmp_path)
    req = c.request("resnet50-ddp")
    assert c.run_task(req, 0, "node1", FAKE_EXIT="1").returncode == 1
    assert c.run_task(req, 0, "node1", SLURM_RESTART_COUNT="1").returncode == 0
    log = (Path(req.run_dir) / "task-0" / "node.log").read_text()
    assert "(restart 0) on node1" in log and "(restart 1) on node1" in log
    assert exit_code(req, 0) == 0
    assert json.loads((Path(req.run_dir) / "task-0" / "task.json").read_text())["restart"] == 1


def test_a_task_samples_its_processes_as_the_node_agent_does(tmp_path: Path) -> None:
    c = lab_cluster(tmp_path)
    req = c.request("resnet50-ddp")
    assert c.run_task(req, 0, "node1", CLUSTERCTL_SAMPLE_S="0.2", FAKE_SLEEP="1.5").returncode == 0
    samples = [json.loads(x) for x in (Path(req.run_dir) / "task-0" / "out" / "usage.jsonl").read_text().splitlines()]
    assert len(samples) >= 3
    assert all({"t", "procs", "rss_mb"} <= set(s) for s in samples) and "cpu_percent" in samples[-1]
    assert max(s["procs"] for s in samples) >= 1 and max(s["rss_mb"] for s in samples) > 0


def test_the_job_secrets_file_is_read_by_each_task(tmp_path: Path) -> None:
    c = lab_cluster(tmp_path)
    (tmp_path / "token").write_text("s3cr3t 'x'\n")
    req = c.request("resnet50-ddp", [f"env_from.HF_TOKEN={{file: {tmp_path / 'token'}}}"])
    rdir = c.stage(req)
    from cluster.runs.payload import secret_values, secrets_file

    (rdir / layout.SECRETS).write_text(secrets_file(secret_values(req.job)))
    assert c.run_task(req, 0, "node1").returncode == 0
    assert call(req, 0)["env"]["HF_TOKEN"] == "s3cr3t 'x'"
    assert "s3cr3t" not in req.script


def test_the_batch_script_runs_env_setup_writes_the_task_script_and_starts_one_task_per_node(tmp_path: Path) -> None:
    c = lab_cluster(tmp_path, env_setup="CC_SETUP=done; export CC_SETUP\n")
    req = c.request("resnet50-tf", cpus_per_task=2)
    rdir = c.stage(req)
    r = subprocess.run(["bash", str(rdir / layout.BATCH_SCRIPT)], env=c.env(), capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert (rdir / layout.TASK_SCRIPT).read_text() == render.task_script(req.job, req.cluster, req.resources, RUN_ID,
                                                                          DATA_FILE)
    srun = (c.fake / "srun.args").read_text().split()
    assert srun[:4] == ["--kill-on-bad-exit=1", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    assert "--cpus-per-task=2" in srun and srun[-2:] == ["/bin/sh", str(rdir / layout.TASK_SCRIPT)]
    for task in (0, 1):
        got = call(req, task)
        assert got["env"]["CC_SETUP"] == "done"  # the cluster's env_setup, handed to every task
        assert json.loads(got["env"]["TF_CONFIG"])["task"]["index"] == task and exit_code(req, task) == 0
    assert f"clusterctl: run {RUN_ID}, Slurm job {JOB_ID} (restart 0) on node[1-2]" in r.stdout
    assert oct((rdir / "task-0").stat().st_mode & 0o777) == "0o700"  # the task folders are the owner's only


def test_the_batch_script_fails_a_task_and_refuses_an_unstaged_run(tmp_path: Path) -> None:
    c = lab_cluster(tmp_path)
    req = c.request("resnet50-ddp")
    rdir = c.stage(req)
    r = subprocess.run(["bash", str(rdir / layout.BATCH_SCRIPT)], env=c.env(FAKE_EXIT="5"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 5 and exit_code(req, 0) == exit_code(req, 1) == 5
    (rdir / "program").rmdir()
    r = subprocess.run(["bash", str(rdir / layout.BATCH_SCRIPT)], env=c.env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "program is missing: the run was not staged" in r.stderr


def test_a_task_that_slurm_terminates_records_code_143(tmp_path: Path) -> None:
    """scancel, a time limit or a failed peer under srun -K: SIGTERM to every process of the step."""
    import signal
    import time

    c = lab_cluster(tmp_path)
    req = c.request("resnet50-ddp")
    rdir = c.stage(req)
    (rdir / "task.sh").write_text(render.task_script(req.job, req.cluster, req.resources, RUN_ID, DATA_FILE))
    p = subprocess.Popen(["/bin/sh", str(rdir / "task.sh")], start_new_session=True,
                         env=c.env(SLURM_PROCID="0", SLURM_NODEID="0", SLURMD_NODENAME="node1", FAKE_SLEEP="30"))
    deadline = time.monotonic() + 30
    while not (rdir / "task-0" / "call.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(timeout=30) == 143 and exit_code(req, 0) == 143
