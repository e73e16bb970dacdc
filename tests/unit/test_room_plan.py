"""provision --slurm's plan from what the PCs have (the probe's output as the PCs print it): a fresh room gets
everything in order, a set-up room nothing, a changed config restarts every daemon, a PC that left is
drained; the key is never shown; the file writer works as a real shell runs it."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from cluster.inventory.model import Host
from cluster.room import plan, state
from cluster.room.debs import Install

CTL = Host(name="controller", address="10.77.0.254", user="root")
NODES = [Host(name=f"node{i}", address=f"10.77.0.1{i}", user="student", become=True) for i in (1, 2)]
FILES = {"slurm.conf": "ClusterName=room\nNodeName=node1\nNodeName=node2\n", "cgroup.conf": "CgroupPlugin=cgroup/v1\n"}
KEY = os.urandom(1024)

# A PC as Debian's packages leave it (the probe's real output on a lab PC before provision --slurm).
FRESH = """\
@@room file /etc/slurm/slurm.conf -
@@room file /etc/slurm/cgroup.conf -
@@room file /etc/slurm/gres.conf -
@@room file /etc/munge/munge.key -
@@room unit munge inactive enabled
@@room unit slurmd inactive enabled
@@room unit slurmctld inactive enabled
@@room pkg munge ii 
@@room pkg slurm-client ii 
@@room pkg slurmctld ii 
@@room pkg slurmd ii 
@@room candidate 22.05.8-4+deb12u3
"""


def set_up(nodes: str = "node1,node2", files: dict[str, str] = FILES) -> str:
    lines = [f"@@room file /etc/slurm/{n} {plan.sha256(t.encode())}" for n, t in files.items()]
    lines += ["@@room file /etc/slurm/gres.conf -", f"@@room file /etc/munge/munge.key {plan.sha256(KEY)}"]
    lines += [f"@@room unit {u} active enabled" for u in ("munge", "slurmd", "slurmctld")]
    lines += [f"@@room node {n}" for n in nodes.split(",")]
    return "\n".join(lines) + "\n@@room candidate (none)\n"


def make(states: dict[str, str], nodes: list[Host] = NODES, files: dict[str, str] = FILES) -> plan.Plan:
    parsed = {n: state.parse(text) for n, text in states.items()}
    return plan.make(CTL, nodes, parsed, files, KEY, lambda h, role, st: Install(role, (), ""))


def test_the_probe_reads_what_a_fresh_pc_prints() -> None:
    s = state.parse(FRESH)
    assert s.digests == {"/etc/slurm/slurm.conf": None, "/etc/slurm/cgroup.conf": None, "/etc/slurm/gres.conf": None,
                         "/etc/munge/munge.key": None}
    assert s.installed == {"munge", "slurm-client", "slurmctld", "slurmd"} and s.candidate == "22.05.8-4+deb12u3"
    assert s.active == {"munge": False, "slurmd": False, "slurmctld": False} and s.enabled["munge"]
    assert state.parse(set_up()).candidate is None and state.parse(set_up()).conf_nodes == ["node1", "node2"]


def test_a_fresh_room_gets_files_key_and_daemons_in_order_and_the_key_is_never_shown() -> None:
    p = make({"controller": FRESH, "node1": FRESH, "node2": FRESH})
    phases = [a.phase for a in p.actions]
    assert phases == sorted(phases, key=plan.PHASES.index)  # in phase order
    files = {(a.pc, a.what) for a in p.phase("files")}
    assert files == {(pc, f) for pc in ("controller", "node1", "node2")
                     for f in ("/etc/slurm/slurm.conf", "/etc/slurm/cgroup.conf", "/etc/munge/munge.key")}
    assert [(a.pc, a.what) for a in p.phase("slurmctld")] == [("controller", "enable and start slurmctld")]
    assert [(a.pc, a.what) for a in p.phase("slurmd")] == [("node1", "enable and start slurmd"),
                                                           ("node2", "enable and start slurmd")]
    assert all(a.command.startswith("sudo -n sh -c ") for a in p.actions if a.pc != "controller")
    assert not any(a.command.startswith("sudo") for a in p.actions if a.pc == "controller")  # root: no sudo
    key = [a for a in p.actions if a.what == state.KEY]
    assert all(a.stdin == KEY and "not shown" in (a.shown or "") for a in key)
    assert not any(KEY.hex() in a.command or (a.shown and "\\x" in a.shown) for a in p.actions)
    assert "munge:munge" in key[0].command and "0400" in key[0].command


def test_a_set_up_room_plans_nothing() -> None:
    p = make({"controller": set_up(), "node1": set_up(), "node2": set_up()})
    assert p.actions == [] and not p.changes and p.notes == []


def test_a_pc_added_restarts_the_others_and_starts_its_own() -> None:
    node3 = Host(name="node3", address="10.77.0.13")
    files = {**FILES, "slurm.conf": FILES["slurm.conf"] + "NodeName=node3\n"}
    p = make({"controller": set_up(), "node1": set_up(), "node2": set_up(), "node3": FRESH}, NODES + [node3], files)
    assert [(a.pc, a.what) for a in p.phase("slurmctld")] == [("controller", "restart slurmctld (its config changed)")]
    assert [(a.pc, a.what) for a in p.phase("slurmd")] == [
        ("node1", "restart slurmd (its config changed)"), ("node2", "restart slurmd (its config changed)"),
        ("node3", "enable and start slurmd")]
    assert any("restart" in n for n in p.notes)


def test_a_pc_that_left_the_room_is_drained_before_the_restart() -> None:
    files = {**FILES, "slurm.conf": "ClusterName=room\nNodeName=node1\n"}
    p = make({"controller": set_up("node1,node2"), "node1": set_up()}, NODES[:1], files)
    drain = p.phase("drain")
    assert [a.pc for a in drain] == ["controller"] and "NodeName=node2 State=DRAIN" in drain[0].command
    assert any("node2 left the room" in n for n in p.notes)


def test_undo_stops_the_daemons_and_removes_only_what_exists() -> None:
    states = {n: state.parse(set_up()) for n in ("controller", "node1", "node2")}
    p = plan.undo(CTL, NODES, states, None)
    assert [(a.pc, a.what) for a in p.actions if a.phase != "files"] == [
        ("controller", "stop and disable slurmctld munge"), ("node1", "stop and disable slurmd munge"),
        ("node2", "stop and disable slurmd munge")]
    removed = [a.what for a in p.phase("files")]
    assert all("gres.conf" not in w and "munge.key" in w for w in removed)
    assert plan.undo(CTL, NODES, {n: state.parse(FRESH.replace("enabled", "disabled")) for n in states}, None).actions == []


def test_the_file_writer_puts_its_input_whole_with_owner_and_mode(tmp_path: Path) -> None:
    target = tmp_path / "etc" / "munge.key"
    cmd = plan.write_file(CTL, str(target), "root:root", "0400")
    subprocess.run(["sh", "-c", cmd], input=KEY, check=True)
    st = target.stat()
    assert target.read_bytes() == KEY and oct(st.st_mode & 0o777) == "0o400" and st.st_uid == 0
    assert not list(target.parent.glob("*.clusterctl-new"))


def _facts(name: str, hostname: str | None = None, clock: float = 0.0, sudo: bool | None = True):  # type: ignore[no-untyped-def]
    from cluster.nodes.facts import NodeFacts

    return NodeFacts(host=name, values={"hostname": {"name": hostname or name}, "sudo": sudo,
                                        "firewall": {"state": "absent"}}, clock_offset_s=clock)


def test_the_room_checks_refuse_what_slurm_cannot_live_with_naming_every_pc() -> None:
    from cluster.room import checks

    ok = {"controller": _facts("controller", "gateway"), "node1": _facts("node1"), "node2": _facts("node2")}
    assert checks.refusals(CTL, NODES, ok) == []  # the controller's hostname is not a NodeName: any name goes
    bad = {**ok, "node1": _facts("node1", "pc-07", clock=400.0), "node2": _facts("node2", "pc-08", sudo=False)}
    found = {r.message.split(" ")[0] + " " + ",".join(r.pcs): r for r in checks.refusals(CTL, NODES, bad)}
    names = next(r for r in found.values() if "hostnames" in r.message)
    assert names.pcs == ("node1", "node2") and "node1 is called 'pc-07'" in names.message
    assert "hostnamectl set-hostname" in names.fix
    clock = next(r for r in found.values() if "clocks" in r.message)
    assert "400 s apart" in clock.message and "munge" in clock.message
    sudo = next(r for r in found.values() if "sudo" in r.message)
    assert sudo.pcs == ("node2",)
    rootless = [Host(name="node1", address="10.77.0.11", user="student")]
    assert any("become" in r.message for r in checks.refusals(CTL, rootless, ok))
