"""The lab's PCs imitate Debian PCs for Debian's munge and Slurm packages: each PC (nodes and the gateway) has
its own /etc/munge, /etc/slurm, /run and Slurm folders, a systemctl that runs the packages' units inside it
(cluster.lab.units), a read-only dpkg database, and starts its enabled units when it powers on. All over real
SSH as the lab's login user with sudo, as `provision --slurm` reaches them; this machine's own munge is
never touched."""
from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from cluster.lab import lifecycle
from cluster.lab.power import mac_of
from tests.conftest import ROOT
from tests.integration.conftest import lab_up, pytestmark, wait_until  # noqa: F401

HOST_KEY = Path("/etc/munge/munge.key")
KEY = ("sudo dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none && "
       "sudo chown munge:munge /etc/munge/munge.key && sudo chmod 0400 /etc/munge/munge.key")


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@pytest.fixture(scope="module")
def pcs(tmp_path_factory: pytest.TempPathFactory):
    """A --gateway lab of 2 nodes whose login user is `student`, an ssh_config that reaches each PC, and the
    host's munge key digest from before the lab."""
    before = _digest(HOST_KEY)
    with lab_up(tmp_path_factory, "pcs", 2, 27, gateway=True, user="student") as (state, d):
        lab = Path(state.dir)
        common = (f"  IdentityFile {lab / 'id_ed25519'}\n  UserKnownHostsFile {lab / 'known_hosts'}\n"
                  "  StrictHostKeyChecking yes\n  BatchMode yes\n")
        (d / "ssh_config").write_text(
            f"Host gateway\n  HostName {state.jump.address}\n  User root\n{common}"
            + "".join(f"Host {n.name}\n  HostName {n.address}\n  User student\n  ProxyJump gateway\n{common}"
                      for n in state.nodes))
        _refuse_a_shared_etc(d, state)
        yield state, d, before


def _refuse_a_shared_etc(d: Path, state: lifecycle.LabState) -> None:
    """Before any test writes as root in a PC: its /etc/munge must be its own and its dpkg database read-only,
    or the writes below would change this machine's (a lab without cluster.lab.pc)."""
    host = os.stat("/etc/munge")
    for host_name in [n.name for n in state.nodes] + ["gateway"]:
        r = ssh(d, host_name, "stat -c '%d %i' /etc/munge; findmnt -no OPTIONS /var/lib/dpkg")
        words = r.stdout.split()
        if len(words) < 3 or (int(words[0]), int(words[1])) == (host.st_dev, host.st_ino) \
                or "ro" not in words[2].split(","):
            pytest.fail(f"{host_name}: /etc/munge is this machine's or /var/lib/dpkg is writable ({r.stdout!r}): "
                        "nothing is written")


def ssh(d: Path, host: str, command: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-F", str(d / "ssh_config"), host, command], capture_output=True, text=True,
                          input=stdin, timeout=90)


def ok(d: Path, host: str, command: str) -> str:
    r = ssh(d, host, command)
    assert r.returncode == 0, f"{host}: `{command}` exited {r.returncode}: {r.stderr}"
    return r.stdout


def daemons(netns: str, name: str) -> list[int]:
    """Live processes called `name` in network namespace `netns`."""
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30).stdout
    return [int(p) for p in out.split() if _comm(int(p)) == name]


def _comm(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return None if stat.rsplit(")", 1)[1].split()[0] == "Z" else Path(f"/proc/{pid}/comm").read_text().strip()


def host_munged() -> list[int]:
    """munged processes in this machine's own network namespace started as Debian's (another lab's --slurm
    munged runs here too, with a key file of its own)."""
    host_ns = os.readlink("/proc/self/ns/net")  # the test runs in it
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and _comm(int(p.name)) == "munged":
            try:
                if os.readlink(p / "ns" / "net") == host_ns and b"--key-file" not in (p / "cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                continue
    return found


def test_each_pc_has_its_own_folders_as_installed_and_a_read_only_dpkg(pcs) -> None:
    state, d, _ = pcs
    for host in ("node1", "gateway"):
        got = ok(d, host, "stat -c '%n %U %a' /etc/munge /run/munge /var/lib/munge /var/log/munge /var/lib/slurm "
                          "/var/lib/slurm/slurmd /var/lib/slurm/slurmctld /var/log/slurm /var/spool/slurmd; "
                          "ls -A /etc/munge /etc/slurm; hostname")
        assert "/etc/munge munge 700\n/run/munge munge 755\n" in got and "/var/lib/slurm/slurmd slurm 755" in got, got
        assert "munge.key" not in got and "slurm.conf" not in got, got
        assert got.split()[-1] == host  # the gateway's hostname: what NodeName/SlurmctldHost name
    r = ssh(d, "node1", "sudo touch /var/lib/dpkg/clusterctl-lab-test")
    assert r.returncode != 0 and "Read-only" in r.stderr, r.stderr
    r = ssh(d, "node1", "sudo dpkg -i /dev/null")
    assert r.returncode != 0, r.stdout
    assert not Path("/var/lib/dpkg/clusterctl-lab-test").exists()
    assert ok(d, "node1", "dpkg-query -W munge").split()[0] == "munge"
    r = ssh(d, "gateway", "systemctl poweroff")
    assert r.returncode == 1 and "no power switch" in r.stderr, r.stderr


def test_munge_enabled_and_started_by_systemctl_runs_in_that_pc_only(pcs) -> None:
    state, d, before = pcs
    for n in state.nodes:
        ok(d, n.name, f"{KEY} && sudo systemctl enable --now munge")
    assert ok(d, "node1", "munge -n | unmunge").split()[:3] == ["STATUS:", "Success", "(0)"]
    assert ssh(d, "node1", "systemctl is-active munge").stdout.strip() == "active"
    assert ssh(d, "node1", "systemctl is-active --quiet munge").returncode == 0
    assert ssh(d, "node1", "systemctl is-enabled munge").stdout.strip() == "enabled"
    first, second = (daemons(n.netns, "munged") for n in state.nodes)
    assert len(first) == 1 and len(second) == 1 and first != second  # each PC its own munged
    assert _digest(HOST_KEY) == before and not host_munged()  # this machine's munge untouched
    # a credential of node1's key does not decode on node2 (each PC its own key)
    cred = ok(d, "node1", "munge -n")
    assert ssh(d, "node2", "unmunge", stdin=cred).returncode != 0


def test_stop_ends_munged_and_a_unit_whose_condition_is_unmet_starts_nothing(pcs) -> None:
    state, d, _ = pcs
    node1 = state.nodes[0]
    ok(d, "node1", "sudo systemctl stop munge")
    assert daemons(node1.netns, "munged") == []
    r = ssh(d, "node1", "systemctl is-active munge")
    assert (r.returncode, r.stdout.strip()) == (3, "inactive")
    r = ssh(d, "node1", "sudo systemctl start slurmd; echo rc=$?; systemctl is-active slurmd; echo rc=$?")
    assert r.stdout.split() == ["rc=0", "inactive", "rc=3"], r.stdout + r.stderr  # no /etc/slurm/slurm.conf
    assert daemons(node1.netns, "slurmd") == []
    assert len(daemons(state.nodes[1].netns, "munged")) == 1  # node2's munge goes on


def test_a_powered_on_pc_starts_its_enabled_units(pcs) -> None:
    state, d, _ = pcs
    node1 = state.nodes[0]
    ssh(d, "node1", "sudo poweroff")  # the node's own switch: the session may end before it answers
    wait_until(lambda: (Path(node1.dir) / "wol-listening").exists(), 15, "node1 off, its NIC listening")
    assert daemons(node1.netns, "munged") == []
    mac = mac_of(node1)
    wol = (ROOT / "cluster" / "nodes" / "wolsend.py").read_text()
    assert ssh(d, "gateway", f"python3 - {node1.address}={mac}", stdin=wol).returncode == 0
    wait_until(lambda: ssh(d, "node1", "true").returncode == 0, 30, "node1 on again", step=0.5)
    wait_until(lambda: daemons(node1.netns, "munged"), 10, "munge (enabled) running again")
    assert ok(d, "node1", "munge -n | unmunge").split()[:3] == ["STATUS:", "Success", "(0)"]


def test_slurmctld_on_the_gateway_and_slurmd_on_the_nodes_make_a_cluster(pcs) -> None:
    """The whole chain `provision --slurm` drives: the packages' units with a hand-written slurm.conf."""
    state, d, _ = pcs
    nodes = "".join(f"NodeName={n.name} NodeAddr={n.address} CPUs=1 State=UNKNOWN\n" for n in state.nodes)
    conf = (f"ClusterName=room\nSlurmctldHost=gateway({state.gateway})\nSlurmUser=slurm\n"
            "AuthType=auth/munge\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "JobAcctGatherType=jobacct_gather/none\nStateSaveLocation=/var/lib/slurm/slurmctld\n"
            "SlurmdSpoolDir=/var/lib/slurm/slurmd\nSlurmctldLogFile=/var/log/slurm/slurmctld.log\n"
            "SlurmdLogFile=/var/log/slurm/slurmd.log\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
            "ReturnToService=2\nMailProg=/bin/true\n"
            f"{nodes}PartitionName=room Nodes={','.join(n.name for n in state.nodes)} Default=YES State=UP\n")
    key = ssh(d, "node1", "sudo cat /etc/munge/munge.key | base64 -w0").stdout
    write = (f"echo {key} | base64 -d | sudo tee /etc/munge/munge.key >/dev/null && sudo chown munge:munge "
             "/etc/munge/munge.key && sudo chmod 0400 /etc/munge/munge.key && "
             "sudo tee /etc/slurm/slurm.conf >/dev/null && echo CgroupPlugin=cgroup/v1 | sudo tee /etc/slurm/cgroup.conf "
             ">/dev/null && sudo systemctl restart munge && sudo systemctl enable --now {unit}")
    for host, unit in (("gateway", "slurmctld"), ("node1", "slurmd"), ("node2", "slurmd")):
        r = ssh(d, host, write.format(unit=unit).replace("sudo ", "") if host == "gateway" else
                write.format(unit=unit), stdin=conf)
        assert r.returncode == 0, f"{host}: {r.stderr}"
    seen = ""

    def idle() -> bool:
        nonlocal seen
        seen = ssh(d, "gateway", "sinfo -h -N -o '%N %T'").stdout
        return sorted(seen.split()) == sorted(["node1", "node2", "idle", "idle"])

    try:
        wait_until(idle, 40, "both nodes idle", step=1.0)
    except AssertionError:
        logs = ssh(d, "gateway", "tail -5 /var/log/slurm/slurmctld.log /var/log/clusterctl-units/*.log").stdout
        raise AssertionError(f"sinfo: {seen!r}\n{logs}") from None
    out = ssh(d, "gateway", "srun -N2 hostname").stdout
    assert sorted(out.split()) == ["node1", "node2"], out


def test_the_inventory_declares_the_room_and_down_leaves_no_munged(pcs) -> None:
    state, d, before = pcs
    doc = yaml.safe_load(Path(state.inventory).read_text())
    assert doc["slurm"] == {"room": {"controller": {"address": state.jump.address, "user": "root",
                                                    "proxy_jump": "none"}, "nodes": "lab", "partition": "room"}}
    pids = [p for n in [*state.nodes, state.jump] for p in daemons(n.netns, "munged")]
    assert pids
    lifecycle.down(state.name, Path(state.dir))
    deadline = time.monotonic() + 10
    while any(_comm(p) == "munged" for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_comm(p) == "munged" for p in pids)
    assert _digest(HOST_KEY) == before and not host_munged()
