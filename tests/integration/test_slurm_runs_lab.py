"""The same jobs on a real Slurm (issue 27): `launch JOB --on slurm` on a `lab up 2 --slurm` lab submits over SSH to
the login node, Slurm runs the tasks on both nodes, `status` is Slurm's verdict, `stop` is scancel, `collect`
brings the job's folder back, and one `report` shows the Slurm runs beside an SSH run of the same job."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.lab import lifecycle, sshd
from tests.integration.conftest import clusterctl, clusterctl_json, lab_up, pytestmark, wait_until  # noqa: F401
from tests.integration.test_faults_run import AS_FROM_A_TERMINAL

pytestmark = [pytestmark, pytest.mark.skipif(not Path("/usr/sbin/slurmctld").exists(),
                                             reason="slurm-wlm is not installed (scripts/setup.sh installs it)")]
TINY = ["--set", "epochs=1", "--set", "threads=1", "--set", "max_steps=3", "--set", "log_every=1"]
PLAIN = """\
import json, os, socket
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
print(f"plain rank {rank} of {world} on {os.environ['CLUSTER_NODE_NAME']} at {os.environ['CLUSTER_NODE_ADDRESS']}")
with open(os.environ["CLUSTER_METRICS"], "a") as f:
    f.write(json.dumps({"step": 1, "loss": 0.5 + rank}) + "\\n")
"""


@pytest.fixture(scope="module")
def slab(tmp_path_factory: pytest.TempPathFactory):
    with lab_up(tmp_path_factory, "q", 2, 19, slurm=True) as (state, d):
        env = {"CLUSTERCTL_HOME": str(d / "home")}
        rc, res = clusterctl_json("provision", state.inventory, "--set", f"python={sys.executable}",
                                  "--set", "vars.python_env=existing", env=env, timeout=600)
        assert rc == 0, json.dumps(res)[-2000:]
        yield state, d, env


def test_both_jobs_run_on_slurm_and_report_beside_an_ssh_run(slab) -> None:
    state, d, env = slab
    rc, ssh_run = clusterctl_json("launch", "resnet50-ddp", *TINY, env=env, timeout=600)
    assert rc == 0 and ssh_run["state"] == "succeeded", json.dumps(ssh_run)[-2000:]
    runs = [ssh_run["run_id"]]
    for job in ("resnet50-ddp", "resnet50-tf"):
        rc, rec = clusterctl_json("launch", job, "--on", "slurm", *TINY, env=env, timeout=900)
        assert rc == 0 and rec["state"] == "succeeded", json.dumps(rec)[-3000:]
        assert rec["target"]["kind"] == "slurm" and rec["target"]["state"] == "COMPLETED"
        assert sorted(n["node"] for n in rec["nodes"]) == ["node1", "node2"] and rec["world_size"] == 2
        rc, col = clusterctl_json("collect", rec["run_id"], env=env, timeout=600)
        assert rc == 0, col
        assert sorted(n["node"] for n in col["nodes"]) == ["node1", "node2"], col  # not the login node
        assert not any(n["skipped"] for n in col["nodes"]), col
        base = Path(env["CLUSTERCTL_HOME"]) / "runs" / rec["run_id"]
        for node in ("node1", "node2"):
            assert list((base / node).rglob("metrics-rank*.jsonl")), list(base.rglob("*"))[:30]
            assert (base / node / "task.json").is_file() and (base / node / "exit.json").is_file()
        assert (base / "slurm" / "job.sbatch").is_file()
        runs.append(rec["run_id"])
    assert clusterctl("collect", ssh_run["run_id"], env=env, timeout=600).returncode == 0
    rc, rep = clusterctl_json("report", *runs, env=env, timeout=600)
    assert rc == 0, rep
    figs = {f["run_id"]: f for f in rep["runs"]}
    keys = set(figs[runs[0]])
    for rid in runs[1:]:
        assert set(figs[rid]) == keys  # the same metrics for a Slurm run as for the SSH one
        f = figs[rid]
        assert sorted(f["nodes"]) == ["node1", "node2"] and f["world"] == 2 and (f["images_per_s"] or 0) > 0, f
        assert f["wall_s"] and [n["exit_code"] for n in f["per_node"]] == [0, 0], f["per_node"]
        assert all(n["rss_mb_peak"] for n in f["per_node"])  # the tasks' own resource samples


def test_a_study_runs_its_matrix_on_slurm(slab) -> None:
    state, d, env = slab
    # one cell (the 2-node runs are above): the matrix's way onto Slurm, its report
    rc, res = clusterctl_json("study", "resnet50-ddp", "--on", "slurm", "--nodes", "1", *TINY, env=env, timeout=900)
    assert rc == 0, json.dumps(res)[-2000:]
    assert [(c["nodes"], c["state"]) for c in res["cells"]] == [(1, "succeeded")]
    assert res["report"] and Path(res["report"]).is_file()
    report = json.loads((Path(res["report"]).parent / "report.json").read_text())
    assert [len(f["nodes"]) for f in report] == [1] and all(f["images_per_s"] for f in report)


def test_more_nodes_than_the_partition_has_is_refused_before_submitting(slab) -> None:
    state, d, env = slab
    r = clusterctl("launch", "resnet50-ddp", "--on", "slurm", "--nodes", "3", *TINY, env=env, timeout=120)
    assert r.returncode == 2 and "partition debug has 2 node(s); the job asks for 3" in r.stderr, r.stderr
    assert "submitted" not in r.stderr


def test_a_users_program_runs_through_slurm_the_same_way(slab, tmp_path: Path) -> None:
    state, d, env = slab
    (tmp_path / "hello.py").write_text(PLAIN)
    r = subprocess.run([sys.executable, "-m", "cluster", "launch", "--on", "slurm", "--launcher", "plain",
                        "--code", str(tmp_path), "--json", "--", "python", "hello.py"],
                       capture_output=True, text=True, cwd=tmp_path, env={**__import__("os").environ, **env},
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rec = json.loads(r.stdout)
    assert rec["state"] == "succeeded"
    rc, logs = clusterctl_json("logs", rec["run_id"], env=env)
    assert rc == 0 and any("plain rank 1 of 2" in text for text in logs.values()), logs


def test_stop_cancels_a_running_job_and_leaves_nothing_on_the_nodes(slab) -> None:
    state, d, env = slab
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "--on", "slurm", "--detach", "--set", "epochs=50",
                              "--set", "threads=1", env=env, timeout=300)
    assert rc == 0 and rec["state"] in ("queued", "running") and rec["scheduler"] == "slurm", rec
    run_id = rec["run_id"]

    def running() -> bool:
        rc, st = clusterctl_json("status", run_id, env=env)
        return st["target"]["state"] == "RUNNING" and any(s["state"] == "running" for s in (st["last_status"] or {}).values())
    wait_until(running, 120, "the job's tasks running", step=1.0)
    rc, stopped = clusterctl_json("stop", run_id, env=env, timeout=180)
    assert rc == 0 and stopped["state"] == "stopped" and stopped["target"]["state"] == "CANCELLED", stopped
    time.sleep(1.0)
    for n in state.nodes:  # nothing of the job left in any node's namespace
        pids = subprocess.run(["ip", "netns", "pids", n.netns], capture_output=True, text=True).stdout.split()
        cmds = [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                for p in pids if Path(f"/proc/{p}/cmdline").exists()]
        assert not [c for c in cmds if "train_torch" in c or "torch.distributed.run" in c], cmds
    rc, st = clusterctl_json("status", run_id, env=env)
    assert st["state"] == "stopped"


def test_a_job_waiting_for_nodes_is_queued_with_slurms_reason_and_stops_while_queued(slab) -> None:
    """A first job holds every CPU of both nodes; a second, submitted meanwhile, waits in Slurm's queue: `status` and `runs`
    say `queued` with Slurm's reason; `logs -f` following it is left with Ctrl-C (the job stays queued);
    `stop` while it is queued cancels it (`stopped`, never ran) and the first job goes on."""
    state, d, env = slab
    from cluster.lab.slurm_conf import CPUS

    rc, first = clusterctl_json("launch", "resnet50-ddp", "--on", "slurm", "--detach", "--set", "epochs=50",
                                "--set", "threads=1", "--cpus-per-task", str(CPUS), env=env, timeout=300)
    assert rc == 0, first
    wait_until(lambda: clusterctl_json("status", first["run_id"], env=env)[1]["state"] == "running", 120,
               "the first job running", step=1.0)
    try:
        rc, second = clusterctl_json("launch", "resnet50-ddp", "--on", "slurm", "--detach", *TINY, env=env,
                                     timeout=300)
        assert rc == 0 and second["state"] == "queued", second
        def waits() -> dict:
            rc, st = clusterctl_json("status", second["run_id"], env=env)
            assert rc == 0 and st["state"] == "queued" and st["target"]["state"] == "PENDING", st
            return st if st["target"]["reason"] in ("Resources", "Priority") else {}  # "": not weighed yet
        wait_until(waits, 60, "Slurm's reason for the wait", step=2.0)
        st = waits()
        assert st["target"]["reason"] in st["where"], st
        r = clusterctl("status", second["run_id"], env=env)
        assert "queued" in r.stdout and st["target"]["reason"] in r.stdout, r.stdout
        rc, listed = clusterctl_json("runs", env=env)
        mine = next(x for x in listed if x.get("run_id") == second["run_id"])
        assert mine["state"] == "queued" and mine["scheduler"] == "slurm" and st["target"]["reason"] in mine["where"]
        # following its logs, then Ctrl-C: the command leaves (130), the job stays in Slurm's queue
        # as from a terminal, SIGINT at its default (a suite run in the background ignores it: test_faults_run);
        # PYTHONFAULTHANDLER: were it still there after the bound, SIGABRT makes it say where each thread waits
        follow = subprocess.Popen([*AS_FROM_A_TERMINAL, "-m", "cluster", "logs", second["run_id"], "-f"],
                                  env={**os.environ, **env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        time.sleep(5)
        follow.send_signal(signal.SIGINT)
        try:
            follow.wait(timeout=60)
        except subprocess.TimeoutExpired:
            follow.send_signal(signal.SIGABRT)
            raise AssertionError(f"logs -f still there 60 s after Ctrl-C: {follow.communicate(timeout=30)}") from None
        assert follow.returncode == 130, follow.communicate()
        assert clusterctl_json("status", second["run_id"], env=env)[1]["state"] == "queued"
        rc, stopped = clusterctl_json("stop", second["run_id"], env=env, timeout=180)
        assert rc == 0 and stopped["state"] == "stopped" and stopped["target"]["state"] == "CANCELLED", stopped
        assert stopped["nodes"] == [], stopped  # it never ran: no task, no node
        assert clusterctl_json("status", first["run_id"], env=env)[1]["state"] == "running"
    finally:
        clusterctl("stop", first["run_id"], env=env, timeout=180)


def test_a_crashed_node_gives_slurms_verdict_naming_the_node(slab) -> None:
    from cluster.lab import slurm as lab_slurm

    state, d, env = slab
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "--on", "slurm", "--detach", "--set", "epochs=50",
                              "--set", "threads=1", env=env, timeout=300)
    assert rc == 0
    run_id = rec["run_id"]
    wait_until(lambda: clusterctl_json("status", run_id, env=env)[1]["target"]["state"] == "RUNNING", 120,
               "the job running", step=1.0)
    lab = lifecycle.load_state(state.name, Path(state.dir))
    assert lab is not None
    lab_slurm.crash_node(lab, "node2")
    try:
        def ended() -> bool:
            return clusterctl_json("status", run_id, env=env)[1]["state"] not in ("queued", "running")
        wait_until(ended, 90, "Slurm's verdict on the crashed node", step=2.0)
        rc, st = clusterctl_json("status", run_id, env=env)
        assert rc == 1 and st["state"] == "failed" and st["target"]["state"] == "NODE_FAIL", st
        assert "node2" in st["failure"]["node"] + st["failure"]["reason"]
    finally:
        lab_slurm.restart_slurmd(lab, "node2")


def test_with_requeue_a_crashed_node_requeues_the_job_and_status_names_the_node(slab) -> None:
    from cluster.lab import slurm as lab_slurm

    state, d, env = slab
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "--on", "slurm", "--detach", "--set", "epochs=50",
                              "--set", "threads=1", "--set", "requeue=true", env=env, timeout=300)
    assert rc == 0
    run_id = rec["run_id"]
    wait_until(lambda: clusterctl_json("status", run_id, env=env)[1]["target"]["state"] == "RUNNING", 120,
               "the job running", step=1.0)
    wait_until(lambda: len(clusterctl_json("status", run_id, env=env)[1]["nodes"]) == 2, 60, "both tasks", step=1.0)
    lab = lifecycle.load_state(state.name, Path(state.dir))
    assert lab is not None
    lab_slurm.crash_node(lab, "node2")
    try:
        def requeued() -> bool:
            return bool(clusterctl_json("status", run_id, env=env)[1]["target"].get("requeued"))
        wait_until(requeued, 90, "Slurm requeuing the job", step=2.0)
        rc, st = clusterctl_json("status", run_id, env=env)
        assert rc == 0 and st["state"] == "queued" and st["target"]["state"] == "PENDING", st["target"]
        assert st["target"]["requeued"]["lost"] == ["node2"], st["target"]
    finally:
        lab_slurm.restart_slurmd(lab, "node2")
        rc, stopped = clusterctl_json("stop", run_id, env=env, timeout=180)
    assert rc == 0 and stopped["state"] == "stopped"


@pytest.mark.parametrize("methods", ["password", "publickey,keyboard-interactive"])
def test_a_login_node_that_wants_a_password_or_a_code_is_refused_with_the_fix(slab, methods: str) -> None:
    """A second sshd in the login node's namespace (port 2200, its own host key seen as the login node's) that
    asks for a password, or for a one-time code after the key (MFA): refused, nothing asked, nothing submitted."""
    state, d, env = slab
    assert state.slurm is not None
    login = state.slurm.login
    lab = Path(state.dir)
    cfg = d / f"sshd-{methods.replace(',', '-')}"
    text = sshd.SSHD_CONFIG.format(authorized_keys=lab / "authorized_keys").replace("Port 22", "Port 2200")
    text = text.replace("PasswordAuthentication no", "PasswordAuthentication yes").replace(
        "KbdInteractiveAuthentication no", "KbdInteractiveAuthentication yes")
    cfg.write_text(text + f"AuthenticationMethods {methods}\n")
    pid = d / f"{cfg.name}.pid"
    subprocess.run(["ip", "netns", "exec", login.netns, sshd.SSHD, "-f", str(cfg), "-h",
                    str(Path(login.dir) / "hostkey"), "-o", f"PidFile={pid}", "-o", f"ListenAddress={login.address}",
                    "-E", str(d / f"{cfg.name}.log")], check=True, timeout=30)
    try:
        wait_until(pid.exists, 10, "the second sshd")
        inv = d / f"inv-{cfg.name}.yaml"
        inv.write_text(Path(state.inventory).read_text().replace(
            f"login:\n      address: {login.address}",
            f"login:\n      address: {login.address}\n      port: 2200\n      host_key_alias: {login.address}"))
        assert "port: 2200" in inv.read_text()
        r = clusterctl("launch", "resnet50-ddp", "-i", str(inv), "--on", "slurm", *TINY, env=env, timeout=120)
        assert r.returncode == 3, r.stderr
        if methods == "password":
            assert "asks for password (a password or a one-time code" in r.stderr and "key alone" in r.stderr
        else:  # paramiko says only "Authentication failed": the fix names the second factor
            assert "refused our key" in r.stderr and "one-time code after the key" in r.stderr
        assert "submitted" not in r.stderr
    finally:
        if pid.exists():
            subprocess.run(["kill", pid.read_text().strip()], timeout=10)


def test_a_lost_sbatch_answer_leaves_a_record_that_finds_its_job_by_name(slab, monkeypatch: pytest.MonkeyPatch) -> None:
    """The link drops after sbatch queued the job but before its answer came: the record (saved before sbatch)
    finds the job by its name, the run id; `status` then follows it to Slurm's verdict."""
    from cluster.errors import TransportError
    from cluster.inventory import loader
    from cluster.runs import jobs, records
    from cluster.slurm import run, submit
    from cluster.transport.ssh import SSHTransport

    state, d, env = slab
    monkeypatch.setenv("CLUSTERCTL_HOME", env["CLUSTERCTL_HOME"])
    request = submit.prepare(loader.load(state.inventory), jobs.load("resnet50-ddp", [
        "epochs=1", "threads=1", "max_steps=3", "log_every=1"]), "slurm")
    real = SSHTransport.run

    def lossy(self: SSHTransport, command: str, timeout: float | None = None, stdin: bytes | None = None) -> object:
        res = real(self, command, timeout, stdin)
        if "sbatch --parsable" in command:
            raise TransportError("the link dropped before sbatch's answer", "try again", "timeout")
        return res

    with monkeypatch.context() as m:
        m.setattr(SSHTransport, "run", lossy)
        with pytest.raises(TransportError):
            run.submit(request)
    rec = records.load(request.run_id)
    assert rec.state == "starting" and rec.target["job_id"] is None and "lost" in rec.target["note"]

    def done() -> bool:
        return clusterctl_json("status", request.run_id, env=env)[1]["state"] not in ("starting", "queued", "running")
    wait_until(done, 300, "the adopted job's verdict", step=2.0)
    rc, st = clusterctl_json("status", request.run_id, env=env)
    assert rc == 0 and st["state"] == "succeeded" and st["target"]["job_id"], st
