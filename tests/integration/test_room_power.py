"""Idle PCs switched off by the room's own Slurm (`suspend_after`), woken for the job that needs them, as a new
user sets it up: `lab up 3 --gateway --user student`, `provision`, `suspend_after` in the room's declaration,
`provision --slurm`. Slurm's power saving runs clusterctl's power program in the gateway PC (the controller): a
PC is switched off over SSH by a key that may only run its poweroff, and woken by a real magic packet that its
Wake-on-LAN listener catches (the PC then boots: sshd, munge, slurmd -b). One PC whose listener is dead is
marked down with the reason, and the job runs on the others; a collect afterwards wakes the run's PCs."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from cluster.lab import lifecycle
from cluster.runs.records import ACTIVE
from tests.integration.conftest import clusterctl, clusterctl_json, lab_up, wait_until, why
from tests.integration.test_room_slurm import TINY, ssh

SUSPEND_S = 5  # suspend_after here; by hand, a minute (docs/room.md)


@pytest.fixture(scope="module")
def room(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[lifecycle.LabState, dict[str, str]]]:
    with lab_up(tmp_path_factory, "pw", 3, 28, gateway=True, user="student") as (state, d):
        env = {"CLUSTERCTL_HOME": str(d / "home")}
        rc, res = clusterctl_json("provision", state.inventory, "--set", f"python={sys.executable}",
                                  "--set", "vars.python_env=existing", env=env, timeout=600)
        assert rc == 0, json.dumps(res)[-2000:]
        inv = Path(state.inventory)  # the admin's: idle PCs off after SUSPEND_S, 90 s to wake (a loaded machine)
        inv.write_text(inv.read_text().replace("    partition: room\n", f"    partition: room\n    suspend_after: "
                                               f"{SUSPEND_S}s\n    resume_timeout: 90\n"))
        rc, res = clusterctl_json("provision", state.inventory, "--slurm", env=env, timeout=300)
        assert rc == 0, json.dumps(res)[-3000:]
        yield state, env


def _lab(state: lifecycle.LabState) -> lifecycle.LabState:
    now = lifecycle.load_state(state.name, Path(state.dir))  # as the lab's power switch last wrote it
    assert now is not None
    return now


def _power(state: lifecycle.LabState) -> dict[str, str]:
    return {n.name: n.power for n in _lab(state).nodes}


def _sinfo(state: lifecycle.LabState) -> dict[str, str]:
    out = ssh(state, state.jump.address, "sinfo -h -N -o '%N|%T|%E'").stdout  # type: ignore[union-attr]
    return {line.split("|")[0]: line.split("|", 1)[1] for line in out.splitlines() if "|" in line}


def _pc_logs(state: lifecycle.LabState) -> str:
    """Each PC's sshd and power log, last lines: what a failed wake or login left."""
    return "".join(f"\n--- {p}\n" + p.read_text(errors="replace")[-3000:] for n in state.nodes
                   for p in (Path(n.dir) / "sshd.log", Path(n.dir) / "power.log") if p.exists())


def _all_off(state: lifecycle.LabState, names: list[str]) -> None:
    """Until Slurm switched `names` off and may wake them again (idle~: after its SuspendTimeout)."""
    wait_until(lambda: all(_power(state)[n] == "off" for n in names), 120, f"{names} switched off", step=2)
    wait_until(lambda: all(_sinfo(state).get(n, "").startswith("idle~") for n in names), 120,
               f"{names} powered down in Slurm's view", step=2)


def test_idle_pcs_are_switched_off_and_a_job_wakes_two_the_one_that_does_not_wake_is_down(room: Any) -> None:
    state, env = room
    _all_off(state, ["node1", "node2", "node3"])
    dead = next(n for n in state.nodes if n.name == "node1")
    listener = _lab(state).nodes[0].listener
    assert listener, "node1 is off with a Wake-on-LAN listener"
    os.kill(listener, signal.SIGKILL)  # its NIC dead: a magic packet wakes nothing
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "-i", state.inventory, "--on", "room", "--nodes", "2",
                              "--detach", *TINY, env=env, timeout=300)
    assert rc == 0, rec
    run = rec["run_id"]
    requeued: list[str] = []

    def ended() -> bool:
        """The run's end; Slurm holds a requeued job back for its credential lifetime (about two minutes,
        `BeginTime`), which the test, as an admin may, cuts short once it has seen it."""
        if clusterctl_json("status", run, env=env)[1]["state"] not in ACTIVE:
            return True
        held = ssh(state, state.jump.address, "squeue -h -t PD -o '%i %r'").stdout.split()  # type: ignore[union-attr]
        for job, reason in zip(held[::2], held[1::2]):
            if reason == "BeginTime":
                requeued.append(job)
                ssh(state, state.jump.address, f"scontrol update jobid={job} StartTime=now")  # type: ignore[union-attr]
        return False

    try:
        wait_until(ended, 400, "the run ended", step=3)
    except AssertionError as e:
        seen = {c: ssh(state, state.jump.address, c).stdout for c in (  # type: ignore[union-attr]
            "squeue -o '%i %T %r %N'", "sinfo -N -o '%N %T %E'", "cat /var/log/slurm/clusterctl-power.log")}
        raise AssertionError(f"{e}\n{why(clusterctl_json('status', run, env=env)[1])}\n{seen}{_pc_logs(state)}") \
            from None
    assert requeued, "the job was requeued after node1's wake failed"
    done = clusterctl_json("status", run, env=env)[1]
    assert done["state"] == "succeeded" and sorted(n["node"] for n in done["nodes"]) == ["node2", "node3"], \
        why(done) + _pc_logs(state)
    # node1 did not wake: Slurm marked it down with the power program's reason
    down = _sinfo(state)["node1"]
    assert down.startswith("down") and "no answer within ResumeTimeout after Wake-on-LAN" in down, down
    assert _power(state)[dead.name] == "off"
    log = ssh(state, state.jump.address, "cat /var/log/slurm/clusterctl-power.log").stdout
    events = [(e["action"], e["node"], e["ok"]) for e in map(json.loads, log.splitlines())]
    assert {("suspend", n, True) for n in ("node1", "node2", "node3")} <= set(events), events
    assert ("resume", "node2", True) in events and ("resume-fail", "node1", True) in events, events
    # then idle again, switched off again: a collect wakes the run's PCs through Slurm and says so
    _all_off(state, ["node2", "node3"])
    r = clusterctl("collect", run, env=env, timeout=600)
    said = " ".join(r.stdout.split())
    assert r.returncode == 0 and "node2: switched off by the room's Slurm since the run: woken" in said, said
    assert any((Path(env["CLUSTERCTL_HOME"]) / "runs" / run).rglob("metrics-rank*.jsonl"))
    # the room's view: each PC's hours off, and the energy saved at the report's idle estimate
    rc, seen = clusterctl_json("room", state.inventory, env=env)
    saved = {p["node"]: p for p in seen["power_saving"]["pcs"]}
    assert rc == 0 and all(saved[n]["hours"] > 0 for n in ("node1", "node2", "node3")), seen["power_saving"]
    # node1 never came up after its wake was sent: off from its first suspend on, at least as long as the others
    assert saved["node1"]["hours"] >= max(saved[n]["hours"] for n in ("node2", "node3")) - 0.005, saved
    assert saved["node1"]["kwh_saved"] == pytest.approx(saved["node1"]["hours"] * 0.04, rel=0.01)
