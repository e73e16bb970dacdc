"""Ansible inventories, written as an Ansible user would for the simulated lifecycle, work with `trust`,
`check`, `provision` and `launch` through the CLI: an INI file, and a YAML file with a group_vars/ directory
and templated vars.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cluster.lab import lifecycle
from cluster.inventory import ansible_core
from tests.integration.conftest import clusterctl, clusterctl_json, lab_up

pytestmark = pytest.mark.skipif(not ansible_core.available(),
                                reason="ansible-core is not installed (pip install clusterctl[ansible])")


@pytest.fixture(scope="module")
def lab2(tmp_path_factory: pytest.TempPathFactory):
    with lab_up(tmp_path_factory, "ans", 2, 12) as (state, _):
        yield state


def _ini(state: lifecycle.LabState, d: Path) -> Path:
    key = Path(state.dir) / "id_ed25519"  # the lab's login key (its own inventory uses it too)
    hosts = "\n".join(f"{n.name} ansible_host={n.address}" for n in state.nodes)
    src = d / "hosts.ini"
    src.write_text(f"[lab]\n{hosts}\n\n[lab:vars]\nansible_user=root\nansible_port=22\n"
                   f"ansible_ssh_private_key_file={key}\nansible_python_interpreter=auto_silent\n"
                   f"clusterctl_known_hosts={d / 'known_hosts'}\nclusterctl_workdir=/srv/cluster\n"
                   "clusterctl_connect_timeout=3\n")
    return src


def _yaml_with_group_vars(state: lifecycle.LabState, d: Path) -> Path:
    hosts = "".join(f"        {n.name}:\n          ansible_host: {n.address}\n" for n in state.nodes)
    src = d / "hosts.yml"
    src.write_text(f"all:\n  children:\n    lab:\n      hosts:\n{hosts}")
    (d / "group_vars" / "all").mkdir(parents=True)
    (d / "group_vars" / "all" / "ssh.yml").write_text(
        f"lab_user: root\nansible_user: \"{{{{ lab_user }}}}\"\nansible_port: 22\n"
        f"ansible_ssh_private_key_file: {Path(state.dir) / 'id_ed25519'}\n")
    (d / "group_vars" / "lab.yml").write_text(
        f"clusterctl_known_hosts: {d / 'known_hosts'}\nclusterctl_workdir: /srv/cluster\n"
        "clusterctl_connect_timeout: 3\n")
    return src


@pytest.mark.parametrize("kind", ["ini", "yaml"])
def test_trust_check_provision_launch_with_an_ansible_inventory(lab2: lifecycle.LabState, tmp_path: Path,
                                                               kind: str) -> None:
    inv = _ini(lab2, tmp_path) if kind == "ini" else _yaml_with_group_vars(lab2, tmp_path)
    # first contact: no known_hosts yet, so check refuses the unknown keys (exit 3) until trust
    rc, data = clusterctl_json("check", str(inv))
    assert rc == 3, data
    r = clusterctl("trust", str(inv), "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    recorded = (tmp_path / "known_hosts").read_text().splitlines()
    assert sorted(line.split()[0] for line in recorded) == sorted(n.address for n in lab2.nodes)
    rc, data = clusterctl_json("check", str(inv))
    assert rc == 0, data
    assert data["healthy"] == 2 and data["total"] == 2
    assert [n["host"] for n in data["nodes"]] == [n.name for n in lab2.nodes]
    for node, n in zip(lab2.nodes, data["nodes"]):
        assert n["facts"]["hostname"]["name"] == node.hostname  # the right node behind each address
        assert n["facts"]["disk"]["path"] == "/srv/cluster"
    # provision (this interpreter through the shared filesystem: the verified state in seconds) and a tiny run
    env = {"CLUSTERCTL_HOME": str(tmp_path / "home")}
    rc, res = clusterctl_json("provision", str(inv), "--set", f"python={sys.executable}",
                              "--set", "vars.python_env=existing", env=env, timeout=600)
    assert rc == 0, json.dumps(res)[-2000:]
    rc, rec = clusterctl_json("launch", "resnet50-ddp", "-i", str(inv), "--set", "epochs=1", "--set", "threads=1",
                              "--set", "max_steps=2", env=env, timeout=600)
    assert rc == 0 and rec["state"] == "succeeded", json.dumps(rec)[-2000:]
    assert [n["node"] for n in rec["nodes"]] == [n.name for n in lab2.nodes] and rec["world_size"] == 2
