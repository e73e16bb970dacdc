"""A lab behind a gateway PC (`lab up --gateway --user student`: the nodes' login user is not root, with
NOPASSWD sudo), reached as a lab admin reaches it: an inventory of bare host names with `become: true` and an
OpenSSH config (Host blocks with HostName, User, IdentityFile, ProxyJump), or an Ansible INI inventory with
ansible_become and ansible_ssh_common_args (-o ProxyJump=, or DeepOps' -o ProxyCommand="ssh -W %h:%p ...").
The head has no route to the nodes: everything goes through the gateway's sshd, host keys checked on
every hop, and the training traffic stays on the nodes' own network."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import (clusterctl, clusterctl_json, lab_up, procs_of, pytestmark,  # noqa: F401
                                        wait_until)

TINY = ["--set", "epochs=1", "--set", "threads=1", "--set", "max_steps=3", "--set", "log_every=1"]


@pytest.fixture(scope="module")
def glab(tmp_path_factory: pytest.TempPathFactory):
    """The lab, and what its admin wrote: ssh_config, an empty known_hosts, inventories of bare names."""
    with lab_up(tmp_path_factory, "g", 2, 14, gateway=True, user="student") as (state, d):
        lab = Path(state.dir)
        kh = d / "admin_known_hosts"
        kh.touch()
        blocks = "".join(f"Host {n.name}\n  HostName {n.address}\n" for n in state.nodes)
        (d / "ssh_config").write_text(
            f"Host gw\n  HostName {state.jump.address}\n  User root\n  IdentityFile {lab / 'id_ed25519'}\n"
            f"  UserKnownHostsFile {kh}\n"
            f"Host node*\n  User student\n  IdentityFile {lab / 'id_ed25519'}\n  UserKnownHostsFile {kh}\n"
            f"  ProxyJump gw\n{blocks}")
        (d / "bare.yaml").write_text(f"defaults:\n  ssh_config: {d / 'ssh_config'}\n  workdir: /srv/cluster\n"
                                     "  become: true\n"
                                     "hosts:\n" + "".join(f"  {n.name}: {{}}\n" for n in state.nodes))
        yield state, d, {"CLUSTERCTL_HOME": str(d / "home")}


def lab_keys(state) -> dict[str, str]:
    """address -> the public key the lab generated for it (what trust must have recorded)."""
    return {n.address: (Path(n.dir) / "hostkey.pub").read_text().split()[1] for n in [*state.nodes, state.jump]}


def test_the_head_cannot_reach_a_node_but_openssh_through_the_gateway_can(glab) -> None:
    state, d, _ = glab
    # no route from the head to the nodes through any link of the lab (never dialled: the machine's default
    # route may lead anywhere, and tests contact only the lab)
    route = subprocess.run(["ip", "-o", "route", "get", state.nodes[0].address], capture_output=True, text=True,
                           timeout=30).stdout
    assert state.name not in route, route
    assert state.name in subprocess.run(["ip", "-o", "route", "get", state.jump.address], capture_output=True,
                                        text=True, timeout=30).stdout  # the gateway: on the lab's /30
    # the reference tool, with the same config (the jump host's key recorded by hand for it)
    (d / "ref_known_hosts").write_text("".join(f"{a} ssh-ed25519 {k}\n" for a, k in lab_keys(state).items()))
    cfg = (d / "ssh_config").read_text().replace(str(d / "admin_known_hosts"), str(d / "ref_known_hosts"))
    (d / "ref_config").write_text(cfg)
    r = subprocess.run(["ssh", "-F", str(d / "ref_config"), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                        "node2", "echo $SSH_CONNECTION"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split()[0] == state.gateway, r.stderr  # from the gateway's lab address


def test_trust_records_the_gateway_then_the_nodes_behind_it(glab) -> None:
    state, d, env = glab
    rc, res = clusterctl_json("trust", str(d / "bare.yaml"), "--yes", env=env, timeout=120)
    assert rc == 0, res
    assert [(n["host"], n["address"]) for n in res["nodes"] if n["jump"]] == [("gw (jump host)", state.jump.address)]
    assert all(n["recorded"] and n["status"] == "new" for n in res["nodes"]), res
    recorded = {line.split()[0]: line.split()[2] for line in (d / "admin_known_hosts").read_text().splitlines()}
    assert recorded == lab_keys(state)  # each key the one the PC really has (the lab made them)
    rc, again = clusterctl_json("trust", str(d / "bare.yaml"), "--yes", env=env, timeout=120)
    assert rc == 0 and {n["status"] for n in again["nodes"]} == {"known"}, again


def test_check_provision_launch_and_collect_through_the_gateway(glab) -> None:
    state, d, env = glab
    inv = str(d / "bare.yaml")
    if not (d / "admin_known_hosts").read_text():
        assert clusterctl("trust", inv, "--yes", env=env, timeout=120).returncode == 0
    rc, chk = clusterctl_json("check", inv, env=env, timeout=120)
    assert rc == 0, chk
    rc, res = clusterctl_json("provision", inv, "--set", f"python={sys.executable}", "--set",
                              "vars.python_env=existing", env=env, timeout=900)
    assert rc == 0, json.dumps(res)[-2000:]
    for job in ("resnet50-ddp", "resnet50-tf"):
        rc, rec = clusterctl_json("launch", job, "-i", inv, *TINY, env=env, timeout=900)
        assert rc == 0 and rec["state"] == "succeeded", json.dumps(rec)[-3000:]
        if job == "resnet50-ddp":  # the rendezvous on node1's lab address: the training traffic stays there
            assert rec["endpoint"].startswith(state.nodes[0].address + ":"), rec["endpoint"]
        rc, got = clusterctl_json("collect", rec["run_id"], env=env, timeout=300)
        assert rc == 0 and all(n["status"] == "ok" and n["files"] > 0 for n in got["nodes"]), got
    # a program's data over the relay's threshold: the head sends it once through the gateway, node to node after
    data = d / "big.csv"
    data.write_text("".join(f"{i},{i * i}\n" for i in range(1_500_000)))  # ~20 MiB
    rc, rec = clusterctl_json("launch", "-i", inv, "--code", str(ROOT / "tests" / "fixtures" / "own"), "--launcher",
                              "plain", "--data", str(data), "--", "python", "reads_data.py", env=env, timeout=600)
    assert rc == 0 and rec["state"] == "succeeded", json.dumps(rec)[-3000:]
    assert {v["via"] for v in rec["data"]["nodes"].values()} == {"relay"}, rec["data"]
    assert {v["bytes_sent"] for v in rec["data"]["nodes"].values()} == {data.stat().st_size}
    r = clusterctl("exec", inv, "--", "echo $SSH_CONNECTION; stat -c %U /srv/cluster", env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.count(f"{state.gateway} ") == 2, r.stdout  # both through the gateway
    assert r.stdout.count("student") == 2, r.stdout  # the root-owned /srv/cluster made the student's, by sudo -n


@pytest.mark.parametrize("args", [
    "'-o ProxyJump=root@{gw}'",
    "'-o ProxyCommand=\"ssh -W %h:%p -q -i {key} -o UserKnownHostsFile={kh} -o StrictHostKeyChecking=yes "
    "-o BatchMode=yes root@{gw}\"'",
])
def test_an_ansible_ini_inventory_reaches_the_nodes_through_its_ssh_args(glab, args: str) -> None:
    state, d, env = glab
    lab = Path(state.dir)
    common = args.format(gw=state.jump.address, key=lab / "id_ed25519", kh=lab / "known_hosts")
    ini = d / "hosts.ini"
    ini.write_text("[lab]\n" + "".join(f"{n.name} ansible_host={n.address}\n" for n in state.nodes) +
                   f"\n[lab:vars]\nansible_user=student\nansible_become=true\nansible_ssh_private_key_file={lab / 'id_ed25519'}\n"
                   f"ansible_ssh_common_args={common}\nclusterctl_known_hosts={lab / 'known_hosts'}\n"
                   "clusterctl_workdir=/srv/cluster\nclusterctl_ssh_config=none\n")
    rc, res = clusterctl_json("exec", str(ini), "--", "hostname", env={**env, "CLUSTERCTL_INVENTORY_READER": "ansible"},
                              timeout=120)
    assert rc == 0 and [n["stdout"].strip() for n in res["nodes"]] == ["node1", "node2"], res
    rc, got = clusterctl_json("hosts", "-i", str(ini), env={**env, "CLUSTERCTL_INVENTORY_READER": "ansible"}, timeout=60)
    assert rc == 0 and all(h["user"] == "student" for h in got["hosts"]), got


def test_with_become_launch_opens_a_blocking_firewall_for_the_run_and_closes_it_after(glab) -> None:
    """node1's nftables (in its own namespace) drop all but SSH, so node2 could not reach the rendezvous: the
    run gets one rule accepting TCP from the run's nodes only, tagged with its id, and the rule is gone when the run has
    ended; the lab's own rules stay."""
    state, d, env = glab
    inv = str(d / "bare.yaml")
    if not (d / "admin_known_hosts").read_text():
        assert clusterctl("trust", inv, "--yes", env=env, timeout=120).returncode == 0
    rc, _ = clusterctl_json("provision", inv, "--set", f"python={sys.executable}", "--set",
                            "vars.python_env=existing", env=env, timeout=900)
    assert rc == 0
    nft = ["ip", "netns", "exec", state.nodes[0].netns, "nft"]  # node1: the rendezvous the other dials
    for rule in ("add table inet filter", "add chain inet filter input { type filter hook input priority 0; policy drop; }",
                 "add rule inet filter input tcp dport 22 accept",
                 "add rule inet filter input ct state established,related accept"):
        subprocess.run([*nft, *rule.split()], check=True, timeout=30)
    try:
        rc, rec = clusterctl_json("launch", "resnet50-ddp", "-i", inv, *TINY, env=env, timeout=900)
        assert rc == 0 and rec["state"] == "succeeded", (rec.get("firewall"), json.dumps(rec)[-1500:])
        assert rec["firewall"] == {"node1": {"opened": [["inet", "filter", "input"]], "peers": [n.address for n in state.nodes]}}
        left = subprocess.run([*nft, "list", "chain", "inet", "filter", "input"], capture_output=True, text=True,
                              timeout=30).stdout
        assert rec["run_id"] not in left and "tcp dport 22 accept" in left and "policy drop" in left, left
    finally:
        subprocess.run([*nft, "flush", "ruleset"], timeout=30)


def test_a_run_whose_processes_are_killed_still_gets_its_firewall_rules_closed(glab, tmp_path: Path) -> None:
    """Both nodes drop all but SSH; the run's rules are inserted on both. node2's agent leader and program are
    SIGKILLed (as the OOM killer or a `pkill -9 python` would): nothing of the run on node2 can close its rule,
    so the verdict (`vanished`, the run failed) sends node2 the stop that closes it, with nobody watching but
    the run's watcher; the lab's own rules stay."""
    state, d, env = glab
    inv = str(d / "bare.yaml")
    if not (d / "admin_known_hosts").read_text():
        assert clusterctl("trust", inv, "--yes", env=env, timeout=120).returncode == 0
    rc, _ = clusterctl_json("provision", inv, "--set", f"python={sys.executable}", "--set",
                            "vars.python_env=existing", env=env, timeout=900)
    assert rc == 0
    nfts = [["ip", "netns", "exec", n.netns, "nft"] for n in state.nodes]
    for nft in nfts:
        for rule in ("add table inet filter",
                     "add chain inet filter input { type filter hook input priority 0; policy drop; }",
                     "add rule inet filter input tcp dport 22 accept",
                     "add rule inet filter input ct state established,related accept"):
            subprocess.run([*nft, *rule.split()], check=True, timeout=30)
    code = tmp_path / "sleeper"
    code.mkdir()
    (code / "train.py").write_text("import time\nfor _ in range(600):\n    time.sleep(1)\n")
    run_id = ""
    try:
        rc, rec = clusterctl_json("launch", "-i", inv, "--code", str(code), "--detach", "--", "python", "train.py",
                                  env=env, timeout=300)
        assert rc == 0 and rec["state"] == "running", json.dumps(rec)[-1500:]
        run_id = rec["run_id"]
        assert set(rec["firewall"]) == {"node1", "node2"}, rec["firewall"]

        def rules(i: int) -> str:
            return subprocess.run([*nfts[i], "list", "chain", "inet", "filter", "input"], capture_output=True,
                                  text=True, timeout=30).stdout

        assert run_id in rules(1)
        program = f"{state.nodes[1].dir}/srv/runs/{run_id}/program/train.py"

        def runs_program() -> bool:
            return any(b"train.py" in Path(f"/proc/{p}/cmdline").read_bytes() for p in procs_of(run_id, "node2"))

        wait_until(runs_program, 60, f"node2 running {program}", step=0.5)

        leader = json.loads((Path(program).parent.parent / "pid.json").read_text())["pgid"]
        os.kill(leader, signal.SIGKILL)  # the agent's leader first: it would close the rule when its program ends

        def killed() -> bool:  # all of them, again until none is left (a worker being spawned escapes one pass)
            for p in procs_of(run_id, "node2"):
                os.kill(p, signal.SIGKILL)
            return not procs_of(run_id, "node2")

        wait_until(killed, 30, "every process of the run on node2 killed", step=0.2)
        saved = Path(env["CLUSTERCTL_HOME"]) / "runs" / run_id / "run.json"
        wait_until(lambda: json.loads(saved.read_text())["state"] == "failed"
                   and not json.loads(saved.read_text())["stop_pending"], 180, "the run failed and stopped", step=1)
        left = [rules(0), rules(1)]
        assert all(run_id not in x and "tcp dport 22 accept" in x and "policy drop" in x for x in left), left
        rc, st = clusterctl_json("status", run_id, env=env, timeout=120)
        assert st["stop_results"]["node2"]["firewall"] == {"closed": True}, st
    finally:
        if run_id:
            clusterctl("stop", run_id, env=env, timeout=120)
        for nft in nfts:
            subprocess.run([*nft, "flush", "ruleset"], timeout=30)


def test_poweroff_through_sudo_and_wake_from_the_gateway(glab) -> None:
    """The nodes' networks are out of the head's reach: their magic packets go from the gateway PC (over its
    sshd), and poweroff goes through `sudo -n` as the login user."""
    state, d, env = glab
    inv = str(d / "bare.yaml")
    if not (d / "admin_known_hosts").read_text():
        assert clusterctl("trust", inv, "--yes", env=env, timeout=120).returncode == 0
    assert clusterctl("check", inv, env=env, timeout=120).returncode in (0, 1)  # records the MACs
    rc, off = clusterctl_json("poweroff", "node2", "-i", inv, env=env, timeout=180)
    assert rc == 0 and off["poweroff"][0]["status"] == "off", off
    assert clusterctl("exec", inv, "--limit", "node2", "--", "true", env=env).returncode == 3
    rc, woke = clusterctl_json("wake", "-i", inv, "--timeout", "60", env=env, timeout=180)
    assert rc == 0, woke
    by = {w["host"]: w for w in woke["wake"]}
    assert by["node1"]["status"] == "up" and by["node2"]["status"] == "woke"
    assert by["node2"]["sent_from"] == "gw (jump host)" and by["node2"]["broadcast"].endswith(".255")
    assert clusterctl("exec", inv, "--limit", "node2", "--", "true", env=env).returncode == 0
