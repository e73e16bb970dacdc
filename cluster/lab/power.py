"""A lab node's power: off (everything in its namespace stops, as a PC's power cut) and on again, by hand or
by a Wake-on-LAN magic packet, as a PC whose NIC listens while it is off.

`power_off` ends every process of the node's network namespace and leaves one listener there (`python -m
cluster.lab.power listen ...`), bound to UDP port 9 on the node's address network; it powers the node on
(its sshd started again, as at boot) only when a datagram holding a correct magic packet for the node's own
MAC arrives from the lab's bridge, and then exits. Inside every node's mount namespace the PC's own
`poweroff`, `shutdown`, `halt` and `systemctl poweroff` are this lab's switch (`power_bin`): nothing a test
runs on a node can power off this machine.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from cluster.errors import LabError
from cluster.lab.net import kill_netns, sh
from cluster.lab.state import LabState, NodeState, find_node, load_state, save_state

WOL_PORT = 9
def mac_of(node: NodeState) -> str:
    """The node's eth0 Ethernet address (its namespace keeps it while the node is off)."""
    out = sh("ip", "-n", node.netns, "-o", "link", "show", "eth0").stdout
    words = out.split()
    return words[words.index("link/ether") + 1].lower()


def _record(state: LabState, node: NodeState, **fields: object) -> None:
    """Set a node's power fields in `state` and in lab.json, under a lock: nodes switch off at once (a
    study's --poweroff-after), each process writing the whole file, and none may undo another's change."""
    for k, v in fields.items():
        setattr(node, k, v)
    with open(Path(state.dir) / "lab.json.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = load_state(state.name, Path(state.dir))
        if current is None:
            raise LabError(f"lab {state.name} is gone ({state.dir})")
        mine = next(n for n in current.nodes if n.name == node.name)
        for k, v in fields.items():
            setattr(mine, k, v)
        save_state(current)


def power_off(state: LabState, which: str) -> NodeState:
    """Switch a node off from the head: every process in its namespace ends (sshd, its sessions, training,
    slurmd); a Wake-on-LAN listener for its MAC takes their place. Off already: nothing changes."""
    node = find_node(state, which)
    if node.power == "off":
        return node
    mac = mac_of(node)
    kill_netns(node.netns)
    _record(state, node, pid=None, power="off")
    log = open(Path(node.dir) / "power.log", "ab")  # noqa: SIM115 - the listener's own, it outlives this call
    proc = subprocess.Popen(["ip", "netns", "exec", node.netns, sys.executable, "-m", "cluster.lab.power", "listen",
                             node.name, "--name", state.name, "--dir", state.dir, "--mac", mac],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    log.close()
    ready = Path(node.dir) / "wol-listening"
    deadline = time.monotonic() + 10
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise LabError(f"{node.name}'s Wake-on-LAN listener did not start; see {Path(node.dir) / 'power.log'}")
        time.sleep(0.05)
    _record(state, node, listener=proc.pid)
    return node


def power_on(state: LabState, which: str) -> NodeState:
    """Switch a node on (the power button): its sshd starts as at boot. On already: nothing changes."""
    from cluster.lab import sshd

    node = find_node(state, which)
    if node.power != "off":
        return node
    if node.listener:
        try:
            os.kill(node.listener, 15)
        except ProcessLookupError:
            pass
    sshd.start_node_sshd(state, node)
    _record(state, node, pid=node.pid, power="on", listener=None)
    return node


def switch_off(state: LabState, which: str) -> None:
    """The node's own poweroff (its switch script, run on the node): every other process of its namespace
    ends, and this one stays as the listener for its magic packet."""
    node = find_node(state, which)
    mac = mac_of(node)
    kill_netns(node.netns, spare=os.getpid())
    _record(state, node, pid=None, power="off", listener=os.getpid())
    listen(node.name, state.name, state.dir, mac)


def is_magic(payload: bytes, mac: str) -> bool:
    """Whether a datagram holds a magic packet for `mac`: six 0xff then the MAC sixteen times (anywhere in it,
    as NICs look for it)."""
    raw = bytes.fromhex(mac.replace(":", ""))
    return b"\xff" * 6 + raw * 16 in payload


def listen(node_name: str, lab: str, lab_dir: str, mac: str) -> None:
    """Run in the node's namespace while it is off: wait for its magic packet, then power it on and exit.
    Other datagrams (another node's packet, noise) are ignored; `lab down` or `power on` ends the wait."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", WOL_PORT))
        ready = Path(lab_dir) / node_name / "wol-listening"
        ready.touch()
        try:
            while True:
                payload, sender = s.recvfrom(2048)
                if is_magic(payload, mac):
                    print(f"{time.strftime('%H:%M:%S')} magic packet for {mac} from {sender[0]}: powering on",
                          flush=True)
                    break
        finally:
            ready.unlink(missing_ok=True)
    # setns out of this namespace is not needed: sshd is started through `ip netns exec` of the node's own
    state = load_state(lab, Path(lab_dir))
    if state is None:
        raise LabError(f"lab {lab} is gone ({lab_dir})")
    node = find_node(state, node_name)
    node.listener = None  # this process: power_on must not signal it
    power_on(state, node_name)


def main(argv: list[str] | None = None) -> int:
    """`python -m cluster.lab.power switch|listen NODE --name LAB --dir DIR`: the node's switch script and its
    listener call this (the CLI's `clusterctl lab power` is the user's way)."""
    p = argparse.ArgumentParser(prog="python -m cluster.lab.power")
    p.add_argument("action", choices=("switch", "listen"))
    p.add_argument("node")
    p.add_argument("--name", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--mac")
    a = p.parse_args(argv)
    if a.action == "listen":
        listen(a.node, a.name, a.dir, a.mac)
        return 0
    time.sleep(0.5)  # the switch's caller (sudo poweroff in an SSH session) gets its answer first
    state = load_state(a.name, Path(a.dir))
    if state is None:
        raise LabError(f"lab {a.name} is gone ({a.dir})")
    switch_off(state, a.node)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
