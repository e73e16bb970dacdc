"""The simulated lab's slurm.conf and cgroup.conf (`lab up --slurm`), and what a lab without Slurm installed says."""
from __future__ import annotations

import ipaddress
import json
import shutil
from pathlib import Path

import pytest

from cluster.errors import LabError
from cluster.lab import slurm, slurm_conf, state


def _conf(**kw: object) -> dict[str, str]:
    args: dict[str, object] = dict(name="s1", ctld_host="head", ctld_addr="10.197.3.1", ctld_port=26307,
                                   munge_socket="/run/clusterctl-lab/s1/munge/munge.socket", slurm_dir="/labs/s1/slurm",
                                   jobcomp="/run/clusterctl-lab/s1/jobcomp.txt",
                                   nodes=[("node1", "10.197.3.11"), ("node2", "10.197.3.12")])
    args.update(kw)
    text = slurm_conf.render_slurm_conf(**args)  # type: ignore[arg-type]
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    keys: dict[str, str] = {}
    for ln in lines:
        if not ln.startswith(("NodeName=", "PartitionName=")):
            k, v = ln.split("=", 1)
            assert k not in keys, f"{k} set twice"
            keys[k] = v
    keys["_nodes"] = "\n".join(ln for ln in lines if ln.startswith("NodeName="))
    keys["_partition"] = "\n".join(ln for ln in lines if ln.startswith("PartitionName="))
    return keys


def test_the_controller_is_the_heads_short_name_at_its_bridge_address_on_the_labs_own_port() -> None:
    c = _conf()
    assert c["SlurmctldHost"] == "head(10.197.3.1)" and c["SlurmctldPort"] == "26307" and c["SlurmdPort"] == "6818"
    assert "CommunicationParameters" not in c  # NoCtldInAddrAny would bind to what the head's name resolves to
    assert c["ClusterName"] == "s1"


def test_munge_is_the_labs_own_socket_and_the_plugins_are_the_ones_that_run_in_namespaces() -> None:
    c = _conf()
    assert c["AuthType"] == "auth/munge" and c["CredType"] == "cred/munge"
    assert c["AuthInfo"] == "socket=/run/clusterctl-lab/s1/munge/munge.socket"
    assert (c["ProctrackType"], c["TaskPlugin"], c["JobAcctGatherType"]) == (
        "proctrack/linuxproc", "task/none", "jobacct_gather/none")
    assert (c["SelectType"], c["SelectTypeParameters"]) == ("select/cons_tres", "CR_CPU")
    assert c["SlurmdParameters"] == "config_overrides"  # the configured CPUs, whatever the shared host has


def test_sacct_c_works_from_the_job_completion_file_without_a_database() -> None:
    c = _conf()
    assert c["JobCompType"] == "jobcomp/filetxt" and c["JobCompLoc"] == "/run/clusterctl-lab/s1/jobcomp.txt"
    assert c["AccountingStorageType"] == "accounting_storage/none"


def test_a_crashed_node_fails_its_job_and_comes_back_when_its_slurmd_does() -> None:
    c = _conf()
    assert c["SlurmdTimeout"] == "20" and c["ReturnToService"] == "2"


def test_daemon_files_are_the_labs_and_each_nodes_own() -> None:
    c = _conf()
    assert c["StateSaveLocation"] == "/labs/s1/slurm/ctld"
    assert c["SlurmctldPidFile"] == "/labs/s1/slurm/slurmctld.pid"
    assert c["SlurmctldLogFile"] == "/labs/s1/slurm/slurmctld.log"
    # mounted from <dir>/slurm/nodes/nodeN in each node's own namespace
    assert c["SlurmdSpoolDir"] == "/srv/clusterctl-slurmd/spool"
    assert c["SlurmdPidFile"] == "/srv/clusterctl-slurmd/slurmd.pid"
    assert c["SlurmdLogFile"] == "/srv/clusterctl-slurmd/slurmd.log"


def test_every_compute_node_at_its_lab_address_in_the_one_default_partition() -> None:
    c = _conf(cpus=2)
    assert c["_nodes"].splitlines() == ["NodeName=node1 NodeAddr=10.197.3.11 CPUs=2 State=UNKNOWN",
                                        "NodeName=node2 NodeAddr=10.197.3.12 CPUs=2 State=UNKNOWN"]
    assert c["_partition"] == "PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=60 State=UP"


def test_cgroup_conf_names_the_v1_plugin() -> None:
    lines = [ln for ln in slurm_conf.render_cgroup_conf().splitlines() if ln and not ln.startswith("#")]
    assert lines == ["CgroupPlugin=cgroup/v1"]


def test_the_login_node_sits_below_the_nodes_and_apart_from_a_gateway() -> None:
    net = ipaddress.IPv4Network("10.197.3.0/24")
    assert slurm_conf.login_address(net) == "10.197.3.10"  # nodes are .11+, a gateway .1 and the last /30


def test_ports_differ_between_labs_of_other_subnets() -> None:
    a = slurm_conf.ctld_port(ipaddress.IPv4Network("10.197.3.0/24"))
    b = slurm_conf.ctld_port(ipaddress.IPv4Network("10.197.4.0/24"))
    assert a != b and all(20000 <= p < 40050 for p in (a, b))


def test_without_slurm_installed_up_slurm_names_the_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool, *a, **kw: None if tool == "slurmctld" else real(tool, *a, **kw))
    with pytest.raises(LabError) as e:
        slurm.preflight()
    assert "slurmctld" in e.value.message
    assert e.value.fix == "apt-get install slurmctld slurmd slurm-client munge"
    assert e.value.exit_code == 4


def test_an_old_lab_json_without_slurm_still_loads(tmp_path: Path) -> None:
    old = {"name": "o", "subnet": "10.1.2.0/24", "bridge": "o-br", "gateway": "10.1.2.1", "bandwidth": None,
           "dir": str(tmp_path), "inventory": str(tmp_path / "inventory.yaml"),
           "nodes": [{"name": "node1", "netns": "o-n1", "veth": "o-v1", "address": "10.1.2.11",
                      "hostname": "node1", "dir": str(tmp_path / "node1")}]}
    (tmp_path / "lab.json").write_text(json.dumps(old))
    loaded = state.load_state("o", tmp_path)
    assert loaded is not None and loaded.slurm is None


def test_a_slurm_lab_json_round_trips(tmp_path: Path) -> None:
    login = state.NodeState("login", "o-sl", "o-vs", "10.1.2.10", "login", str(tmp_path / "login"), pid=7)
    s = state.SlurmState(conf="/c/slurm.conf", shared="/d/shared", shared_mount="/srv/slurm-shared", login=login,
                         controller="10.1.2.1", ctld_port=26000, slurmd_port=6818, munge_socket="/run/m",
                         jobcomp="/run/j", partition="debug", python="/usr/bin/python3", munged_pid=3,
                         slurmctld_pid=4, slurmd_pids={"node1": 5})
    lab = state.LabState(name="o", subnet="10.1.2.0/24", bridge="o-br", gateway="10.1.2.1", bandwidth=None,
                         dir=str(tmp_path), inventory=str(tmp_path / "inventory.yaml"), nodes=[], slurm=s)
    state.save_state(lab)
    assert state.load_state("o", tmp_path) == lab
