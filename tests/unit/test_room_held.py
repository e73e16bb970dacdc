"""Once a room is Slurm's (`provision --slurm` left its note on the head), clusterctl's own SSH paths leave its
PCs to Slurm: launch without --on, study, bench, wake, poweroff (and launch's --wake, --poweroff-after) are
refused before any PC is contacted, naming the PCs, the room and the fix; `--outside-slurm` is the admin's way
past, said on stderr. provision drains them on the room's controller (the commands, as root or through sudo)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.inventory import loader
from cluster.inventory.model import Host, RoomCluster
from cluster.room import drain, held
from tests.conftest import ROOT, write
from tests.unit.test_cli import closed_port


def _room(tmp_path: Path, note: bool = True, local: bool = False) -> tuple[Path, dict[str, str]]:
    """An inventory whose room holds a and b (c is its controller), with the note provision --slurm writes.
    Its PCs are SSH hosts on a closed loopback port: were a refusal missing, `poweroff` would reach nothing
    (never this machine); `local` PCs only for provision --dry-run, which changes nothing."""
    home = tmp_path / "home"
    tmp_path.mkdir(parents=True, exist_ok=True)
    reach = "connection: local" if local else f"port: {closed_port()}, connect_timeout: 3"
    inv = write(tmp_path, f"""\
defaults: {{{reach}, known_hosts: {tmp_path / 'known_hosts'}}}
groups:
  lab: {{hosts: [a, b]}}
hosts:
  a: {{address: 127.0.0.1, workdir: {tmp_path / 'a'}}}
  b: {{address: 127.0.0.1, workdir: {tmp_path / 'b'}}}
  c: {{address: 127.0.0.1, workdir: {tmp_path / 'c'}}}
slurm:
  room:
    controller: c
    nodes: lab
""")
    env = {**os.environ, "CLUSTERCTL_HOME": str(home)}
    if note:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CLUSTERCTL_HOME", str(home))
            folder = held.folder(loader.load(inv, check_files=False), "room")
        folder.mkdir(parents=True)
        (folder / held.SET_UP).write_text(json.dumps({"nodes": ["a", "b"]}))
    return inv, env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)


def refused(r: subprocess.CompletedProcess[str], *words: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    for w in ("a, b are Slurm's: room room holds them", "--outside-slurm", *words):
        assert w in r.stderr, (w, r.stderr)


@pytest.mark.parametrize("extra", [["--dry-run"], [], ["--wake"], ["--poweroff-after"], ["--limit", "b"]],
                         ids=["dry-run", "plain", "wake", "poweroff-after", "limit"])
def test_launch_without_on_is_refused_on_the_rooms_pcs(tmp_path: Path, extra: list[str]) -> None:
    inv, env = _room(tmp_path)
    r = run(env, "launch", "resnet50-ddp", "-i", str(inv), *extra)
    if extra == ["--wake"]:  # it would wake them first: refused there, as `wake` is
        refused(r, "the room's Slurm powers them", "leave the power of them to room room's Slurm")
        return
    if extra == ["--limit", "b"]:
        assert r.returncode == 2 and "b is Slurm's: room room holds it" in r.stderr, r.stderr
        return
    refused(r, "clusterctl's own SSH launch leaves them to Slurm", "clusterctl launch resnet50-ddp --on room")


def test_a_pc_outside_the_room_and_a_room_undone_are_not_refused(tmp_path: Path) -> None:
    inv, env = _room(tmp_path)
    r = run(env, "launch", "resnet50-ddp", "-i", str(inv), "--limit", "c", "--dry-run")
    assert r.returncode == 3 and "cannot reach c" in r.stderr and "Slurm's" not in r.stderr, r.stderr
    inv, env = _room(tmp_path / "undone", note=False)  # no note: provision --slurm --undo removed it
    r = run(env, "launch", "resnet50-ddp", "-i", str(inv), "--dry-run")
    assert r.returncode == 3 and "cannot reach" in r.stderr and "Slurm's" not in r.stderr, r.stderr


def test_outside_slurm_goes_on_and_says_it_runs_beside_slurms_jobs(tmp_path: Path) -> None:
    inv, env = _room(tmp_path)
    for args in (("launch", "resnet50-ddp", "-i", str(inv), "--dry-run"), ("bench", "-i", str(inv), "--jobs",
                                                                           "resnet50-ddp")):
        r = run(env, *args, "--outside-slurm")
        # past the refusal: the PCs are contacted (and do not answer)
        assert r.returncode == 3 and "cannot reach a" in r.stderr, r.stderr
        assert "a, b are Slurm's: room room holds them (provision --slurm); --outside-slurm: this runs beside " \
               "Slurm's jobs there" in " ".join(r.stderr.split()), r.stderr


@pytest.mark.parametrize("cmd", ["study", "bench", "wake", "poweroff"])
def test_study_bench_wake_and_poweroff_are_refused(tmp_path: Path, cmd: str) -> None:
    inv, env = _room(tmp_path)
    args = {"study": ["study", "resnet50-ddp", "-i", str(inv), "--nodes", "2"],
            "bench": ["bench", "-i", str(inv), "--jobs", "resnet50-ddp"]}.get(cmd, [cmd, str(inv), "--limit", "a:b"])
    r = run(env, *args)
    words = {"study": ("clusterctl launch resnet50-ddp --on room",),
             "bench": ("bench runs training on them outside its queue", "clusterctl launch JOB --on room")}
    refused(r, *words.get(cmd, ("the room's Slurm powers them", "leave the power of them to room room's Slurm")))


def test_outside_slurm_is_in_each_commands_help(tmp_path: Path) -> None:
    for cmd in ("launch", "study", "bench", "wake", "poweroff"):
        r = run(dict(os.environ), cmd, "--help")
        assert "run on PCs the room's Slurm holds, beside its jobs (admin)" in " ".join(r.stdout.split()), cmd


def test_provision_dry_run_says_it_would_drain_and_contacts_no_controller(tmp_path: Path) -> None:
    inv, env = _room(tmp_path, local=True)
    r = run(env, "provision", str(inv), "--limit", "a", "--dry-run", "--drain-timeout", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "would drain a in room room's Slurm, wait for its jobs there to end, provision, then resume them" in \
        " ".join(r.stderr.split()), r.stderr
    assert "room room: a would be drained in its Slurm first, then resumed" in " ".join(r.stdout.split())
    assert "scontrol" not in r.stdout + r.stderr


@pytest.mark.parametrize("user, become, sudo", [("root", False, ""), ("admin", True, "sudo -n "),
                                                ("root", True, "")])
def test_the_drain_commands_as_root_or_through_sudo(user: str, become: bool, sudo: str) -> None:
    room = RoomCluster("room", Host(name="teacher", address="10.0.0.2", user=user, become=become), ("pc1", "pc2"))
    pcs = ["pc1", "pc2"]
    assert drain.drain_command(room, pcs) == \
        f"{sudo}scontrol update NodeName=pc1,pc2 State=DRAIN Reason=clusterctl_provision"
    assert drain.resume_command(room, pcs) == f"{sudo}scontrol update NodeName=pc1,pc2 State=RESUME"
    assert drain.jobs_command(pcs) == "squeue -h -w pc1,pc2 -o '%i|%u|%j|%N'"


def test_the_jobs_squeue_lists_are_said_by_id_name_user_and_pcs() -> None:
    out = "12|student|resnet50-ddp|pc1,pc2\n13|admin|hand sbatch|pc2\n\n"
    assert drain.parse_jobs(out) == [("12", "job 12 (resnet50-ddp of student, on pc1,pc2)"),
                                     ("13", "job 13 (hand sbatch of admin, on pc2)")]
    assert drain.parse_jobs("") == []


def test_provision_slurm_on_unreachable_pcs_exits_3_naming_each(tmp_path: Path) -> None:
    inv, env = _room(tmp_path, note=False)
    r = run(env, "provision", "--slurm", str(inv))
    assert r.returncode == 3, r.stdout + r.stderr
    assert all(f"{pc}: " in r.stderr for pc in ("a", "b", "c")) and "cannot read the facts of" in r.stderr, r.stderr
    assert not list((tmp_path / "home").glob("rooms/*/room/munge.key"))  # nothing made before the facts
