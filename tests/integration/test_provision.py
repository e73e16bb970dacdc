"""`clusterctl provision` on a real 2-node simulated lab: fresh venvs from the head's wheelhouse.

Heavy by nature (a real install of PyTorch + TensorFlow on every node: ~4 GB of wheels relayed
and ~7 GB of venv per node, all on this machine's one disk): two nodes, the fewest that relay
(head -> node1 -> node2) and all-reduce; one lab for the module, removed with its files at the end.
The demo provisions three; test_relay_lab covers longer chains and their faults with small files.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cluster import paths
from tests.integration.conftest import clusterctl_json, lab_up, pytestmark  # noqa: F401


@pytest.fixture(scope="module")
def plab(tmp_path_factory: pytest.TempPathFactory):
    with lab_up(tmp_path_factory, "p", 2, 3) as (state, d):
        env = {"CLUSTERCTL_HOME": str(d / "home"),
               # one download per machine, shared with other runs (the lab's nodes get their own copies)
               "CLUSTERCTL_WHEELHOUSE": os.environ.get("CLUSTERCTL_TEST_WHEELHOUSE",
                                                       str(Path.home() / ".cache/clusterctl-test-wheelhouse"))}
        yield state, env
    shutil.rmtree(d, ignore_errors=True)  # ~8 GB of venv per node


def provision(state, env, *extra: str) -> tuple[int, dict]:
    return clusterctl_json("provision", state.inventory, *extra, env=env, timeout=3000)


def test_provision_fresh_venvs_verify_and_rerun_unchanged(plab) -> None:
    state, env = plab
    for n in state.nodes:  # the lab network has no route out: nothing can come from the internet
        routes = subprocess.run(["ip", "-n", n.netns, "route"], capture_output=True, text=True).stdout
        assert "default" not in routes
    rc, dry = provision(state, env, "--dry-run")
    assert rc == 0 and dry["dry_run"] and not any((Path(n.dir) / "srv" / "venv").exists() for n in state.nodes)
    assert {b["tf_package"] for b in dry["builds"]["nodes"].values()} == {"tensorflow-cpu"}

    rc, rep = provision(state, env)
    assert rc == 0, [(n["host"], n["status"], n["error"]) for n in rep["nodes"]] + [json.dumps(rep, indent=1)[-2000:]]
    nodes = {n["host"]: n for n in rep["nodes"]}
    for n in state.nodes:
        o = nodes[n.name]
        assert o["status"] == "ok" and o["changed"] >= 5
        # a fresh venv in the node's own /srv/cluster, its Python the node's, not the head's venv
        cfg = (Path(n.dir) / "srv" / "venv" / "pyvenv.cfg").read_text()
        assert "home = /usr/bin" in cfg
        fp = o["fingerprint"]
        assert fp["torch"].startswith("2.14.1") and fp["tensorflow"] == "2.21.0" and fp["gloo"]
        ar = o["allreduce"]
        assert ar["ok"] and ar["world"] == 2 and ar["busbw_MBps"] > 0
        node_state = json.loads((Path(n.dir) / "srv" / "clusterctl" / "state.json").read_text())
        assert node_state["fingerprint"]["torch"] == fp["torch"] and node_state["stamp"] == fp["stamp"]
        env_file = (Path(n.dir) / "srv" / "cluster.env").read_text()
        assert "GLOO_SOCKET_IFNAME=eth0" in env_file and "NCCL_SOCKET_IFNAME==eth0" in env_file
    assert rep["fingerprint_diff"] == []
    assert {o["fingerprint"]["torch"] for o in nodes.values()} == {nodes["node1"]["fingerprint"]["torch"]}
    head_state = Path(env["CLUSTERCTL_HOME"]) / "state" / f"{paths.inventory_key(state.name, state.inventory)}.json"
    assert json.loads(head_state.read_text())["ok"]

    rc, again = provision(state, env)
    assert rc == 0 and again["nothing_to_do"]
    assert all(s["status"] in ("unchanged", "skipped") for n in again["nodes"] for s in n["steps"])
    # nothing changed: the recorded verification stands (stamps compared), no imports, no all-reduce
    assert all(n["fingerprint"]["reused_from"] for n in again["nodes"]) and "not repeated" in again["notes"][0]
    rc, forced = provision(state, env, "--verify")
    assert rc == 0 and forced["nothing_to_do"]
    assert not any(n["fingerprint"].get("reused_from") for n in forced["nodes"])
    assert all(n["allreduce"]["ok"] and n["allreduce"]["world"] == 2 for n in forced["nodes"])


def test_broken_venv_fails_alone_then_is_repaired(plab) -> None:
    state, env = plab
    good, bad = state.nodes
    init = next((Path(bad.dir) / "srv" / "venv" / "lib").glob("python3*/site-packages/torch/__init__.py"))
    init.write_text("raise ImportError('this venv was corrupted by the test')\n")
    rc, rep = provision(state, env)
    nodes = {n["host"]: n for n in rep["nodes"]}
    assert rc == 1
    assert nodes[bad.name]["status"] == "failed"
    assert "cannot import torch" in nodes[bad.name]["error"] and "corrupted by the test" in nodes[bad.name]["error"]
    assert "rebuilds it" in nodes[bad.name]["fix"]
    assert nodes[good.name]["status"] == "ok"  # the other node provisions and verifies on its own
    assert "all-reduce test skipped: fewer than 2 verified nodes" in rep["notes"]

    rc, rep = provision(state, env)
    nodes = {n["host"]: n for n in rep["nodes"]}
    assert rc == 0, json.dumps(rep, indent=1)[-3000:]
    assert nodes[bad.name]["changed"] >= 2 and nodes[bad.name]["allreduce"]["world"] == 2
    assert nodes[good.name]["changed"] == 0


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): "the package index" of a head without internet."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_head_without_internet_provisions_from_an_imported_wheelhouse(plab, tmp_path: Path) -> None:
    """The README's "Your own lab" way for a head with no route to the package index: the wheelhouse
    exported on a connected machine (here: this module's), imported on the head, provision downloads nothing."""
    state, env = plab
    offline = {"PIP_INDEX_URL": f"http://127.0.0.1:{closed_port()}/simple",
               "CLUSTERCTL_WHEELHOUSE": str(tmp_path / "head-wheelhouse"),
               "CLUSTERCTL_HOME": str(tmp_path / "head-home")}
    before = {n.name: (Path(n.dir) / "srv" / "venv" / "pyvenv.cfg").stat().st_mtime for n in state.nodes}

    rc, rep = provision(state, {**env, **offline})  # nothing imported yet: refused, naming the way
    assert rc != 0
    errors = " ".join(f"{n['error']} {n['fix']}" for n in rep["nodes"])
    assert "cannot reach the package index" in errors and "clusterctl wheelhouse import DIR" in errors, errors
    assert all(n["status"] == "failed" and n["changed"] == 0 for n in rep["nodes"]), rep["nodes"]

    disk = tmp_path / "usb"  # the connected machine's side: its wheelhouse (this module's), for this inventory
    rc, exp = clusterctl_json("wheelhouse", "export", str(disk), state.inventory, env=env, timeout=900)
    assert rc == 0 and exp["wheelhouses"] and exp["files"] > 10, exp
    rc, imp = clusterctl_json("wheelhouse", "import", str(disk), env={**env, **offline}, timeout=900)
    # "replaced": the refused download above left an incomplete wheelhouse under the same key
    assert rc == 0 and {w["status"] for w in imp["wheelhouses"]} <= {"imported", "replaced"}, imp
    shutil.rmtree(disk)

    rc, rep = provision(state, {**env, **offline})
    assert rc == 0, [(n["host"], n["status"], n["error"]) for n in rep["nodes"]]
    assert all(n["status"] == "ok" for n in rep["nodes"])
    after = {n.name: (Path(n.dir) / "srv" / "venv" / "pyvenv.cfg").stat().st_mtime for n in state.nodes}
    assert after == before  # the nodes' verified venvs stand: the imported wheels are the ones they hold
