"""The room as a Slurm cluster, as a new user sets it up: `lab up 3 --gateway --user student` (no --slurm),
then `provision --slurm` on the inventory the lab wrote: Debian's munge and Slurm, started by the PCs' own
systemctl inside each PC, every PC idle in sinfo with the CPUs and memory its facts give, srun answering from
each; a rerun changes nothing; a hand-written sbatch script with srun runs on every node; --undo leaves no
daemon and no file it wrote. This machine's own /etc/munge and /etc/slurm are never touched."""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pwd
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from cluster.lab import lifecycle
from cluster.runs.records import ACTIVE
from tests.integration.conftest import accounts, clusterctl, clusterctl_json, lab_up, procs_of, wait_until, why

DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
STUDENTS = ("rmalice", "rmbob")  # accounts this machine gets for the module (lab up --users), removed after
TINY = ["--set", "epochs=1", "--set", "threads=1", "--set", "max_steps=3", "--set", "log_every=1"]


def _host_files() -> dict[str, str]:
    """This machine's own munge key and Slurm config: their digests (absent: '-')."""
    out = {}
    for p in (Path("/etc/munge/munge.key"), *sorted(Path("/etc/slurm").glob("*"))):
        out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "-"
    return out


def _daemons_in(netns: str) -> list[str]:
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm in DAEMONS:
            found.append(comm)
    return found


def _host_daemons() -> set[int]:
    """munged/slurm processes outside every network namespace of a lab (this machine's own)."""
    mine = Path("/proc/self/ns/net").resolve()
    found = set()
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "comm").read_text().strip() in DAEMONS and (p / "ns/net").resolve() == mine:
                found.add(int(p.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def room(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[lifecycle.LabState, dict[str, str]]]:
    before = (_host_files(), _host_daemons())
    with accounts(*STUDENTS), lab_up(tmp_path_factory, "rm", 3, 27, gateway=True, user="student",
                                     users=list(STUDENTS)) as (state, d):
        env = {"CLUSTERCTL_HOME": str(d / "home")}
        # as a new user does: the training environment first (this interpreter, python_env: existing), then Slurm
        rc, res = clusterctl_json("provision", state.inventory, "--set", f"python={sys.executable}",
                                  "--set", "vars.python_env=existing", env=env, timeout=600)
        assert rc == 0, json.dumps(res)[-2000:]
        yield state, env
    assert (_host_files(), _host_daemons()) == before  # the machine's own munge and Slurm, untouched


def ssh(state: lifecycle.LabState, address: str, command: str, timeout: float = 60,
        user: str = "root") -> subprocess.CompletedProcess[str]:
    """A command on a lab PC as the admin would type it: OpenSSH with the lab's key and known_hosts; a node
    through the gateway (ProxyJump), as the lab's inventory says."""
    d = Path(state.dir)
    opts = ["-i", str(d / "id_ed25519"), "-o", f"UserKnownHostsFile={d / 'known_hosts'}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"]
    via = shlex.join(["ssh", *opts, "-W", "%h:%p", f"root@{state.jump.address}"])  # -o options reach the jump too
    jump = [] if address == state.jump.address else ["-o", f"ProxyCommand={via}"]
    return subprocess.run(["ssh", *opts, *jump, f"{user}@{address}", command], capture_output=True, text=True,
                          timeout=timeout)


def test_provision_slurm_makes_the_room_a_cluster_and_a_rerun_changes_nothing(room: Any) -> None:
    state, env = room
    rc, res = clusterctl_json("provision", state.inventory, "--slurm", env=env, timeout=300)
    assert rc == 0, json.dumps(res, indent=1)[-3000:]
    assert res["changed"] and sorted(r["node"] for r in res["sinfo"]) == ["node1", "node2", "node3"]
    facts = {n["host"]: n["facts"] for n in clusterctl_json("check", state.inventory, env=env)[1]["nodes"]}
    for row in res["sinfo"]:  # Slurm's own view of each PC, against what `check` reads there
        f = facts[row["node"]]
        assert row["state"] == "idle" and row["cpus"] == f["cpu"]["logical"], (row, f["cpu"])
        assert 0 < row["memory_mb"] < f["memory"]["total_mib"], (row, f["memory"])
    assert res["srun"] == ["node1", "node2", "node3"]
    key_on_head = Path(env["CLUSTERCTL_HOME"]).glob("rooms/*/room/munge.key")
    assert [oct(p.stat().st_mode & 0o777) for p in key_on_head] == ["0o400"]
    again = clusterctl("provision", state.inventory, "--slurm", env=env, timeout=300)
    assert again.returncode == 0 and "nothing changed" in again.stdout, again.stdout + again.stderr
    rc, res = clusterctl_json("provision", state.inventory, "--slurm", env=env, timeout=300)
    assert rc == 0 and res["changed"] is False and res["actions"] == []


def test_a_pc_removed_from_the_room_is_drained_and_forgotten_and_comes_back_when_added(room: Any) -> None:
    state, env = room
    text = Path(state.inventory).read_text()
    smaller = Path(state.inventory).with_name("two.yaml")
    smaller.write_text(text.replace("nodes: lab", "nodes: node1:node2"))
    rc, res = clusterctl_json("provision", str(smaller), "--slurm", env=env, timeout=300)
    assert rc == 0, json.dumps(res, indent=1)[-3000:]
    assert [r["node"] for r in res["sinfo"]] == ["node1", "node2"] and res["srun"] == ["node1", "node2"]
    assert any("node3 left the room" in n for n in res["notes"]), res["notes"]
    done = {pc: " ".join(w) for pc, w in res["done"].items()}
    assert "restart slurmctld" in done["controller"] and "restart slurmd" in done["node1"], done
    # the same PC back in the inventory: configured again, every daemon restarted, idle
    rc, res = clusterctl_json("provision", state.inventory, "--slurm", env=env, timeout=300)
    assert rc == 0 and [r["node"] for r in res["sinfo"]] == ["node1", "node2", "node3"], json.dumps(res)[-3000:]
    assert all(r["state"] == "idle" for r in res["sinfo"])


def test_a_hand_written_sbatch_script_runs_on_every_node(room: Any) -> None:
    state, _ = room
    gw = state.jump.address
    # its output in the first node's own folder (each PC's /srv/cluster is its own disk)
    script = "#!/bin/sh\n#SBATCH -N3\n#SBATCH -o /srv/cluster/hand-%j.out\nsrun hostname\n"
    r = ssh(state, gw, f"cd /tmp && printf %s {shlex.quote(script)} > hand.sbatch && sbatch --parsable hand.sbatch")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    wait_until(lambda: ssh(state, gw, f"squeue -h -j {job}").stdout.strip() == "", 60, f"job {job} done", step=0.5)
    # the batch step ran on the first node: its output is in that PC's /tmp, read over SSH there
    first = state.nodes[0].address
    out = ssh(state, first, f"cat /srv/cluster/hand-{job}.out", user=state.user)
    assert sorted(out.stdout.split()) == ["node1", "node2", "node3"], out.stdout + out.stderr


def _waiters(run_id: str) -> list[int]:
    """The head's waiter processes of a run (python -m cluster.schedulers.roomwait RUN_ID)."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and f"cluster.schedulers.roomwait\0{run_id}".encode() in (p / "cmdline").read_bytes():
                found.append(int(p.name))
        except OSError:
            continue
    return found


def test_a_killed_waiter_is_replaced_and_queued_runs_stop_or_start_when_the_room_frees(room: Any) -> None:
    state, env = room
    inv = ["-i", state.inventory, "--on", "room", "--detach"]
    long = ["--set", "epochs=10000", "--set", "threads=1", "--set", "max_steps=1000000", "--set", "log_every=1"]
    rc, holder = clusterctl_json("launch", "resnet50-ddp", *inv, "--nodes", "3", *long, env=env, timeout=300)
    assert rc == 0, holder
    wait_until(lambda: clusterctl_json("status", holder["run_id"], env=env)[1]["state"] == "running", 120,
               "the first run holds the whole room")
    runs = [clusterctl_json("launch", "resnet50-ddp", *inv, "--nodes", "1", *TINY, env=env, timeout=300)[1]
            for _ in range(2)]
    waiting, dropped = runs
    # a queued run stopped: its Slurm job is cancelled, it never runs
    r = clusterctl("stop", dropped["run_id"], env=env)
    assert r.returncode == 0 and clusterctl_json("status", dropped["run_id"], env=env)[1]["state"] == "stopped"
    gw = state.jump.address
    assert dropped["target"]["job_id"] not in ssh(state, gw, "squeue -h -o %i").stdout.split()
    # the waiter of the other one killed (the head's process list): the next look at the run starts a new one
    wait_until(lambda: _waiters(waiting["run_id"]), 30, "the waiter runs")
    for pid in _waiters(waiting["run_id"]):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not _waiters(waiting["run_id"]), 10, "the waiter is gone")
    seen = clusterctl_json("status", waiting["run_id"], env=env)[1]
    assert seen["state"] == "queued", json.dumps(seen)[-1500:]
    wait_until(lambda: _waiters(waiting["run_id"]), 30, "a new waiter")
    # the first run stopped: its PCs go back to Slurm, which gives one to the waiting run; it runs and succeeds
    assert clusterctl("stop", holder["run_id"], env=env).returncode == 0
    wait_until(lambda: clusterctl_json("status", waiting["run_id"], env=env)[1]["state"] not in ACTIVE, 300,
               "the waiting run ended", step=2)
    rec = clusterctl_json("status", waiting["run_id"], env=env)[1]
    assert rec["state"] == "succeeded" and len(rec["nodes"]) == 1, json.dumps(rec)[-2000:]
    wait_until(lambda: ssh(state, gw, "squeue -h").stdout.strip() == "", 60, "the room's queue empty", step=1)


def _student(state: lifecycle.LabState, user: str) -> str:
    return f"{state.users[user]}/inventory.yaml"  # lab up --users wrote it in their home, theirs alone


def test_two_students_launch_at_once_each_sees_collects_and_reports_their_own(room: Any) -> None:
    state, _ = room
    alice, bob = STUDENTS
    here = ["--host-set", f"python={sys.executable}"]  # the environment the admin provisioned (python_env: existing)
    for u in STUDENTS:  # each one's own workdir on every PC, checked against that environment: nothing installed
        rc, res = clusterctl_json("provision", _student(state, u), "--set", f"python={sys.executable}", user=u,
                                  timeout=600)
        assert rc == 0, json.dumps(res)[-2000:]
    # a student's head has no note of the admin's set-up: the room's Slurm, asked, says the PCs are its own
    r = clusterctl("launch", "resnet50-ddp", "-i", _student(state, alice), *here, *TINY, user=alice)
    said = " ".join(r.stderr.split())
    assert r.returncode == 2 and "node1, node2, node3 are Slurm's: room room holds them" in said, r.stdout + said
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # within a second of each other, each as themselves
        launched = list(pool.map(lambda u: clusterctl_json(
            "launch", "resnet50-ddp", "-i", _student(state, u), "--on", "room", "--nodes", "2", "--detach", *here,
            *TINY, user=u, timeout=300), STUDENTS))
    assert [rc for rc, _ in launched] == [0, 0], launched
    runs = {u: rec for u, (_, rec) in zip(STUDENTS, launched)}
    # bob's stop of alice's run: Slurm's refusal, said as Slurm said it (exit 1); her run goes on
    # (first: the runs are tiny, a few seconds)
    r = clusterctl("stop", runs[alice]["run_id"], "-i", _student(state, bob), user=bob)
    said = " ".join(r.stderr.split())
    assert r.returncode == 1 and f"user {alice}" in said and "Access/permission denied" in said, r.stdout + said
    assert clusterctl_json("status", runs[alice]["run_id"], user=alice)[1]["state"] in ACTIVE
    # each one's `runs` lists only their own run; `runs --all` every user's job in the room, one on its PCs
    for u in STUDENTS:
        rc, mine = clusterctl_json("runs", user=u)
        assert rc == 0 and [r["run_id"] for r in mine] == [runs[u]["run_id"]], mine
    rc, seen = clusterctl_json("runs", "--all", "-i", _student(state, alice), user=alice)
    jobs = {j["name"]: j for j in seen["rooms"]["room"]["jobs"]}
    assert rc == 0 and {jobs[runs[u]["run_id"]]["user"] for u in STUDENTS} == set(STUDENTS), seen
    states = sorted(jobs[runs[u]["run_id"]]["state"] for u in STUDENTS)
    assert states == ["PENDING", "RUNNING"], seen  # 2 of the 3 PCs each: one waits in Slurm's queue
    running = next(j for j in jobs.values() if j["state"] == "RUNNING")
    assert running["pcs"].startswith("node"), running
    for u in STUDENTS:
        rid = runs[u]["run_id"]
        wait_until(lambda u=u, rid=rid: clusterctl_json("status", rid, user=u)[1]["state"] not in ACTIVE, 400,
                   f"{u}'s run ended", step=2)
        rec = clusterctl_json("status", rid, user=u)[1]
        assert rec["state"] == "succeeded" and len(rec["nodes"]) == 2, why(rec)
        rc, got = clusterctl_json("collect", rid, user=u, timeout=300)
        assert rc == 0, json.dumps(got)[-2000:]
        r = clusterctl("report", rid, user=u, timeout=300)
        assert r.returncode == 0 and Path(pwd.getpwnam(u).pw_dir, ".clusterctl", "runs", rid).is_dir(), r.stderr
    # the Slurm jobs ended once the runs did: the room is free again
    gw = state.jump.address
    wait_until(lambda: ssh(state, gw, "squeue -h").stdout.strip() == "", 60, "the room's queue empty", step=1)


def test_the_rooms_pcs_are_slurms_and_provision_drains_them_then_resumes_them(room: Any) -> None:
    state, env = room
    r = clusterctl("launch", "resnet50-ddp", "-i", state.inventory, *TINY, env=env)
    said = " ".join(r.stderr.split())
    assert r.returncode == 2 and "node1, node2, node3 are Slurm's: room room holds them" in said, r.stdout + r.stderr
    assert "clusterctl launch resnet50-ddp --on room" in said and "--outside-slurm" in said, said
    for args in (["wake", state.inventory], ["poweroff", state.inventory],
                 ["bench", "-i", state.inventory, "--jobs", "resnet50-ddp"]):
        r = clusterctl(*args, env=env)
        said = " ".join(r.stderr.split())
        assert r.returncode == 2 and "Slurm's: room room holds them" in said and "--outside-slurm" in said, (args, said)
    # a job of Slurm's on node1 while provision starts: drained, provision waits for it, then resumes every PC
    gw = state.jump.address
    sub = ssh(state, gw, "sbatch --parsable -N1 -w node1 -o /dev/null --wrap 'sleep 15'")
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    wait_until(lambda: ssh(state, gw, f"squeue -h -t R -j {job}").stdout.strip() != "", 60, f"job {job} running")
    r = clusterctl("provision", state.inventory, "--set", f"python={sys.executable}",
                   "--set", "vars.python_env=existing", env=env, timeout=600)
    said = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 0, said[-3000:]
    assert "drained node1, node2, node3 in room room's Slurm" in said, said[-3000:]
    assert f"for Slurm's jobs on them to end: job {job} (wrap of root, on node1)" in said, said[-3000:]
    assert "resumed node1, node2, node3 in room room's Slurm" in said, said[-3000:]
    assert ssh(state, gw, f"squeue -h -j {job}").stdout.strip() == ""  # it ran to its end, never cancelled
    # every node idle again (a loaded machine may show one not responding, `idle*`, until slurmctld's next ping)
    wait_until(lambda: sorted(n.split() for n in ssh(state, gw, "sinfo -h -N -o '%N %t'").stdout.splitlines()
                              if n.strip()) == [["node1", "idle"], ["node2", "idle"], ["node3", "idle"]],
               120, "every node idle after the provision", step=2)


def test_a_run_whose_slurm_job_ends_is_stopped(room: Any) -> None:
    """An admin's scancel (as Slurm's time limit would): the PCs are Slurm's again, the run must not go on."""
    state, env = room
    long = ["--set", "epochs=10000", "--set", "threads=1", "--set", "max_steps=1000000", "--set", "log_every=1"]
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "-i", state.inventory, "--on", "room", "--nodes", "1",
                              "--time", "30", "--detach", *long, env=env, timeout=300)
    assert rc == 0, rec
    wait_until(lambda: clusterctl_json("status", rec["run_id"], env=env)[1]["state"] == "running", 120, "running")
    assert ssh(state, state.jump.address, f"scancel {rec['target']['job_id']}").returncode == 0
    wait_until(lambda: clusterctl_json("status", rec["run_id"], env=env)[1]["state"] not in ACTIVE, 120,
               "the run ended with its job", step=2)
    done = clusterctl_json("status", rec["run_id"], env=env)[1]
    assert done["state"] == "stopped" and "CANCELLED" in done["failure"]["reason"], json.dumps(done)[-2000:]
    assert not procs_of(rec["run_id"], done["nodes"][0]["node"])  # nothing of it left on the PC Slurm took back


def test_ids_that_differ_on_one_pc_are_found_by_check_and_refused_by_provision_slurm(room: Any) -> None:
    state, env = room
    passwd = Path(state.nodes[1].dir) / "passwd"  # node2's own /etc/passwd (mounted over the machine's there)
    before = passwd.read_text()
    entry = next(line for line in before.splitlines() if line.startswith(f"{state.user}:"))
    fields = entry.split(":")
    uid, gid = int(fields[2]), int(fields[3])
    try:  # its primary group's number (its uid would lock sshd's StrictModes out of its home)
        passwd.write_text(before.replace(entry, ":".join([*fields[:3], str(gid + 7), *fields[4:]])))
        rc, res = clusterctl_json("check", state.inventory, env=env)
        found = [p for p in res["problems"] if p["code"] == "account-ids"]
        assert [p["host"] for p in found] == ["node2"], json.dumps(res["problems"])[-2000:]
        assert f"user {state.user} is uid {uid}, gid {gid + 7} here but {uid}, {gid}" in found[0]["message"]
        assert "usermod" in found[0]["fix"]
        r = clusterctl("provision", state.inventory, "--slurm", env=env, timeout=300)
        assert r.returncode == 1 and "node2" in r.stderr and f"user {state.user} is uid" in r.stderr, r.stderr
    finally:
        passwd.write_text(before)
    # a student's uid on node2 (their home there theirs under that number, so that they still log in), found by
    # their own check against this machine's account
    bob = STUDENTS[1]
    pw = pwd.getpwnam(bob)
    entry = next(line for line in before.splitlines() if line.startswith(f"{bob}:"))
    home = Path(state.nodes[1].dir) / "users" / bob
    try:
        passwd.write_text(before.replace(entry, entry.replace(f":{pw.pw_uid}:", f":{pw.pw_uid + 7}:", 1)))
        subprocess.run(["chown", "-R", str(pw.pw_uid + 7), str(home)], check=True)
        rc, res = clusterctl_json("check", _student(state, bob), user=bob)
        found = [p for p in res["problems"] if p["code"] == "account-ids"]
        assert [p["host"] for p in found] == ["node2"], json.dumps(res["problems"])[-2000:]
        assert f"user {bob} is uid {pw.pw_uid + 7}, gid {pw.pw_gid} here but {pw.pw_uid}, {pw.pw_gid} on the " \
               "head" in found[0]["message"] and f"usermod -u {pw.pw_uid} {bob}" in found[0]["fix"], found
        # and the admin's provision --slurm, whose login user is another, refuses the room for it
        r = clusterctl("provision", state.inventory, "--slurm", env=env, timeout=300)
        assert r.returncode == 1 and f"user {bob} is uid {pw.pw_uid + 7}" in " ".join(r.stderr.split()), r.stderr
    finally:
        passwd.write_text(before)
        subprocess.run(["chown", "-R", str(pw.pw_uid), str(home)], check=True)


FIREWALL = ["add table inet t", "add chain inet t input { type filter hook input priority 0; policy drop; }",
            "add rule inet t input iif lo accept", "add rule inet t input ct state established,related accept",
            "add rule inet t input tcp dport 22 accept"]  # a PC that lets in SSH and nothing else


def _nft(netns: str, command: str) -> str:
    """nft inside a lab PC's own network namespace (never this machine's firewall)."""
    return subprocess.run(["ip", "netns", "exec", netns, "nft", *shlex.split(command)], capture_output=True,
                          text=True, check=True).stdout


def test_a_firewall_that_lets_in_only_ssh_gets_exactly_slurms_ports_opened(room: Any) -> None:
    state, env = room
    pc = state.nodes[1]
    for command in FIREWALL:
        _nft(pc.netns, command)
    rc, res = clusterctl_json("provision", state.inventory, "--slurm", env=env, timeout=300)
    assert rc == 0, json.dumps(res, indent=1)[-3000:]
    assert [(a["pc"], a["phase"]) for a in res["actions"]] == [(pc.name, "firewall")], res["actions"]
    rules = _nft(pc.netns, "list chain inet t input")
    # from exactly the room's addresses: the controller's on the nodes' bridge, and the nodes'
    room_addresses = ", ".join([state.gateway, *(n.address for n in state.nodes)])
    assert f"ip saddr {{ {room_addresses} }} tcp dport {{ 6817-6818, 60001-63000 }} accept " \
           'comment "clusterctl room room"' in rules, rules
    assert res["srun"] == ["node1", "node2", "node3"]  # slurmd behind that firewall answers
    rc, res = clusterctl_json("provision", state.inventory, "--slurm", env=env, timeout=300)
    assert rc == 0 and res["actions"] == [], res["actions"]  # a rerun inserts no second rule


def test_undo_leaves_no_daemon_and_no_file_it_wrote(room: Any) -> None:
    state, env = room
    rc, res = clusterctl_json("provision", state.inventory, "--slurm", "--undo", env=env, timeout=300)
    assert rc == 0, json.dumps(res, indent=1)[-3000:]
    for pc in [*state.nodes, state.jump]:
        wait_until(lambda pc=pc: not _daemons_in(pc.netns), 20, f"no munge or Slurm daemon in {pc.name}")
        r = ssh(state, pc.address, "ls /etc/slurm /etc/munge")
        assert r.returncode == 0 and r.stdout.split() == ["/etc/munge:", "/etc/slurm:"], r.stdout
    assert not list(Path(env["CLUSTERCTL_HOME"]).glob("rooms/*/room/munge.key"))
    assert "clusterctl room" not in _nft(state.nodes[1].netns, "list ruleset")  # the rule it opened, removed
    again = clusterctl("provision", state.inventory, "--slurm", "--undo", env=env, timeout=300)
    assert again.returncode == 0 and "nothing changed" in again.stdout, again.stdout
