"""A room's power saving (cluster/room/power.py): ResumeTimeout from the wakes `clusterctl wake` records on the
head (cluster.nodes.power.record_wakes), and the room's slurm.conf lines only where `suspend_after` asks."""
from __future__ import annotations

from pathlib import Path

from cluster.inventory import loader
from cluster.inventory.model import Inventory
from cluster.nodes import power as nodepower
from cluster.nodes.facts import NodeFacts
from cluster.nodes.power import PowerResult
from cluster.room import power
from tests.conftest import write

ROOM = """\
defaults: {user: student, become: true, known_hosts: /dev/null}
groups:
  lab: {hosts: [node1, node2, node3]}
hosts:
  node1: {address: 10.77.0.11, mac: '02:00:00:00:00:11'}
  node2: {address: 10.77.0.12}
  node3: {address: 10.77.0.13}
  other: {address: 10.77.0.30}
slurm:
  room: {controller: {address: 10.77.0.254, user: root}, nodes: lab, suspend_after: 30m}
"""


def inventory(tmp_path: Path, text: str = ROOM) -> Inventory:
    return loader.load(write(tmp_path, text), check_files=False)


def resume_timeout(inv: Inventory) -> int:
    got = power.settings(inv, inv.rooms["room"])
    assert got is not None
    return got.resume_timeout


def test_no_suspend_after_no_power_saving(tmp_path: Path) -> None:
    inv = inventory(tmp_path, ROOM.replace(", suspend_after: 30m", ""))
    assert power.settings(inv, inv.rooms["room"]) is None


def test_resume_timeout_is_300_s_until_a_wake_is_recorded(tmp_path: Path) -> None:
    inv = inventory(tmp_path)
    got = power.settings(inv, inv.rooms["room"])
    assert got is not None and (got.suspend_after, got.resume_timeout) == (1800, 300)
    assert "no wake of these PCs is recorded" in got.why


def test_resume_timeout_is_one_and_a_half_times_the_slowest_recorded_wake(tmp_path: Path) -> None:
    """`wake` keeps each PC's slowest wake beside its MAC (a node whose MAC is the inventory's too); a PC
    outside the room does not count, and a later faster wake does not lower a PC's slowest."""
    inv = inventory(tmp_path)
    nodepower.record_wakes(inv, [PowerResult("node1", "woke", seconds=84.0), PowerResult("node2", "woke", 40.2),
                                 PowerResult("node3", "no-answer", 180.0), PowerResult("other", "woke", 500.0)])
    nodepower.record_wakes(inv, [PowerResult("node1", "woke", seconds=20.0), PowerResult("node2", "up")])
    rec = nodepower.recorded(inv)
    assert {n: r.get("wake_s") for n, r in rec.items()} == {"node1": 84.0, "node2": 40.2, "other": 500.0}
    got = power.settings(inv, inv.rooms["room"])
    assert got is not None and got.resume_timeout == 126  # 1.5 x 84
    assert got.why.startswith("1.5x the slowest recorded wake (node1: 84 s")
    nodepower.record_wakes(inv, [PowerResult("node2", "woke", seconds=3.0), PowerResult("node1", "up")])
    assert resume_timeout(inv) == 126


def test_a_fast_wake_still_gets_slurms_own_minute_and_the_inventory_wins(tmp_path: Path) -> None:
    inv = inventory(tmp_path)
    nodepower.record_wakes(inv, [PowerResult("node2", "woke", seconds=4.0)])
    assert resume_timeout(inv) == 60
    inv = inventory(tmp_path, ROOM.replace("suspend_after: 30m", "suspend_after: 30m, resume_timeout: 10m"))
    got = power.settings(inv, inv.rooms["room"])
    assert got is not None and (got.resume_timeout, got.why) == (600, "the inventory's resume_timeout")


def test_check_keeps_the_recorded_wake_when_it_records_the_mac_again(tmp_path: Path) -> None:
    """`check` rewrites a PC's MAC record; the wake recorded beside it stays."""
    inv = inventory(tmp_path)
    nodepower.record_wakes(inv, [PowerResult("node2", "woke", seconds=50.0)])
    nf = NodeFacts(host="node2", values={"macs": {"eth0": "02:00:00:00:00:12"}}, address_nic="eth0")
    assert nodepower.record(inv, {"node2": nf}) == {"node2": "02:00:00:00:00:12"}
    assert nodepower.recorded(inv)["node2"]["wake_s"] == 50.0
