"""A room's power saving (cluster/room/power.py): ResumeTimeout from the wakes `clusterctl wake` records on the
head (cluster.nodes.power.record_wakes), no power saving where `suspend_after` is not set, and the hours each
PC was off in a period, read from a recorded power log (tests/golden/room/power.log, the program's lines)."""
from __future__ import annotations

import datetime as dt
import json
import subprocess
import time
from pathlib import Path

import pytest

from cluster.errors import UsageError
from cluster.inventory import loader
from cluster.inventory.model import Inventory
from cluster.nodes import power as nodepower
from cluster.nodes.facts import NodeFacts
from cluster.nodes.power import PowerResult
from cluster.room import held, power, slurm_power
from cluster.study.node_figures import IDLE_W
from tests.conftest import ROOT, write

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


def test_pcs_json_maps_each_node_to_its_address_user_mac_and_gateway(tmp_path: Path) -> None:
    """The inventory's MAC wins, else the recorded one, else none; the controller is no gateway of its own."""
    text = ROOM.replace("defaults: {", "defaults: {proxy_jump: 'root@10.77.0.254', ").replace(
        "user: root}", "user: root, proxy_jump: none}").replace(
        "node3: {address: 10.77.0.13}", "node3: {address: 10.88.0.13, port: 2222, proxy_jump: 'admin@10.77.0.9'}")
    inv = inventory(tmp_path, text)
    nf = NodeFacts(host="node2", values={"macs": {"eth0": "02:00:00:00:00:12"}}, address_nic="eth0")
    nodepower.record(inv, {"node2": nf})
    doc = power.pcs_json(inv, inv.rooms["room"])
    assert doc["wol_port"] == 9 and doc["room"] == "room"
    assert doc["nodes"] == {
        "node1": {"address": "10.77.0.11", "port": 22, "user": "student", "mac": "02:00:00:00:00:11", "gateway": None},
        "node2": {"address": "10.77.0.12", "port": 22, "user": "student", "mac": "02:00:00:00:00:12", "gateway": None},
        "node3": {"address": "10.88.0.13", "port": 2222, "user": "student", "mac": None,
                  "gateway": {"address": "10.77.0.9", "port": 22, "user": "admin"}}}


# ----------------------------------------------------------------------------- hours off, from the power log

LOG = (ROOT / "tests" / "golden" / "room" / "power.log").read_text().splitlines()  # a night of a 3-PC room
NIGHT = (dt.datetime(2026, 12, 7, 18, tzinfo=dt.timezone.utc), dt.datetime(2026, 12, 8, 8, tzinfo=dt.timezone.utc))


def test_hours_off_per_pc_in_a_night_and_the_energy_saved() -> None:
    """pc1 was off before the night began (counted from its start) until 07:30; pc2 off 19:00-21:00 and from
    22:30, still off at the night's end (its 09:00 resume is after it); pc3's first suspend failed (on), its
    wake failed and Slurm marked it down (still off)."""
    got = {o.node: o for o in power.off_times(LOG, *NIGHT, ["pc1", "pc2", "pc3"], {"pc1": 55.0}, IDLE_W)}
    pc1 = 13.5 + 4 / 3600  # 18:00:00 to 07:30:04
    assert {n: o.hours for n, o in got.items()} == pytest.approx({"pc1": pc1, "pc2": 11.5 - 2 / 3600, "pc3": 9.0 - 2 / 3600})
    assert (got["pc1"].idle_w, got["pc1"].idle_w_source) == (55.0, "facts")
    assert (got["pc2"].idle_w, got["pc2"].idle_w_source) == (IDLE_W, "estimate")  # the report's 40 W
    assert got["pc2"].kwh_saved == pytest.approx(got["pc2"].hours * 40 / 1000)
    assert sum(o.kwh_saved for o in got.values()) == pytest.approx((pc1 * 55 + (20.5 - 4 / 3600) * 40) / 1000)


def test_a_period_inside_one_off_stretch_and_one_before_any_suspend() -> None:
    midnight = dt.datetime(2026, 12, 8, 0, tzinfo=dt.timezone.utc)
    hour = [o.hours for o in power.off_times(LOG, midnight, midnight + dt.timedelta(hours=1), ["pc1", "pc2", "pc3"],
                                             {}, IDLE_W)]
    assert hour == [1.0, 1.0, 1.0]
    early = dt.datetime(2026, 12, 7, 12, tzinfo=dt.timezone.utc)
    assert [o.hours for o in power.off_times(LOG, early, early + dt.timedelta(hours=4), ["pc1", "pc2"], {}, IDLE_W)] \
        == [0.0, 0.0]
    with pytest.raises(ValueError, match="before it starts"):
        power.off_times(LOG, NIGHT[1], NIGHT[0], ["pc1"], {}, IDLE_W)


def test_the_lines_the_power_program_writes_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The program's own log function (cluster/room/slurm_power.py) writes what off_times reads."""
    monkeypatch.setattr(slurm_power, "LOG", str(tmp_path / "power.log"))
    start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)
    slurm_power.log("suspend", "pc1", True, "")
    time.sleep(1.1)
    slurm_power.log("resume", "pc1", True, "magic packet ...")
    [got] = power.off_times((tmp_path / "power.log").read_text().splitlines(), start,
                            start + dt.timedelta(hours=1), ["pc1"], {}, IDLE_W)
    assert 0 < got.hours * 3600 <= 3


def test_the_controllers_material_key_pair_host_keys_and_pcs_json(tmp_path: Path) -> None:
    """The power key is made once on the head with ssh-keygen (0400; a dry run keeps none); the PCs' host keys
    come from the head's known_hosts, named as the controller's ssh looks them up; a PC with none is refused."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "hostkey")], check=True)
    kind, b64 = (tmp_path / "hostkey.pub").read_text().split()[:2]
    kh = tmp_path / "known_hosts"
    kh.write_text(f"10.77.0.11 {kind} {b64}\n10.77.0.12 {kind} {b64}\n[10.77.0.13]:2222 {kind} {b64}\n")
    text = ROOM.replace("known_hosts: /dev/null", f"known_hosts: {kh}").replace(
        "node3: {address: 10.77.0.13}", "node3: {address: 10.77.0.13, port: 2222}")
    inv = inventory(tmp_path, text)
    folder = held.folder(inv, "room")
    dry = power.material(inv, inv.rooms["room"], dry_run=True)
    assert dry.public.startswith("ssh-ed25519 ") and not (folder / "power_ed25519").exists()
    m = power.material(inv, inv.rooms["room"], dry_run=False)
    assert oct((folder / "power_ed25519").stat().st_mode & 0o777) == "0o400"
    assert m.key == (folder / "power_ed25519").read_bytes() and m.public.endswith("clusterctl-power:room\n")
    assert power.material(inv, inv.rooms["room"], dry_run=False).key == m.key  # made once
    assert m.known_hosts == f"10.77.0.11 {kind} {b64}\n10.77.0.12 {kind} {b64}\n[10.77.0.13]:2222 {kind} {b64}\n"
    assert json.loads(m.pcs)["nodes"]["node3"]["port"] == 2222
    kh.write_text(f"10.77.0.11 {kind} {b64}\n")
    with pytest.raises(UsageError, match="node2: no host key of it") as e:
        power.material(inv, inv.rooms["room"], dry_run=True)
    assert e.value.fix == "`clusterctl trust node2`, then run again"


def test_a_wake_sent_that_never_came_up_leaves_the_pc_off() -> None:
    """The resume line says the magic packet was sent; a resume-fail for that PC afterwards (Slurm's
    ResumeTimeout) says it never came up: its hours off go on from the suspend."""
    t = "2026-12-07T{}:00+00:00"
    lines = [json.dumps({"time": t.format(h), "action": a, "node": "pc1", "ok": True, "detail": ""})
             for h, a in (("10:00", "suspend"), ("11:00", "resume"), ("11:05", "resume-fail"))]
    start, end = (dt.datetime.fromisoformat(t.format(h)) for h in ("09:00", "13:00"))
    assert power.off_times(lines, start, end, ["pc1"], {}, 40.0)[0].hours == pytest.approx(3.0)
    assert power.off_times(lines[:2], start, end, ["pc1"], {}, 40.0)[0].hours == pytest.approx(1.0)
