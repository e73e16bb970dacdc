"""An Ansible inventory as a lab admin writes it (INI with a host range, group_vars/ and host_vars/, no
workdir): every node works in its own home directory, as on real PCs; two inventory hosts that are one
node are refused before anything is written there."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cluster.inventory import ansible_core
from tests.integration.conftest import clusterctl, clusterctl_json, lab_up, pytestmark  # noqa: F401

TINY = ["--set", "epochs=1", "--set", "threads=1", "--set", "max_steps=3", "--set", "log_every=1"]
ANSIBLE = {"CLUSTERCTL_INVENTORY_READER": "ansible"}


@pytest.fixture(scope="module")
def alab(tmp_path_factory: pytest.TempPathFactory):
    if not ansible_core.available():
        pytest.skip("ansible-core is not installed (pip install 'clusterctl[ansible]')")
    with lab_up(tmp_path_factory, "h", 2, 15) as (state, d):
        lab = Path(state.dir)
        inv = d / "inventory"
        (inv / "group_vars").mkdir(parents=True)
        (inv / "host_vars").mkdir()
        (inv / "hosts.ini").write_text("[lab]\nnode[1:2]\n")
        (inv / "group_vars" / "lab.yml").write_text(
            f"ansible_user: root\nansible_ssh_private_key_file: {lab / 'id_ed25519'}\n"
            f"clusterctl_known_hosts: {lab / 'known_hosts'}\n")
        for n in state.nodes:
            (inv / "host_vars" / f"{n.name}.yml").write_text(f"ansible_host: {n.address}\n")
        yield state, d, {"CLUSTERCTL_HOME": str(d / "home"), **ANSIBLE}


def test_an_ini_range_with_group_and_host_vars_and_no_workdir_provisions_and_launches(alab) -> None:
    state, d, env = alab
    inv = str(d / "inventory" / "hosts.ini")
    rc, res = clusterctl_json("provision", inv, "--set", f"python={sys.executable}", "--set",
                              "vars.python_env=existing", env=env, timeout=900)
    assert rc == 0, json.dumps(res)[-2000:]
    for n in state.nodes:  # each node's workdir in its own home (the default `clusterctl`, in the login dir)
        assert (Path(n.dir) / "home" / "clusterctl" / "cluster.env").is_file()
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "-i", inv, *TINY, env=env, timeout=900)
    assert rc == 0 and rec["state"] == "succeeded", json.dumps(rec)[-3000:]


def test_two_hosts_that_are_one_node_are_refused_before_anything_is_written(alab) -> None:
    state, d, env = alab
    node = state.nodes[0]
    twice = d / "twice.yaml"
    lab = Path(state.dir)
    twice.write_text(f"defaults:\n  user: root\n  identity_file: {lab / 'id_ed25519'}\n"
                     f"  known_hosts: {lab / 'known_hosts'}\n  workdir: /srv/cluster/twice\n"
                     f"hosts:\n  pc1: {{address: {node.address}}}\n  pc2: {{address: {node.address}}}\n")
    rc, chk = clusterctl_json("check", str(twice), env=env, timeout=120)
    assert rc == 1 and {p["code"] for p in chk["problems"] if p["blocking"]} == {"shared-workdir"}, chk
    rc, res = clusterctl_json("provision", str(twice), "--set", f"python={sys.executable}", "--set",
                              "vars.python_env=existing", env=env, timeout=300)
    assert rc != 0 and all("pc1" in json.dumps(res) and "pc2" in json.dumps(res) for _ in [0]), res
    assert not (Path(node.dir) / "srv" / "twice").exists()  # nothing written on the node


def test_check_finds_a_firewall_that_blocks_the_run_and_passes_once_it_accepts_the_lab(alab) -> None:
    """nftables rules in node2's own network namespace (never the host's): SSH accepted, the rest dropped."""
    import subprocess

    state, d, env = alab
    ns, net = state.nodes[1].netns, state.subnet
    nft = ["ip", "netns", "exec", ns, "nft"]
    for rule in ("add table inet filter", "add chain inet filter input { type filter hook input priority 0; policy drop; }",
                 "add rule inet filter input tcp dport 22 accept",
                 "add rule inet filter input ct state established,related accept"):
        subprocess.run([*nft, *rule.split()], check=True, timeout=30)
    try:
        rc, chk = clusterctl_json("check", state.inventory, env=env, timeout=120)
        found = [p for p in chk["problems"] if p["code"] == "firewall"]
        assert rc == 1 and [(p["host"], p["blocking"]) for p in found] == [("node2", True)], chk["problems"]
        assert "policy drop" in found[0]["message"] and "nft insert rule" in found[0]["fix"]
        # launch without `become` refuses before starting, naming the fix (it would hang in the rendezvous)
        r = clusterctl("launch", "resnet50-ddp", "-i", str(d / "inventory" / "hosts.ini"), *TINY, env=env, timeout=300)
        assert r.returncode == 1 and "node2: its host firewall would block the run" in r.stderr \
            and "become: true" in r.stderr and "nothing of it runs on node1, node2" in r.stderr, r.stderr
        subprocess.run([*nft, "insert", "rule", "inet", "filter", "input", "ip", "saddr", net, "accept"], check=True,
                       timeout=30)
        rc, chk = clusterctl_json("check", state.inventory, env=env, timeout=120)
        assert rc == 0 and not [p for p in chk["problems"] if p["code"].startswith("firewall")], chk["problems"]
    finally:
        subprocess.run([*nft, "flush", "ruleset"], timeout=30)
