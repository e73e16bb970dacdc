"""What provision would do on a mixed 4-PC lab, rendered without contacting a node, against golden files:
the printed request (text and JSON), each node's steps (the `--dry-run` view) and the files its templates
write (cluster.env above all, which every launch script sources). UPDATE_GOLDEN=1 rewrites them, as in
test_render.py."""
from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cluster.provision import apply, playbook
from cluster.nodes import facts
from cluster.inventory import loader
from cluster.inventory.model import Host
from tests import goldens
from tests.conftest import ROOT

GOLDEN = ROOT / "tests" / "golden" / "provision"
MIXED = ROOT / "tests" / "fixtures" / "launch" / "mixed.yaml"
RECORDED = ROOT / "tests" / "fixtures" / "facts" / "lab-node1.txt"
DRIVER = "580.95.05"  # the driver every GPU of the fixture lab has (R580, COMPAT-FACTS.md)


def node_facts(h: Host, base: dict[str, Any]) -> facts.NodeFacts:
    """A lab node's recorded facts, with the GPUs its inventory entry names as nvidia-smi lists them."""
    values = copy.deepcopy(base)
    count = h.gpu.count if h.gpu else 0
    smi = "\n".join(f"NVIDIA GeForce {h.gpu.model}, {h.gpu.compute_capability}, {DRIVER}, 4096"
                    for _ in range(count)) if h.gpu else "@@absent"
    values["gpus"] = facts.parse_gpus(smi or "@@absent", 0)
    values["hostname"] = {**values["hostname"], "name": h.name}
    return facts.NodeFacts(h.name, values, address_nic="eth0")


def request() -> apply.ProvisionRequest:
    """The request provision prepares for the mixed lab, from the recorded facts."""
    inv = loader.load(MIXED, check_files=False)
    hosts = inv.ordered(inv.hosts.values())
    base = facts.parse_all(RECORDED.read_text())
    return apply.request_for(inv, hosts, {h.name: node_facts(h, base) for h in hosts}, playbook.load("provision"))


def rendered() -> dict[str, list[playbook.RenderedStep]]:
    return request().steps()


def golden_files() -> dict[str, str]:
    """request.txt / request.json: the printed request; node/steps.txt: the steps as `provision --dry-run`
    would run them; node/cluster.env: that template's output (other templates belong to the steps they
    serve and are tested there)."""
    req = request()
    out = {"request.txt": req.to_text(),
           "request.json": json.dumps({**req.to_dict(), "inventory": MIXED.name}, indent=2, default=str) + "\n"}
    for node, steps in req.steps().items():
        out[f"{node}/steps.txt"] = "\n".join(s.to_text() for s in steps) + "\n"
        env = next(s for s in steps if s.dest and s.dest.endswith("/cluster.env"))
        assert env.content is not None
        out[f"{node}/cluster.env"] = env.content
    return out


def test_rendered_provision_matches_golden() -> None:
    files = golden_files()
    for rel, content in files.items():
        goldens.check(GOLDEN / rel, content, f"provision/{rel}")
    names = {p.relative_to(GOLDEN).as_posix() for p in GOLDEN.rglob("*") if p.is_file()}
    assert names == set(files)  # no stale golden files


def test_cluster_env_follows_each_node_gpus_and_the_shared_backend() -> None:
    env = {n: c for n, c in golden_files().items() if n.endswith("/cluster.env")}
    assert set(env) == {f"pc{i}/cluster.env" for i in range(1, 5)}
    assert "NCCL_P2P_DISABLE=1" in env["pc1/cluster.env"]  # two cards in one box
    assert all("NCCL_P2P_DISABLE" not in env[f"pc{i}/cluster.env"] for i in (2, 3, 4))
    assert all("CLUSTER_BACKEND=gloo" in c for c in env.values())  # pc4 has no GPU: gloo for every rank
    assert "CLUSTER_AMP=0" in env["pc1/cluster.env"]  # cc 6.1: no tensor cores
    assert "CLUSTER_PYTHON='/home/student/cluster work/venv/bin/python'" in env["pc3/cluster.env"]


@pytest.mark.parametrize("node", ["pc1", "pc3"])
def test_cluster_env_is_a_shell_file_that_sets_what_it_says(node: str, tmp_path: Path) -> None:
    """Sourced by sh exactly as launch scripts do: the values arrive as written, spaces included."""
    (tmp_path / "cluster.env").write_text(golden_files()[f"{node}/cluster.env"])
    r = subprocess.run(["sh", "-c", ". ./cluster.env && printf '%s|%s|%s' \"$GLOO_SOCKET_IFNAME\" "
                        "\"$NCCL_SOCKET_IFNAME\" \"$CLUSTER_PYTHON\""],
                       cwd=tmp_path, capture_output=True, text=True, timeout=30)
    workdir = "/srv/cluster" if node == "pc1" else "/home/student/cluster work"
    assert r.returncode == 0 and r.stdout == f"eth0|=eth0|{workdir}/venv/bin/python"


def test_a_step_whose_condition_is_false_is_shown_skipped() -> None:
    steps = rendered()["pc2"]
    lock = [s for s in steps if s.when and "wheelhouse is not none" in s.when]
    assert lock and all(not s.runs for s in lock)  # no wheelhouse without I/O: those steps would not run
    assert next(s for s in steps if s.name == "work directory").command == \
        "mkdir -p -- /srv/cluster 2>/dev/null && test -w /srv/cluster"  # no sudo without become


def test_become_runs_the_root_steps_through_sudo_and_never_asks_a_password() -> None:
    """`become: true`: the work directory made (and given to the login user) and python3-venv installed with
    `sudo -n`, which fails rather than prompts; without it, a missing python3-venv says how to get it."""
    inv = loader.load(MIXED, check_files=False, overrides=["become=true"])
    hosts = inv.ordered(inv.hosts.values())
    base = facts.parse_all(RECORDED.read_text())
    req = apply.request_for(inv, hosts, {h.name: node_facts(h, base) for h in hosts}, playbook.load("provision"))
    steps = {s.name: s for s in req.steps()["pc2"]}
    goldens.check(ROOT / "tests" / "golden" / "provision-become" / "pc2" / "steps.txt",
                  "\n".join(s.to_text() for s in req.steps()["pc2"]) + "\n", "the become steps of pc2")
    assert steps["work directory"].command.endswith(
        '|| sudo -n install -d -m 0755 -o "$(id -un)" -g "$(id -gn)" -- /srv/cluster')
    assert steps["Debian packages"].command.startswith("sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install")
    plain = {s.name: s for s in rendered()["pc2"]}
    assert "sudo" not in plain["Debian packages"].command and "become: true" in plain["Debian packages"].command
