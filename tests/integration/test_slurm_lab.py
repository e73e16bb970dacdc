"""A real Slurm in the simulated lab (`lab up 2 --slurm --user student`): jobs submitted over SSH on the login
node to Debian's slurm-wlm, run by a slurmd in each node's namespaces, writing into the cluster's shared folder;
a crashed node fails its job as Slurm says (NODE_FAIL); `down` leaves no daemon and no namespace behind."""
from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from cluster.lab import lifecycle, slurm
from tests.integration.conftest import clusterctl_json, lab_up, pytestmark, wait_until  # noqa: F401

pytestmark = [pytestmark, pytest.mark.skipif(not Path("/usr/sbin/slurmctld").exists(),
                                             reason="slurm-wlm is not installed (scripts/setup.sh installs it)")]
WORKDIR = "/srv/slurm-shared/clusterctl"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


@pytest.fixture(scope="module")
def slab(tmp_path_factory: pytest.TempPathFactory):
    t0 = time.monotonic()
    with lab_up(tmp_path_factory, "s", 2, 17, slurm=True, user="student") as (state, d):
        print(f"lab up --slurm: {time.monotonic() - t0:.1f} s")
        yield state, {"CLUSTERCTL_HOME": str(d / "home")}


def on_login(state: lifecycle.LabState, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`command` in a shell on the login node, over real SSH with the lab's key, its host key checked."""
    assert state.slurm is not None
    d = Path(state.dir)
    return subprocess.run(["ssh", "-F", "/dev/null", "-i", str(d / "id_ed25519"), "-o", "IdentitiesOnly=yes",
                           "-o", f"UserKnownHostsFile={d / 'known_hosts'}", "-o", "StrictHostKeyChecking=yes",
                           "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                           f"{state.user}@{state.slurm.login.address}", command],
                          capture_output=True, text=True, timeout=timeout)


def login_ok(state: lifecycle.LabState, command: str, timeout: float = 60) -> str:
    r = on_login(state, command, timeout)
    assert r.returncode == 0, f"{command}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def sbatch(state: lifecycle.LabState, *args: str, script: str | None = None) -> str:
    """Submit from the job folder on the shared filesystem; the job id (`sbatch --parsable`)."""
    cmd = f"cd {WORKDIR} && sbatch --parsable {shlex.join(args)}"
    if script is not None:
        cmd += f" <<'CLUSTERCTL_EOF'\n{script}\nCLUSTERCTL_EOF"
    return login_ok(state, cmd).strip()


def job_state(state: lifecycle.LabState, job: str) -> str:
    """Slurm's state of `job`: squeue while slurmctld holds it (-t all: finished ones too), then sacct -c."""
    out = login_ok(state, f"squeue -h -t all -j {job} -o %T 2>/dev/null || true").split()
    if out:
        return out[0]
    out = login_ok(state, f"sacct -c -n -P -j {job} -o State").split()
    return out[-1] if out else "UNKNOWN"


def wait_final(state: lifecycle.LabState, job: str, timeout: float) -> str:
    seen: list[str] = []
    wait_until(lambda: seen.append(job_state(state, job)) or seen[-1] in FINAL, timeout,
               f"job {job} finished (last seen: {seen[-1:] or 'nothing'})", step=0.3)
    return seen[-1]


def test_every_compute_node_is_idle_and_the_inventory_declares_the_cluster(slab) -> None:
    state, _ = slab
    assert state.slurm is not None
    out = login_ok(state, "hostname; sinfo -h -N -o '%N %P %T %c'")
    assert out.splitlines() == ["login", "node1 debug* idle 2", "node2 debug* idle 2"]
    doc = yaml.safe_load(Path(state.inventory).read_text())
    assert doc["slurm"] == {"slurm": {"login": {"address": state.slurm.login.address}, "partition": "debug",
                                      "workdir": WORKDIR, "python": state.slurm.python}}
    keys = (Path(state.dir) / "known_hosts").read_text()
    assert f"{state.slurm.login.address} ssh-ed25519 " in keys
    # not a compute node, and no slurmd outside the compute nodes
    assert "login" not in slurm.node_states(state)
    rc, st = clusterctl_json("lab", "status", "--name", state.name, "--dir", state.dir)
    assert rc == 0, st
    assert st["slurm"]["munged"] and st["slurm"]["slurmctld"]
    assert [(n["name"], n["slurmd"], n["state"]) for n in st["slurm"]["nodes"]] == [
        ("node1", True, "idle"), ("node2", True, "idle")]


def test_a_two_node_job_and_a_two_task_python_job_complete_and_write_to_the_shared_folder(slab) -> None:
    state, _ = slab
    assert state.slurm is not None
    hosts = sbatch(state, "-N2", "-o", "hosts-%j.out", script="#!/bin/sh\nsrun -K hostname | sort")
    py = sbatch(state, "-N2", "-n2", "-o", "py-%j.out", script=(
        "#!/bin/sh\n"
        f"srun -K {state.slurm.python} -c 'import os, socket\n"
        f"open(\"{WORKDIR}/rank-%s.txt\" % os.environ[\"SLURM_PROCID\"], \"w\").write(socket.gethostname())'"))
    t0 = time.monotonic()
    assert wait_final(state, hosts, 30) == "COMPLETED"
    assert wait_final(state, py, 30) == "COMPLETED"
    print(f"two jobs COMPLETED in {time.monotonic() - t0:.1f} s")
    shared = Path(state.slurm.shared) / "clusterctl"
    assert (shared / f"hosts-{hosts}.out").read_text().split() == ["node1", "node2"]
    assert {(shared / f"rank-{r}.txt").read_text() for r in (0, 1)} == {"node1", "node2"}  # one task per node
    line = login_ok(state, f"sacct -c -n -P -j {py} -o JobID,State,ExitCode,NodeList").strip()
    assert line == f"{py}|COMPLETED|0:0|node[1-2]"


def test_a_failing_job_and_a_cancelled_one_get_slurms_verdict(slab) -> None:
    state, _ = slab
    failed = sbatch(state, "--wrap", "exit 3")
    sleeper = sbatch(state, "--wrap", "sleep 120")
    wait_until(lambda: job_state(state, sleeper) == "RUNNING", 20, f"job {sleeper} running", step=0.2)
    login_ok(state, f"scancel {sleeper}")
    assert wait_final(state, failed, 30) == "FAILED"
    assert wait_final(state, sleeper, 30) == "CANCELLED"
    assert login_ok(state, f"sacct -c -n -P -j {failed} -o State,ExitCode").strip() == "FAILED|3:0"


def _in_netns(ns: str, comm: str) -> bool:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout.split()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                return True
        except OSError:
            pass
    return False


def test_a_crashed_node_fails_a_no_requeue_job_and_comes_back_with_its_slurmd(slab) -> None:
    state, _ = slab
    assert state.slurm is not None
    job = sbatch(state, "--no-requeue", "-N2", "-o", "crash-%j.out", script="#!/bin/sh\nsrun -K sleep 300")
    node2 = state.nodes[1]
    wait_until(lambda: _in_netns(node2.netns, "sleep"), 20, "the job's task running on node2", step=0.2)
    killed = slurm.crash_node(state, "node2")
    assert state.slurm.slurmd_pids["node2"] in killed
    assert not _in_netns(node2.netns, "slurmstepd") and not _in_netns(node2.netns, "sleep")
    assert _in_netns(node2.netns, "sshd")  # the PC is up; its Slurm is not
    t0 = time.monotonic()
    assert wait_final(state, job, 60) == "NODE_FAIL"
    print(f"NODE_FAIL {time.monotonic() - t0:.1f} s after the crash")
    assert slurm.node_states(state)["node2"].startswith("down")
    assert not _in_netns(state.nodes[0].netns, "sleep")  # Slurm ended the job's other task too
    slurm.restart_slurmd(state, "node2")
    wait_until(lambda: slurm.node_states(state) == {"node1": "idle", "node2": "idle"}, 30,
               "node2 back (ReturnToService=2)", step=0.2)


def test_down_stops_every_slurm_daemon_even_of_a_lab_whose_state_is_lost(slab) -> None:
    state, _ = slab
    assert state.slurm is not None
    ns_pids = {int(p) for n in [*state.nodes, state.slurm.login] for p in subprocess.run(
        ["ip", "netns", "pids", n.netns], capture_output=True, text=True, timeout=10).stdout.split()}
    ours = {state.slurm.munged_pid, state.slurm.slurmctld_pid, *state.slurm.slurmd_pids.values(), *ns_pids}
    (Path(state.dir) / "lab.json").unlink()  # a crashed run: only the lab's name is known
    t0 = time.monotonic()
    removed = lifecycle.down(state.name, Path(state.dir))
    print(f"down: {time.monotonic() - t0:.1f} s")
    assert any(r.startswith("slurm daemons") for r in removed), removed

    def left() -> list[str]:
        out = subprocess.run(["sh", "-c", "pgrep -a slurm; pgrep -a munge"], capture_output=True, text=True,
                             timeout=10).stdout
        return [ln for ln in out.splitlines() if int(ln.split()[0]) in ours or state.dir in ln]

    took = wait_until(lambda: not left(), 10, f"no slurm/munge process of the lab left: {left()}", step=0.1)
    print(f"no process left {took:.1f} s later")
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                            timeout=10).stdout.split() if ns.startswith(f"{state.name}-")]
    assert not Path(f"/run/clusterctl-lab/{state.name}").exists()
    assert not any(r.startswith("slurm") for r in lifecycle.down(state.name, Path(state.dir)))  # idempotent
    assert os.path.isdir(state.slurm.shared)  # the cluster's files stay with the lab's folder
