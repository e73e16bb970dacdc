"""The lab's network: one namespace per node, a veth into the lab's bridge, found and removed by name.

Everything a lab owns carries its name (`<name>-nN`, `<name>-vN`, `<name>-br`, `<name>-ifb`), so a crashed
run's leftovers are found again; the host's own routes, firewall and interfaces are never touched.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shlex
import signal
import socket
import subprocess
import time

from cluster.errors import LabError
from cluster.lab.state import NodeState


def sh(*args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a host command (argv, never a shell string)."""
    proc = subprocess.run(args, capture_output=True, text=True, input=input, timeout=120)
    if check and proc.returncode != 0:
        raise LabError(f"`{shlex.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def subnet_in_use(net: ipaddress.IPv4Network, own_bridge: str) -> str | None:
    out = sh("ip", "-o", "-4", "addr", "show").stdout
    for line in out.splitlines():
        parts = line.split()
        dev, cidr = parts[1], parts[3]
        if dev != own_bridge and ipaddress.IPv4Interface(cidr).network.overlaps(net):
            return dev
    return None


def start_links(node: NodeState, bridge: str, prefix: int) -> None:
    """The node's namespace, its eth0 (a veth whose other end is on the bridge) and its address."""
    ns = node.netns
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    sh("ip", "link", "set", node.veth, "master", bridge, "up")
    sh("ip", "-n", ns, "addr", "add", f"{node.address}/{prefix}", "dev", "eth0")
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "-n", ns, "link", "set", "eth0", "up")


def start_gateway_links(jump: NodeState, bridge: str, inner: str, prefix: int, outer_head: str) -> None:
    """The gateway PC's namespace: eth0 on the lab's bridge (`inner`), uplink0 on a /30 of its own to the
    head (`jump.address`; the head's end `<name>-gwv` has `outer_head`). It forwards nothing: the head
    reaches the nodes only through its sshd, as through a lab's gateway PC."""
    ns = jump.netns
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", jump.veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    sh("ip", "link", "set", jump.veth, "master", bridge, "up")
    sh("ip", "-n", ns, "addr", "add", f"{inner}/{prefix}", "dev", "eth0")
    up_head = jump.veth.replace("-vg", "-gwv")
    sh("ip", "link", "add", up_head, "type", "veth", "peer", "name", "uplink0", "netns", ns)
    sh("ip", "addr", "add", f"{outer_head}/30", "dev", up_head)
    sh("ip", "link", "set", up_head, "up")
    sh("ip", "-n", ns, "addr", "add", f"{jump.address}/30", "dev", "uplink0")
    for dev in ("lo", "eth0", "uplink0"):
        sh("ip", "-n", ns, "link", "set", dev, "up")
    sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=0")


def answers(ns: str | None, address: str, port: int = 22, timeout: float = 1.0) -> bool:
    """Whether address:port accepts a TCP connection as seen from the head (`ns` None) or from inside namespace
    `ns` (the gateway's: the head has no route to a gateway lab's nodes)."""
    import sys

    if ns is None:
        try:
            with socket.create_connection((address, port), timeout=timeout):
                return True
        except OSError:
            return False
    probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3]))"
    return sh("ip", "netns", "exec", ns, sys.executable, "-c", probe, address, str(port), str(timeout),
              check=False).returncode == 0


ANY_LAB = "[a-z][a-z0-9]{0,7}"  # lifecycle.NAME_RE: what prefixes a lab's namespaces and links


def netns_list(name: str | None) -> list[str]:
    """Lab `name`'s network namespaces on this machine; None: every lab's."""
    out = sh("ip", "netns", "list", check=False).stdout
    pat = re.compile(rf"^{_prefix(name)}-(n\d+|gw|sl)$")  # sl: a --slurm lab's login node
    return [line.split()[0] for line in out.splitlines() if line.split() and pat.match(line.split()[0])]


def links(name: str | None) -> list[str]:
    """Lab `name`'s links on this machine; None: every lab's."""
    out = sh("ip", "-o", "link", "show", check=False).stdout
    pat = re.compile(rf"^{_prefix(name)}-(br|ifb|v\d+|vg|gwv|vs)$")  # vs: the login node's link
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if pat.match(n)]


def _prefix(name: str | None) -> str:
    return ANY_LAB if name is None else re.escape(name)


def kill_netns(ns: str, spare: int | None = None) -> None:
    """End every process whose network namespace is `ns` (sshd, sessions, training jobs), but `spare` (a node
    switching itself off: the process that then waits for its magic packet)."""
    def pids() -> list[int]:
        return [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split() if int(p) != spare]

    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        if not pids():
            return
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pids():
            time.sleep(0.05)
