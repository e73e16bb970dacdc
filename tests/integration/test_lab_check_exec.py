"""check / exec / trust against a real 3-node simulated lab (real sshd in network namespaces)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from cluster.provision import diskspace
from cluster.lab import lifecycle, sshd
from cluster.inventory import loader
from cluster.nodes import health
from cluster.nodes.fanout import Group
from cluster.transport import ssh
from tests.conftest import ROOT
from tests.integration.conftest import clusterctl, clusterctl_json, pytestmark, wait_until  # noqa: F401


def test_check_reports_three_healthy_nodes_with_their_facts(lab3) -> None:
    rc, data = clusterctl_json("check", lab3.inventory)
    assert rc == 0, data
    assert data["healthy"] == 3 and data["total"] == 3
    assert [p for p in data["problems"] if p["blocking"]] == []
    for node, n in zip(lab3.nodes, data["nodes"]):
        f = n["facts"]
        assert n["host"] == node.name and n["status"] == "ok"
        assert f["hostname"]["name"] == node.hostname  # each node's own UTS namespace
        assert f["hostname"]["resolves_to"] == ["127.0.1.1"]  # its own /etc/hosts, as Debian writes it
        assert f["address_nic"] == "eth0" and node.address in f["nics"][1]["addresses"]
        assert f["python"]["version_tuple"][0] == 3
        assert f["disk"]["path"] == "/srv/cluster"
        assert f["gpus"]["source"] == "none"
        assert abs(f["clock_offset_s"]) < 0.05  # same kernel clock: only the probe's error remains


def test_check_human_output(lab3) -> None:
    # a wide terminal: at 80 columns rich folds the table's cells, and how depends on the workdir's length
    # (pytest-xdist's folders are longer), not on what is checked here
    before = shutil.disk_usage(lab3.dir).free / 2**30
    r = clusterctl("check", lab3.inventory, env={"COLUMNS": "200"})
    after = shutil.disk_usage(lab3.dir).free / 2**30
    assert r.returncode == 0, r.stderr
    assert "3/3 nodes healthy" in r.stdout
    warnings = [line for line in r.stdout.splitlines() if line.startswith(("warning", "error"))]
    # the nodes' /srv/cluster lies on this machine's disk, whose free space the suite does not set: a disk
    # warning for each node where this machine has under 25 GiB free (CI machines do), none above
    disk = [w for w in warnings if " GiB free at /srv/cluster" in w]
    if max(before, after) < health.DISK_WARN_GIB:
        assert [w.split(":")[0] for w in disk] == [f"warning {n.name}" for n in lab3.nodes], r.stdout
    elif min(before, after) >= health.DISK_WARN_GIB:
        assert disk == [], r.stdout
    # else it crossed 25 GiB while check ran: either is right
    # the one other warning a Debian PC gets: its hostname is on 127.0.1.1 (provision pins the interface)
    rest = [w for w in warnings if w not in disk]
    assert len(rest) == 3 and all("resolves to 127.0.1.1 (loopback)" in w for w in rest), r.stdout
    for n in lab3.nodes:
        assert n.name in r.stdout and n.address in r.stdout


def test_exec_returns_each_nodes_own_hostname(lab3) -> None:
    rc, data = clusterctl_json("exec", lab3.inventory, "--", "hostname")
    assert rc == 0
    assert [(n["host"], n["status"], n["stdout"].strip()) for n in data["nodes"]] == [
        (n.name, "ok", n.hostname) for n in lab3.nodes]
    r = clusterctl("exec", lab3.inventory, "--", "hostname")
    assert "3 ok, 0 failed, 0 unreachable" in r.stdout


def test_exec_private_workdir_per_node(lab3) -> None:
    clusterctl("exec", lab3.inventory, "--", 'echo "$(hostname)" > /srv/cluster/who')
    for n in lab3.nodes:
        assert (Path(n.dir) / "srv" / "who").read_text().strip() == n.hostname


def test_exec_failure_and_limit(lab3) -> None:
    rc, data = clusterctl_json("exec", lab3.inventory, "--limit", "node2", "--", "exit 7")
    assert rc == 1 and [(n["host"], n["exit_code"]) for n in data["nodes"]] == [("node2", 7)]


def test_stopped_sshd_is_unreachable_within_the_timeout_others_reported_in_full(lab3) -> None:
    sshd.stop_sshd(lab3, "node2")
    try:
        start = time.monotonic()
        rc, data = clusterctl_json("check", lab3.inventory)
        wall = time.monotonic() - start
    finally:
        sshd.restart_sshd(lab3, "node2")
    nodes = {n["host"]: n for n in data["nodes"]}
    assert rc != 0
    assert nodes["node2"]["status"] == "unreachable" and nodes["node2"]["facts"] is None
    problem = next(p for p in data["problems"] if p["host"] == "node2")
    assert problem["code"] == "refused" and problem["blocking"] and "sshd" in problem["fix"]
    for name in ("node1", "node3"):
        assert nodes[name]["status"] == "ok" and nodes[name]["facts"]["hostname"]["name"] == name
    assert wall < 3 + 10  # connect timeout 3 s, plus interpreter start and the others' facts


def test_silent_node_is_unreachable_after_the_connect_timeout(lab3) -> None:
    ns = lab3.nodes[2].netns
    subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)
    try:
        start = time.monotonic()
        rc, data = clusterctl_json("exec", lab3.inventory, "--", "hostname")
        wall = time.monotonic() - start
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
    nodes = {n["host"]: n for n in data["nodes"]}
    assert rc == 3
    assert nodes["node3"]["status"] == "unreachable" and nodes["node3"]["problem"] == "timeout"
    assert nodes["node1"]["stdout"].strip() == "node1" and nodes["node2"]["stdout"].strip() == "node2"
    assert 3 <= wall < 3 + 5


def test_changed_host_key_is_refused_with_its_fingerprint_then_fixed_as_told(lab3) -> None:
    node = lab3.nodes[2]
    kh = Path(lab3.dir, "known_hosts")
    sshd.restart_sshd(lab3, node.name, new_host_key=True)  # as if the PC had been reinstalled
    new_fp = subprocess.run(["ssh-keygen", "-lf", str(Path(node.dir) / "hostkey.pub")], capture_output=True,
                            text=True, check=True).stdout.split()[1]
    rc, data = clusterctl_json("check", lab3.inventory)
    assert rc != 0
    problem = next(p for p in data["problems"] if p["host"] == node.name)
    assert problem["code"] == "hostkey-changed" and new_fp in problem["message"]
    assert {n["host"] for n in data["nodes"] if n["status"] == "ok"} == {"node1", "node2"}
    # trust refuses too, and records nothing
    before = kh.read_text()
    r = clusterctl("trust", lab3.inventory, "--yes")
    assert r.returncode == 3 and "changed" in r.stdout and new_fp in r.stdout
    assert kh.read_text() == before
    # a key you marked @revoked is refused as revoked, not as changed (the fix differs: a new key on the node)
    key_type, key_b64 = (Path(node.dir) / "hostkey.pub").read_text().split()[:2]
    kh.write_text(before + f"@revoked * {key_type} {key_b64}\n")
    rc, got = clusterctl_json("trust", lab3.inventory, "--yes")
    assert rc == 3 and {n["host"]: n["status"] for n in got["nodes"]}[node.name] == "revoked"
    assert "revoked" in next(n["message"] for n in got["nodes"] if n["host"] == node.name)
    kh.write_text(before)
    # the fix the message gives: remove the old entry, trust again
    assert f"ssh-keygen -R {node.address} -f {kh}" in problem["fix"]
    subprocess.run(["ssh-keygen", "-R", node.address, "-f", str(kh)], check=True, capture_output=True)
    assert clusterctl("trust", lab3.inventory, "--yes").returncode == 0
    rc, data = clusterctl_json("check", lab3.inventory)
    assert rc == 0 and data["healthy"] == 3


def test_trust_records_new_keys_only_when_confirmed(lab3, tmp_path: Path) -> None:
    inv = yaml.safe_load(Path(lab3.inventory).read_text())
    kh = tmp_path / "fresh_known_hosts"
    inv["defaults"]["known_hosts"] = str(kh)
    p = tmp_path / "inv.yaml"
    p.write_text(yaml.safe_dump(inv))
    # unknown keys: check refuses to connect and says how to fix it
    rc, data = clusterctl_json("check", str(p))
    assert rc != 0 and {x["code"] for x in data["problems"]} == {"hostkey-unknown"}
    assert all("clusterctl trust" in x["fix"] for x in data["problems"])
    # without a terminal and without --yes nothing is recorded
    r = clusterctl("trust", str(p))
    assert r.returncode == 3 and not kh.exists() and "re-run with --yes" in r.stderr
    rc, data = clusterctl_json("trust", str(p), "--yes")
    assert rc == 0 and all(n["status"] == "new" and n["recorded"] for n in data["nodes"])
    for n, node in zip(data["nodes"], lab3.nodes):
        expected = subprocess.run(["ssh-keygen", "-lf", str(Path(node.dir) / "hostkey.pub")], capture_output=True,
                                  text=True, check=True).stdout.split()[1]
        assert n["fingerprint"] == expected
    assert len(kh.read_text().splitlines()) == 3
    rc, data = clusterctl_json("trust", str(p), "--yes")
    assert rc == 0 and {n["status"] for n in data["nodes"]} == {"known"}
    assert len(kh.read_text().splitlines()) == 3
    rc, _ = clusterctl_json("check", str(p))
    assert rc == 0


def test_the_disk_check_sees_the_three_nodes_on_one_machine_and_one_disk(lab3) -> None:
    """provision's disk check (cluster/provision/diskspace.py) over real SSH: the lab's nodes share this machine's
    kernel (one boot_id) and disk, so a need that fits each node alone but not the three is refused for all."""
    hosts = list(loader.load(lab3.inventory).hosts.values())
    with Group(hosts) as g:
        res = g.run(lambda h: diskspace.command(h.workdir, f"{h.workdir}/no-wheels", f"{h.workdir}/no-venv"),
                    timeout=60)
    disks = {n: diskspace.parse(r.stdout) for n, r in res.items()}
    assert len({d.boot_id for d in disks.values()}) == 1
    assert {(d.filesystem, d.mount) for d in disks.values()} == {(disks["node1"].filesystem, "/srv/cluster")}
    assert abs(disks["node1"].free - shutil.disk_usage(lab3.nodes[0].dir).free) < diskspace.GIB  # it moves
    assert all((d.wheels_present, d.venv_present, d.freeze) == (0, 0, "") for d in disks.values())
    need = diskspace.Need(wheels=disks["node1"].free // 3, installed=0, lock_text="")
    out = diskspace.shortfalls(disks, {n: need for n in disks})
    assert set(out) == set(disks) and "3 nodes on this machine (node1, node2, node3)" in out["node1"]
    assert diskspace.shortfalls(disks, {"node1": need}) == {}  # one of them alone fits


def _on_node(node: lifecycle.NodeState, argv: list[str]) -> list[int]:
    """Live processes running `argv` in a session of this node's sshd: the lab's nodes share this machine's
    process table, so /proc shows them, told apart by the node's address in $SSH_CONNECTION."""
    want = "\0".join(argv).encode() + b"\0"
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if (p / "cmdline").read_bytes() != want or (p / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            env = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"SSH_CONNECTION=") and f" {node.address} ".encode() in e for e in env):
            found.append(int(p.name))
    return found


def test_a_command_past_its_timeout_is_killed_on_the_node(lab3) -> None:
    """The head gives up after 2 s and kills the command's process group on the node (sshd without a pty
    would leave it running): nothing of it remains, and what it would have written 8 s later never appears."""
    node = lab3.nodes[0]
    late = Path(node.dir) / "srv" / "late"  # /srv/cluster/late on the node
    late.unlink(missing_ok=True)
    t0 = time.monotonic()
    rc, data = clusterctl_json("exec", lab3.inventory, "--limit", node.name, "--timeout", "2", "--",
                               "sleep 8; echo x > /srv/cluster/late")
    took = time.monotonic() - t0
    assert rc == 1 and [(n["host"], n["problem"]) for n in data["nodes"]] == [(node.name, "command-timeout")], data
    # gone at once: the head's kill, not the node's own bound (2 + 5 s)
    gone = wait_until(lambda: not _on_node(node, ["sleep", "8"]), 1.0, "no `sleep 8` left on the node")
    time.sleep(max(0.0, 10 - (time.monotonic() - t0)))
    assert not late.exists(), "the command went on after its timeout"
    print(f"exec --timeout 2: verdict {took:.1f} s, nothing left {gone:.2f} s later, nothing written at 10 s")


def test_a_command_cut_off_from_the_head_ends_on_the_node_by_itself(lab3) -> None:
    """The node's link goes down while a command with a 2 s timeout runs: the head gives up and cannot reach
    the node to stop it; the node's own bound (timeout + margin) ends it there."""
    node = lab3.nodes[1]
    cut = Path(node.dir) / "srv" / "cut"
    cut.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "exec", lab3.inventory, "--json", "--limit", node.name,
                             "--timeout", "2", "--", "sleep 30; echo x > /srv/cluster/cut"],
                            cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _on_node(node, ["sleep", "30"]), 20, "the command running on the node")
        started = time.monotonic()
        subprocess.run(["ip", "link", "set", node.veth, "down"], check=True)
        out, _ = proc.communicate(timeout=60)
        verdict = time.monotonic() - started
        data = json.loads(out)
        assert proc.returncode == 1 and data["nodes"][0]["problem"] == "command-timeout", out
        bound = ssh.node_bound(2)
        died = wait_until(lambda: not _on_node(node, ["sleep", "30"]), bound + 3, "the command gone by itself")
        died += verdict
        assert bound - 1 <= died <= bound + 3, f"ended {died:.1f} s after it started (node bound {bound} s)"
        print(f"link cut, exec --timeout 2: head's verdict {verdict:.1f} s, ended on the node {died:.1f} s "
              f"after it started (bound {bound} s)")
    finally:
        subprocess.run(["ip", "link", "set", node.veth, "up"], check=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in _on_node(node, ["sleep", "30"]):
            os.kill(p, signal.SIGKILL)
    assert not cut.exists()
