"""The host firewall as a run needs it (new TCP from the other nodes, to ports picked at start), judged on
recorded `nft -j list ruleset` output (tests/fixtures/nft/, each made with nft in a namespace of its own)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.inventory.model import Host
from cluster.nodes import firewall, health
from cluster.nodes.facts import NodeFacts
from tests.conftest import ROOT

NFT = ROOT / "tests" / "fixtures" / "nft"
PEERS = ["10.0.0.12", "10.0.0.13"]


def ruleset(name: str) -> dict:
    return json.loads((NFT / f"{name}.json").read_text())


@pytest.mark.parametrize("name, state", [
    ("ssh_only", "blocked"),  # policy drop; 22, established, and a port range accepted: random ports dropped
    ("lab_accepted", "open"),  # the lab network accepted before the policy
    ("one_port_dropped", "partly"),  # one port dropped: a run that picks it fails
    ("jump", "unknown"),  # a jump to another chain (ufw's layout): not read, said so
])
def test_recorded_rulesets(name: str, state: str) -> None:
    v = firewall.judge(ruleset(name), PEERS)
    assert v.state == state, v


def test_a_peer_outside_the_accepted_network_is_blocked() -> None:
    assert firewall.judge(ruleset("lab_accepted"), ["192.168.5.7"]).state == "blocked"
    assert firewall.judge({"nftables": []}, PEERS).state == "none"


def test_check_names_the_rule_and_the_fix() -> None:
    hosts = [Host(name=f"pc{i}", address=f"10.0.0.1{i}") for i in (1, 2)]
    nf = {"pc1": NodeFacts("pc1", {"firewall": {"state": "ok", "ruleset": ruleset("ssh_only")}}),
          "pc2": NodeFacts("pc2", {"firewall": {"state": "absent"}})}
    [p] = health.firewalls(hosts, nf)
    assert (p.host, p.code, p.blocking) == ("pc1", "firewall", True)
    assert "policy drop" in p.message and "nft insert rule" in p.fix
    nf["pc2"] = NodeFacts("pc2", {"firewall": firewall.parse("Error: Operation not permitted", 1)})
    codes = {(p.host, p.code, p.blocking) for p in health.firewalls(hosts, nf)}
    assert ("pc2", "firewall-unreadable", False) in codes


def test_the_fact_parses_its_outputs() -> None:
    assert firewall.parse("@@absent\n", 0) == {"state": "absent"}
    assert firewall.parse((NFT / "jump.json").read_text(), 0)["state"] == "ok"
    assert firewall.parse("not json", 0)["state"] == "unreadable"


def test_become_needs_sudo_without_a_password_and_then_makes_the_workdir() -> None:
    """check with `become`: sudo that wants a password blocks (named, with the NOPASSWD fix); sudo that works
    makes an unwritable workdir and a missing python3-venv provision's to fix, not a problem."""
    h = Host(name="pc1", address="10.0.0.11", user="student", become=True)
    base = {"python": {"version": "3.11.2", "version_tuple": [3, 11, 2], "executable": "/usr/bin/python3"},
            "disk": {"path": "/", "total_gib": 100.0, "free_gib": 90.0}, "workdir_writable": False, "venv": False}
    nf = NodeFacts("pc1", {**base, "sudo": False}, address_nic="eth0")
    codes = {(p.code, p.blocking) for p in health.from_facts(h, nf)}
    assert ("sudo-password", True) in codes and ("workdir-unwritable", True) in codes
    nf = NodeFacts("pc1", {**base, "sudo": True}, address_nic="eth0")
    assert health.from_facts(h, nf) == []


def test_launch_opens_only_the_chains_that_would_block() -> None:
    from cluster.runs import firewall as runfw

    assert runfw.chains_to_open(ruleset("ssh_only"), PEERS) == [("inet", "filter", "input")]
    assert runfw.chains_to_open(ruleset("lab_accepted"), PEERS) == []
    assert runfw.chains_to_open(ruleset("one_port_dropped"), PEERS) == [("ip", "filter", "input")]


def test_the_close_script_removes_the_runs_rules_by_handle(tmp_path: Path) -> None:
    """On `nft -a list chain` output as nft prints it (recorded), the script deletes the tagged handles only."""
    import subprocess

    from cluster.runs import firewall as runfw

    listing = ('table inet filter {\n\tchain input { # handle 1\n\t\ttype filter hook input priority filter; policy drop;\n'
               '\t\tip saddr { 10.0.0.11, 10.0.0.12 } meta l4proto tcp accept comment "clusterctl r-1" # handle 7\n'
               '\t\tip saddr 10.0.0.0/24 accept comment "clusterctl r-10" # handle 8\n'
               '\t\ttcp dport 22 accept # handle 2\n\t}\n}\n')
    fake = tmp_path / "bin"
    fake.mkdir()
    # `nft -a list`: the listing; `nft delete`: recorded; `nft list` (the check after): the listing where the
    # delete did not take (a `stuck` file), else the chain without the run's rule
    after = listing.replace('\t\tip saddr { 10.0.0.11, 10.0.0.12 } meta l4proto tcp accept comment "clusterctl r-1" # handle 7\n', "")
    (fake / "nft").write_text(f"#!/bin/sh\nif [ \"$1\" = -a ]; then cat <<'X'\n{listing}X\n"
                              f"elif [ \"$1\" = list ]; then if [ -e {tmp_path}/stuck ]; then cat <<'X'\n{listing}X\n"
                              f"else cat <<'X'\n{after}X\nfi\nelse echo \"$@\" >> {tmp_path}/deleted; fi\n")
    (fake / "nft").chmod(0o755)
    script = runfw.close_script(Host(name="a", address="10.0.0.11"), "r-1", [("inet", "filter", "input")])
    r = subprocess.run(["sh", "-c", script], env={"PATH": f"{fake}:/usr/bin:/bin"}, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0 and r.stdout == "", r
    assert (tmp_path / "deleted").read_text().split("\n")[:-1] == ["delete rule inet filter input handle 7"]
    (tmp_path / "stuck").touch()  # the rule is still there after the delete: said, exit 1
    r = subprocess.run(["sh", "-c", script], env={"PATH": f"{fake}:/usr/bin:/bin"}, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and r.stdout.strip() == "still open in: inet filter input", r


def test_launch_never_touches_the_firewall_of_this_machine(tmp_path: Path) -> None:
    """`connection: local` nodes are the head itself: open_for asks them nothing and opens nothing there."""
    from cluster.nodes.fanout import Group
    from cluster.runs import firewall as runfw

    hosts = [Host(name=f"l{i}", address="127.0.0.1", connection="local", workdir=str(tmp_path / f"w{i}"), become=True)
             for i in (1, 2)]
    with Group(hosts) as g:
        assert runfw.open_for(g, hosts, "r1", {h.name: h.workdir for h in hosts}) == {}
    assert not list(tmp_path.rglob(runfw.CLOSE))
