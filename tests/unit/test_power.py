"""Wake-on-LAN and power-off pieces on recorded outputs (tests/fixtures/ip): the magic packet, which network and
interface a packet leaves by, the MAC fact and field, what check records, the poweroff command and min_nodes.
The real packets, listener and poweroff run in tests/integration/test_power_lab.py and test_gateway_lab.py."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cluster import errors
from cluster.inventory import loader
from cluster.inventory.model import normalize_mac
from cluster.lab.power import is_magic
from cluster.nodes import facts, power, wolsend
from cluster.runs import jobs, launch, schema

FIX = Path(__file__).parent.parent / "fixtures" / "ip"
MAC = "c2:af:a1:44:69:7b"


def test_the_magic_packet_is_six_ff_then_the_mac_sixteen_times() -> None:
    p = wolsend.magic_packet(MAC.upper().replace(":", "-"))
    assert len(p) == 102 and p[:6] == b"\xff" * 6 and p[6:12] == bytes.fromhex("c2afa144697b") and p[6:] == p[6:12] * 16
    assert is_magic(p, MAC) and is_magic(b"junk" + p + b"tail", MAC)  # NICs find it anywhere in the frame
    assert not is_magic(p, "c2:af:a1:44:69:7c") and not is_magic(p[:-1], MAC)
    with pytest.raises(ValueError):
        wolsend.magic_packet("c2:af:a1")


def test_a_packet_leaves_by_the_network_that_holds_the_node() -> None:
    nets = wolsend.local_networks((FIX / "gateway_ip_o_4_addr_show.txt").read_text())
    assert [(d, str(i)) for d, i in nets] == [("lo", "127.0.0.1/8"), ("eth0", "10.219.3.1/24"),
                                              ("uplink0", "10.219.3.254/30")]
    # the node's /24, though the uplink's /30 lies inside it and has the same broadcast address
    assert wolsend.route_for("10.219.3.12", nets) == ("eth0", "10.219.3.1", "10.219.3.255")
    assert wolsend.route_for("10.219.3.253", nets) == ("uplink0", "10.219.3.254", "10.219.3.255")
    assert wolsend.route_for("10.219.4.12", nets) is None  # not a network of this PC: never a default route
    assert wolsend.route_for("127.0.0.5", nets) is None
    point = wolsend.local_networks("5: wg0    inet 10.9.0.1/31 scope global wg0\n")
    assert wolsend.route_for("10.9.0.0", point) is None  # a point-to-point link has no broadcast


def test_a_node_on_no_network_of_this_pc_is_refused_without_sending() -> None:
    (r,) = wolsend.send([("10.219.4.12", MAC)], ip_output=(FIX / "gateway_ip_o_4_addr_show.txt").read_text())
    assert not r["sent"] and "on no network of this PC" in r["error"] and "10.219.3.0/24" in r["error"]


def test_the_standalone_sender_runs_as_a_gateway_runs_it() -> None:
    """`python3 - ADDR=MAC` with the file on stdin, as wake pipes it over SSH: one JSON line per node."""
    src = Path(wolsend.__file__).read_text()
    r = subprocess.run(["python3", "-", f"10.219.4.12={MAC}"], input=src, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()
    doc = json.loads(line)
    assert doc["address"] == "10.219.4.12" and doc["sent"] is False  # not this PC's network: nothing sent


def test_the_macs_fact_reads_ip_link_with_its_peer_suffix() -> None:
    macs = facts.parse_macs((FIX / "node_ip_o_link_show.txt").read_text(), 0)
    assert macs == {"eth0": MAC}  # eth0@if789: the name without its peer, loopback has no Ethernet address


@pytest.mark.parametrize(("text", "want"), [("C2:AF:A1:44:69:7B", MAC), ("c2-af-a1-44-69-7b", MAC),
                                            ("c2af.a144.697b", MAC), ("c2:af:a1:44:69", None),
                                            ("ff:ff:ff:ff:ff:ff", None), ("00:00:00:00:00:00", None),
                                            ("c2:af:a1:44:69:7g", None), ("", None)])
def test_mac_forms(text: str, want: str | None) -> None:
    assert normalize_mac(text) == want


def _inv(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text(text)
    return p


def test_the_mac_field_is_a_hosts_own_and_quoted(tmp_path: Path) -> None:
    inv = loader.load(_inv(tmp_path, 'defaults: {ssh_config: none}\nhosts:\n  pc1: {address: 10.0.0.1, '
                                     'mac: "C2-AF-A1-44-69-7B"}\n'))
    assert inv.hosts["pc1"].mac == MAC
    with pytest.raises(errors.InventoryError) as e:
        loader.load(_inv(tmp_path, "hosts:\n  pc1: {address: 10.0.0.1, mac: 10:20:30:40:50:59}\n"))
    assert e.value.field == "hosts.pc1.mac" and "base-60" in str(e.value) and 'quote it' in str(e.value)
    with pytest.raises(errors.InventoryError) as e:
        loader.load(_inv(tmp_path, 'defaults:\n  mac: "c2:af:a1:44:69:7b"\nhosts:\n  pc1: {address: 10.0.0.1}\n'))
    assert e.value.field == "defaults.mac" and "only a host can have a MAC" in str(e.value)
    with pytest.raises(errors.InventoryError) as e:
        loader.load(_inv(tmp_path, 'hosts:\n  pc1: {address: 10.0.0.1, mac: "not a mac"}\n'))
    assert "expected an Ethernet address" in str(e.value) and "link/ether" in str(e.value)


def test_check_records_macs_and_the_inventory_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    inv = loader.load(_inv(tmp_path, 'defaults: {ssh_config: none}\nhosts:\n  pc1: {address: 10.0.0.1}\n'
                                     '  pc2: {address: 10.0.0.2, mac: "02:00:00:00:00:02"}\n  pc3: {address: 10.0.0.3}\n'))
    nf = facts.NodeFacts("pc1", {"macs": {"eth0": MAC, "wlan0": "02:00:00:00:00:09"}}, address_nic="eth0")
    assert power.record(inv, {"pc1": nf}) == {"pc1": MAC}
    later = facts.NodeFacts("pc3", {"macs": {"eth0": "02:00:00:00:00:03"}}, address_nic="eth0")
    power.record(inv, {"pc3": later})  # a later check that reached only pc3 keeps pc1's
    assert power.mac_of(inv, inv.hosts["pc1"]) == (MAC, "recorded")
    assert power.mac_of(inv, inv.hosts["pc2"]) == ("02:00:00:00:00:02", "inventory")
    assert power.mac_of(inv, inv.hosts["pc3"]) == ("02:00:00:00:00:03", "recorded")
    unknown = facts.NodeFacts("pc2", {"macs": {}}, address_nic=None)
    assert power.record(inv, {"pc2": unknown}) == {}


def test_wake_refuses_an_unbounded_wait(tmp_path: Path) -> None:
    inv = loader.load(_inv(tmp_path, "defaults: {ssh_config: none}\nhosts:\n  pc1: {address: 127.0.0.1}\n"))
    with pytest.raises(errors.UsageError):
        power.wake(inv, list(inv.hosts.values()), timeout=0)


@pytest.mark.parametrize("become", [False, True])
def test_the_poweroff_command_answers_first_and_goes_through_sudo_with_become(tmp_path: Path, become: bool) -> None:
    inv = loader.load(_inv(tmp_path, f"defaults: {{ssh_config: none, become: {str(become).lower()}}}\n"
                                     "hosts:\n  pc1: {address: 10.0.0.1}\n"))
    cmd = power.poweroff_command(inv.hosts["pc1"])
    assert subprocess.run(["sh", "-n", "-c", cmd]).returncode == 0
    assert ("sudo -n poweroff || sudo -n systemctl poweroff" in cmd) is become
    assert "nohup sh -c" in cmd and "sleep 1" in cmd and cmd.endswith("echo powering-off")
    assert cmd.startswith("sudo -n true && ") is become  # a password prompt fails here, before the reply


def test_min_nodes_is_checked_as_a_number_and_against_the_jobs_nodes(tmp_path: Path) -> None:
    for bad in ("-1", "2.5", "x"):
        with pytest.raises(schema.JobError) as e:
            jobs.load("resnet50-ddp", [f"min_nodes={bad}"])
        assert e.value.field == "min_nodes"
    inv = loader.load(_inv(tmp_path, "defaults: {ssh_config: none}\nhosts:\n  pc1: {address: 127.0.0.1, port: 9}\n"))
    with pytest.raises(schema.JobError) as e:  # refused before any node is contacted
        launch.prepare(inv, jobs.load("resnet50-ddp", ["min_nodes=2"]))
    assert e.value.field == "min_nodes" and "has 1 nodes" in str(e.value)
