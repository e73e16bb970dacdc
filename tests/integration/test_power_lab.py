"""A room whose PCs are off (issue 25, wake and sleep; min_nodes): `check` records each node's MAC, `lab power
off` switches a node off for real (everything in its namespace ends), only a correct magic packet switches
it on again, `wake`, the MACs provision records, `launch --wake`, `min_nodes`, the node's own `poweroff` and
`study --poweroff-after`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.lab import lifecycle
from cluster.nodes import wolsend
from tests.integration.conftest import clusterctl, clusterctl_json, provisioned_lab, pytestmark  # noqa: F401

TINY = ["--set", "epochs=1", "--set", "threads=1", "--set", "max_steps=3", "--set", "log_every=1"]


@pytest.fixture(scope="module")
def plab(tmp_path_factory: pytest.TempPathFactory):
    yield from provisioned_lab(tmp_path_factory, "w", 2, 18)


def lab(state: lifecycle.LabState, *args: str) -> subprocess.CompletedProcess[str]:
    return clusterctl("lab", *args, "--name", state.name, "--dir", state.dir, timeout=60)


def power(state: lifecycle.LabState, node: str) -> str:
    st = lifecycle.load_state(state.name, Path(state.dir))
    assert st is not None
    return next(n.power for n in st.nodes if n.name == node)


def wait_power(state: lifecycle.LabState, node: str, want: str, timeout: float = 15) -> None:
    """The lab records a node's power once everything in it has ended, a moment after SSH stops answering."""
    deadline = time.monotonic() + timeout
    while power(state, node) != want:
        assert time.monotonic() < deadline, f"{node} is not {want} within {timeout} s"
        time.sleep(0.2)


def answers(state: lifecycle.LabState, env: dict[str, str], node: str) -> bool:
    return clusterctl("exec", state.inventory, "--limit", node, "--", "true", env=env, timeout=60).returncode == 0


def test_check_records_macs_and_only_the_right_magic_packet_wakes_a_node(plab) -> None:
    state, env = plab
    rc, chk = clusterctl_json("check", state.inventory, env=env)
    assert rc == 0
    macs = {n["host"]: n["facts"]["macs"]["eth0"] for n in chk["nodes"]}
    node2 = next(n for n in state.nodes if n.name == "node2")
    real = subprocess.run(["ip", "-n", node2.netns, "-o", "link", "show", "eth0"], capture_output=True,
                          text=True).stdout
    assert macs["node2"] in real and macs["node1"] != macs["node2"]

    r = lab(state, "power", "off", "2")
    assert r.returncode == 0, r.stderr
    assert power(state, "node2") == "off" and not answers(state, env, "node2")
    st = subprocess.run(["ip", "netns", "pids", node2.netns], capture_output=True, text=True).stdout.split()
    assert len(st) == 1  # everything of the node ended; only its NIC's listener is left
    status = lab(state, "status", "--json")
    assert status.returncode == 1 and {n["name"]: n["power"] for n in json.loads(status.stdout)["nodes"]} == \
        {"node1": "on", "node2": "off"}

    # another node's packet, and one with the wrong MAC, on the lab's bridge: node2 stays off
    for wrong in (macs["node1"], "02:00:00:00:00:01"):
        assert wolsend.send([(node2.address, wrong)])[0]["sent"]
    time.sleep(1.0)
    assert power(state, "node2") == "off" and not answers(state, env, "node2")

    rc, woke = clusterctl_json("wake", "node2", "-i", state.inventory, "--timeout", "60", env=env, timeout=120)
    assert rc == 0, woke
    (r2,) = woke["wake"]
    assert r2["status"] == "woke" and r2["mac"] == macs["node2"] and r2["mac_from"] == "recorded"
    assert r2["sent_from"] == "head" and r2["broadcast"] == str(node2.address).rsplit(".", 1)[0] + ".255"
    assert power(state, "node2") == "on" and answers(state, env, "node2")
    rc, again = clusterctl_json("wake", "-i", state.inventory, env=env, timeout=120)  # both up: nothing sent
    assert rc == 0 and {w["status"] for w in again["wake"]} == {"up"} and not any(w["packets"] for w in again["wake"])


def test_provision_alone_records_the_macs_and_power_takes_the_node_commands_shape(plab) -> None:
    """No `check`: provision's facts record each MAC. `poweroff -i INVENTORY node2` (the positional is no file:
    a host pattern) and `wake INVENTORY --limit node2` (the positional is the inventory), as check and exec."""
    state, env = plab
    for f in (Path(env["CLUSTERCTL_HOME"]) / "state").glob("*.macs.json"):
        f.unlink()  # what the fixture's provision (or a check before) recorded: only the provision below records
    rc, res = clusterctl_json("provision", state.inventory, "--set", f"python={sys.executable}",
                              "--set", "vars.python_env=existing", env=env, timeout=600)
    assert rc == 0, json.dumps(res)[-2000:]
    node2 = next(n for n in state.nodes if n.name == "node2")
    real = subprocess.run(["ip", "-n", node2.netns, "-o", "link", "show", "eth0"], capture_output=True,
                          text=True).stdout

    rc, off = clusterctl_json("poweroff", "-i", state.inventory, "node2", env=env, timeout=180)
    assert rc == 0 and [(p["host"], p["status"]) for p in off["poweroff"]] == [("node2", "off")], off
    wait_power(state, "node2", "off")
    rc, woke = clusterctl_json("wake", state.inventory, "--limit", "node2", "--timeout", "60", env=env, timeout=120)
    assert rc == 0, woke
    (r2,) = woke["wake"]
    assert r2["host"] == "node2" and r2["status"] == "woke" and r2["mac_from"] == "recorded" and r2["mac"] in real
    assert power(state, "node2") == "on" and answers(state, env, "node2")


def test_launch_wake_starts_on_every_node_once_the_packet_woke_it(plab) -> None:
    state, env = plab
    assert lab(state, "power", "off", "2").returncode == 0
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "-i", state.inventory, "--wake", *TINY, env=env, timeout=600)
    assert rc == 0 and rec["state"] == "succeeded", json.dumps(rec)[-3000:]
    assert [n["node"] for n in rec["nodes"]] == ["node1", "node2"] and rec["left_out"] == {}


def test_min_nodes_starts_without_a_node_that_never_wakes_and_says_why(plab) -> None:
    state, env = plab
    assert lab(state, "power", "off", "2").returncode == 0
    st = lifecycle.load_state(state.name, Path(state.dir))
    assert st is not None
    listener = next(n.listener for n in st.nodes if n.name == "node2")
    assert listener is not None
    os.kill(listener, signal.SIGTERM)  # a PC whose Wake-on-LAN is off in its firmware: no packet wakes it
    try:
        r = clusterctl("launch", "resnet50-ddp", "-i", state.inventory, *TINY, env=env, timeout=300)
        assert r.returncode == 3 and "node2" in r.stderr  # today's behaviour: all nodes, or none
        r = clusterctl("launch", "resnet50-ddp", "-i", state.inventory, "--wake", "--wake-timeout", "4",
                       "--set", "min_nodes=1", "--json", *TINY, env=env, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        rec = json.loads(r.stdout)
        assert rec["state"] == "succeeded" and [n["node"] for n in rec["nodes"]] == ["node1"]
        assert rec["world_size"] == 1 and "unreachable" in rec["left_out"]["node2"]
        assert "node2: did not wake" in r.stderr
        rc, shown = clusterctl_json("status", rec["run_id"], env=env)
        assert shown["left_out"] == rec["left_out"]
        r = clusterctl("launch", "resnet50-ddp", "-i", state.inventory, "--set", "min_nodes=3", *TINY, env=env)
        assert r.returncode == 2 and "min_nodes" in r.stderr
    finally:
        assert lab(state, "power", "on", "2").returncode == 0


def test_a_nodes_own_poweroff_switches_off_that_node_only(plab) -> None:
    state, env = plab
    # the PC's own systemctl (cluster.lab.units) answers for its units, and its poweroff is the switch
    r = clusterctl("exec", state.inventory, "--limit", "node1", "--", "systemctl is-active munge", env=env)
    assert r.returncode == 1 and "inactive" in r.stdout + r.stderr, r.stdout + r.stderr
    r = clusterctl("exec", state.inventory, "--limit", "node2", "--", "poweroff", env=env)
    assert r.returncode in (0, 3), r.stdout + r.stderr  # its answer, or the link gone first
    wait_power(state, "node2", "off", 30)
    assert answers(state, env, "node1")  # the other node, and this machine, are on
    rc, woke = clusterctl_json("wake", "-i", state.inventory, env=env, timeout=120)
    assert rc == 0 and {w["host"]: w["status"] for w in woke["wake"]} == {"node1": "up", "node2": "woke"}


def test_study_poweroff_after_leaves_every_node_off_with_the_results_on_the_head(plab) -> None:
    state, env = plab
    for f in (Path(env["CLUSTERCTL_HOME"]) / "state").glob("*.macs.json"):
        f.unlink()  # the MACs the wake below sends: recorded by the run's collect (facts gathered with the results)
    rc, res = clusterctl_json("study", "resnet50-ddp", "-i", state.inventory, "--nodes", "2", "--poweroff-after",
                              *TINY, env=env, timeout=900)
    assert rc == 0, json.dumps(res)[-2000:]
    (cell,) = res["cells"]
    assert cell["state"] == "succeeded"
    run = Path(env["CLUSTERCTL_HOME"]) / "runs" / cell["run_id"]
    assert all(list((run / n.name).rglob("metrics-rank*.jsonl")) for n in state.nodes), list(run.rglob("*"))[:40]
    wait_power(state, "node1", "off")
    wait_power(state, "node2", "off")
    rc, woke = clusterctl_json("wake", state.inventory, env=env, timeout=120)
    assert rc == 0 and {(w["status"], w["mac_from"]) for w in woke["wake"]} == {("woke", "recorded")}, woke
