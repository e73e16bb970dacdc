"""Two inventory hosts that are one folder on one machine (a duplicated address, two ports of one PC) are
found from the nodes' own answers (boot id, device:inode, path), not from the inventory's words."""
from __future__ import annotations

import os
from pathlib import Path

from cluster.inventory.model import Host
from cluster.nodes import check, facts, health
from cluster.nodes.fanout import Group


def local(name: str, workdir: Path | str) -> Host:
    return Host(name=name, address="127.0.0.1", connection="local", workdir=str(workdir))


def test_one_folder_under_two_names_is_blocking_and_names_both(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "same")  # the same folder by another path
    hosts = [local("pc1", tmp_path / "a" / "cluster"), local("pc2", tmp_path / "same" / "cluster"),
             local("pc3", tmp_path / "b" / "cluster")]
    with Group(hosts) as g:
        report = check.run(g)
    shared = [p for p in report.problems if p.code == "shared-workdir"]
    assert [(p.host, p.blocking) for p in shared] == [("pc1", True), ("pc2", True)]
    assert "pc2" in shared[0].message and "pc1" in shared[1].message


def test_the_same_path_on_two_machines_is_not_shared() -> None:
    """Lab nodes share a kernel and a path (/srv/cluster, bind-mounted per node): other inodes, other folders."""
    def nf(name: str, boot: str, anchor: str) -> facts.NodeFacts:
        return facts.NodeFacts(name, {"place": {"boot_id": boot, "anchor": anchor, "path": "/srv", "rest": "/cluster"}})

    hosts = [local("a", "/srv/cluster"), local("b", "/srv/cluster"), local("c", "/srv/cluster")]
    found = health.shared_workdirs(hosts, {"a": nf("a", "k1", "1:2"), "b": nf("b", "k1", "1:3"), "c": nf("c", "k2", "1:2")})
    assert found == []


def test_the_place_fact_parses_its_recorded_output() -> None:
    out = "7d691bf4-caa2-41fd-b8df-2a8d0c0e615f\n65024:5308425\n/home/student\nclusterctl\n"
    assert facts.parse_place(out, 0) == {"boot_id": "7d691bf4-caa2-41fd-b8df-2a8d0c0e615f", "anchor": "65024:5308425",
                                         "path": "/home/student", "rest": "clusterctl"}
    assert facts.parse_place("", 1) is None
