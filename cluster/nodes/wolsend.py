"""Send Wake-on-LAN magic packets from this PC onto the network that holds each node's address.

Standalone (stdlib only): the head imports it, and `clusterctl wake` pipes this file's source to
`python3 -` on a gateway PC when the nodes sit behind one. Usage there: `python3 - ADDRESS=MAC ...`;
prints one JSON line per node.

The packet goes to UDP port 9 of the *directed* broadcast address of the local network that contains the
node's address, sent from this PC's own address on that network, so it leaves through that interface.
Never 255.255.255.255 and never through a default route: a node on no network of this PC is refused.
"""
from __future__ import annotations

import ipaddress
import json
import socket
import struct
import subprocess
import sys
from typing import Any

WOL_PORT = 9
IP_PKTINFO_LINUX = 8  # <linux/in.h>; Python's socket module does not export it


def magic_packet(mac: str) -> bytes:
    """Six 0xff bytes, then the MAC sixteen times (AMD's Magic Packet format)."""
    raw = bytes.fromhex(mac.replace(":", "").replace("-", ""))
    if len(raw) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    return b"\xff" * 6 + raw * 16


def local_networks(ip_output: str) -> list[tuple[str, ipaddress.IPv4Interface]]:
    """`ip -o -4 addr show` -> (interface, address/prefix) for every IPv4 address of this PC."""
    nets = []
    for line in ip_output.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":
            nets.append((parts[1].split("@")[0], ipaddress.IPv4Interface(parts[3])))
    return nets


def route_for(address: str, nets: list[tuple[str, ipaddress.IPv4Interface]]) -> tuple[str, str, str] | None:
    """(interface, source address, directed broadcast) of the local network holding `address`; None when
    no network of this PC holds it, or it has no broadcast (a /31 or /32 point-to-point link)."""
    ip = ipaddress.IPv4Address(address)
    for dev, iface in sorted(nets, key=lambda n: -n[1].network.prefixlen):  # the narrowest network first
        net = iface.network
        if ip in net and net.prefixlen <= 30 and not ip.is_loopback:
            return dev, str(iface.ip), str(net.broadcast_address)
    return None


def _send_on(s: socket.socket, dev: str, payload: bytes, broadcast: str) -> None:
    """sendto through interface `dev` (IP_PKTINFO's ifindex: no privilege needed), so that a broadcast
    address another local network also covers (a gateway's uplink inside the lab's range) leaves the right
    way; plain sendto where the platform has no IP_PKTINFO."""
    pktinfo = getattr(socket, "IP_PKTINFO", IP_PKTINFO_LINUX if sys.platform.startswith("linux") else None)
    if pktinfo is None:
        s.sendto(payload, (broadcast, WOL_PORT))
        return
    info = struct.pack("@i4s4s", socket.if_nametoindex(dev), bytes(4), bytes(4))
    s.sendmsg([payload], [(socket.IPPROTO_IP, pktinfo, info)], 0, (broadcast, WOL_PORT))


def send(pairs: list[tuple[str, str]], ip_output: str | None = None) -> list[dict[str, Any]]:
    """One magic packet (three copies: UDP may drop one) per (address, MAC); one result per node."""
    if ip_output is None:
        ip_output = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                                   timeout=10).stdout
    nets = local_networks(ip_output)
    results = []
    for address, mac in pairs:
        where = route_for(address, nets)
        if where is None:
            results.append({"address": address, "mac": mac, "sent": False,
                            "error": f"{address} is on no network of this PC (its networks: "
                                     f"{', '.join(str(n.network) for _, n in nets) or 'none'})"})
            continue
        dev, source, broadcast = where
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
                s.bind((source, 0))
                for _ in range(3):
                    _send_on(s, dev, magic_packet(mac), broadcast)
        except OSError as e:
            results.append({"address": address, "mac": mac, "sent": False, "error": f"sending failed: {e}"})
            continue
        results.append({"address": address, "mac": mac, "sent": True, "interface": dev, "source": source,
                        "broadcast": broadcast, "port": WOL_PORT})
    return results


if __name__ == "__main__":
    for r in send([tuple(a.split("=", 1)) for a in sys.argv[1:]]):  # type: ignore[misc]
        print(json.dumps(r))
