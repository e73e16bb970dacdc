"""Wake the room's PCs and switch them off: old PCs are off when nobody is in the room.

A node's MAC comes from the inventory's `mac:`, else from the last facts gathered from it (`check`,
`provision`, a run's collect: each node's address NIC, recorded on the head per inventory). Magic packets go
from the head where the head has an address on the node's network, else from the node's last jump host (the
gateway PC, over SSH, with cluster/nodes/wolsend.py as its program) — always to that network's directed
broadcast address (wolsend's rules), never 255.255.255.255 through a default route. A node is awake when it
answers SSH as launch reaches it (host key verified), and every wait has its bound.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cluster import paths
from cluster.errors import UsageError
from cluster.inventory.model import MAC_RE, Host, Inventory, normalize_mac
from cluster.nodes import wolsend
from cluster.nodes.fanout import Group
from cluster.transport import transport_for

WAKE_TIMEOUT_S = 180.0  # an old PC's POST, boot and sshd: one to two minutes
POWEROFF_TIMEOUT_S = 120.0
RESEND_S = 15.0  # a magic packet is one UDP datagram: sent again while a node has not answered
POLL_S = 1.0
Log = Callable[[str], None]


def record_path(inv: Inventory) -> Path:
    return paths.home() / "state" / f"{paths.inventory_key(inv.name, inv.path)}.macs.json"


def recorded(inv: Inventory) -> dict[str, dict[str, Any]]:
    """What the facts recorded (`check`, `provision`, a run's collect): node -> {mac, nic, address, checked}."""
    p = record_path(inv)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return doc.get("nodes", {}) if isinstance(doc, dict) else {}


def record(inv: Inventory, node_facts: dict[str, Any]) -> dict[str, str]:
    """Keep each answering node's MAC on its inventory address's NIC (for `wake` once it is off); the nodes
    these facts do not cover keep what earlier ones recorded. Returns node -> MAC recorded now."""
    nodes = recorded(inv)
    now: dict[str, str] = {}
    for name, nf in node_facts.items():
        mac = (nf.values.get("macs") or {}).get(nf.address_nic or "")
        mac = normalize_mac(mac) if isinstance(mac, str) else None
        if mac is None:
            continue
        nodes[name] = {**nodes.get(name, {}), "mac": mac, "nic": nf.address_nic, "address": inv.hosts[name].address,
                       "checked": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        now[name] = mac
    if now:
        p = record_path(inv)
        p.parent.mkdir(parents=True, exist_ok=True)
        paths.write_atomic(p, json.dumps({"inventory": str(inv.path), "nodes": nodes}, indent=1, sort_keys=True) + "\n")
    return now


def record_wakes(inv: Inventory, results: list[PowerResult]) -> None:
    """Keep each woken node's slowest wake (seconds from the first packet to its SSH answer) beside its MAC:
    a room's Slurm gives a woken PC 1.5x the slowest as its ResumeTimeout (cluster.room.power)."""
    nodes = recorded(inv)
    woke = {r.host: r.seconds for r in results if r.status == "woke"}
    for name, s in woke.items():
        node = nodes.setdefault(name, {})
        node["wake_s"] = max(s, float(node.get("wake_s") or 0))
    if woke:
        record_path(inv).parent.mkdir(parents=True, exist_ok=True)
        paths.write_atomic(record_path(inv), json.dumps({"inventory": str(inv.path), "nodes": nodes}, indent=1,
                                                        sort_keys=True) + "\n")


def mac_of(inv: Inventory, host: Host) -> tuple[str, str] | None:
    """(MAC, where it came from): the inventory's `mac:` wins over what the facts recorded."""
    if host.mac:
        return host.mac, "inventory"
    got = recorded(inv).get(host.name, {}).get("mac")
    return (got, "recorded") if isinstance(got, str) and MAC_RE.match(got) else None


@dataclass
class PowerResult:
    """One node's outcome of `wake` or `poweroff`: status, seconds it took, and the fix where it failed."""

    host: str
    status: str  # wake: up | woke | no-answer | no-mac | not-sent; poweroff: off | still-on | unreachable | failed
    seconds: float = 0.0
    mac: str | None = None
    mac_from: str | None = None
    sent_from: str | None = None  # "head" or the gateway's name
    broadcast: str | None = None
    packets: int = 0
    error: str | None = None
    fix: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("up", "woke", "off")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


def answering(hosts: list[Host], forks: int = 32) -> set[str]:
    """The hosts that answer SSH now (a login with the host key verified, `true` run), each within its own
    connect_timeout."""
    if not hosts:
        return set()
    with Group(hosts, forks=forks) as g:
        return {n for n, r in g.run("true", timeout=30).items() if r.ok}


def _gateway(host: Host) -> Host | None:
    """The PC that sends a node's packet when the head is not on its network: its last jump host."""
    if not host.jumps:
        return None
    last = host.jumps[-1]
    return dataclasses.replace(last, jumps=tuple(host.jumps[:-1]))


def _send(hosts: list[Host], macs: dict[str, str], log: Log) -> dict[str, dict[str, Any]]:
    """Send each node's packet from the head, or from its gateway where the head has no address on its
    network; node -> wolsend's result (with `sent_from`)."""
    out: dict[str, dict[str, Any]] = {}
    local = wolsend.send([(h.address, macs[h.name]) for h in hosts])
    for h, r in zip(hosts, local):
        out[h.name] = {**r, "sent_from": "head"}
    by_gateway: dict[str, tuple[Host, list[Host]]] = {}
    for h in hosts:
        gw = _gateway(h)
        if not out[h.name]["sent"] and gw is not None:
            by_gateway.setdefault(gw.name + gw.address, (gw, []))[1].append(h)
    source = Path(wolsend.__file__).read_text()
    for gw, nodes in by_gateway.values():
        args = " ".join(shlex.quote(f"{h.address}={macs[h.name]}") for h in nodes)
        try:
            with transport_for(gw) as t:
                ran = t.run(f"python3 - {args}", timeout=30, stdin=source.encode())
            lines = [json.loads(x) for x in ran.stdout.splitlines() if x.startswith("{")]
            if ran.exit_code != 0 or len(lines) != len(nodes):
                raise RuntimeError((ran.stderr or ran.stdout).strip()[-300:] or f"exit {ran.exit_code}")
        except Exception as e:  # noqa: BLE001 - the gateway's failure is these nodes' result, not a crash
            lines = [{"address": h.address, "mac": macs[h.name], "sent": False,
                      "error": f"sending from the gateway {gw.name} ({gw.address}) failed: {e}"} for h in nodes]
        for h, sent in zip(nodes, lines):
            out[h.name] = {**sent, "sent_from": gw.name}
    for h in hosts:
        o = out[h.name]
        log(f"{h.name}: magic packet for {macs[h.name]} " + (f"sent from {o['sent_from']} to {o['broadcast']}:9"
                                                              if o["sent"] else f"not sent: {o['error']}"))
    return out


def wake(inv: Inventory, hosts: list[Host], timeout: float = WAKE_TIMEOUT_S, forks: int = 32,
         log: Log = lambda s: None) -> list[PowerResult]:
    """Wake the hosts that do not answer SSH and wait until they do, at most `timeout` seconds; those that
    answer already are `up`, untouched. One result per host, in the order given."""
    if not 0 < timeout <= 3600:
        raise UsageError(f"--wake-timeout {timeout:g}: expected seconds in (0, 3600]", "e.g. --wake-timeout 180")
    t0 = time.monotonic()
    results = {h.name: PowerResult(h.name, "up") for h in hosts}
    asleep = [h for h in hosts if h.name not in answering(hosts, forks)]
    macs: dict[str, str] = {}
    for h in asleep:
        got = mac_of(inv, h)
        if got is None:
            results[h.name] = PowerResult(h.name, "no-mac", error="no MAC known for this node",
                                          fix="run `clusterctl check` (or provision) once while it is on (it "
                                              "records the MAC), or set `mac:` for it in the inventory")
            continue
        macs[h.name], results[h.name].mac_from = got
        results[h.name].mac = got[0]
    pending = [h for h in asleep if h.name in macs]
    last_sent = -RESEND_S
    while pending:
        if time.monotonic() - last_sent >= RESEND_S:
            last_sent = time.monotonic()
            for name, r in _send(pending, macs, log).items():
                res = results[name]
                res.sent_from, res.broadcast = r.get("sent_from"), r.get("broadcast")
                res.packets += 3 if r["sent"] else 0
                if not r["sent"]:
                    res.status, res.error = "not-sent", r["error"]
                    res.fix = ("run `clusterctl wake` on a PC of that network, or reach the node through a gateway "
                               "on it (proxy_jump)")
            pending = [h for h in pending if results[h.name].status != "not-sent"]
        up = answering(pending, forks)
        for h in pending:
            if h.name in up:
                results[h.name].status, results[h.name].seconds = "woke", round(time.monotonic() - t0, 1)
                log(f"{h.name}: answers SSH after {results[h.name].seconds:g} s")
        pending = [h for h in pending if h.name not in up]
        if pending and time.monotonic() - t0 >= timeout:
            for h in pending:
                late = results[h.name]
                late.status, late.seconds = "no-answer", round(time.monotonic() - t0, 1)
                late.error = f"sent {late.packets} magic packets; no SSH answer within {timeout:g} s"
                late.fix = ("check that Wake-on-LAN is on in the PC's firmware (and `ethtool -s IFACE wol g` in its OS), "
                         "that it has power, and its MAC; or switch it on by hand")
            break
        if pending:
            time.sleep(POLL_S)
    record_wakes(inv, list(results.values()))
    return [results[h.name] for h in hosts]


def poweroff_command(host: Host) -> str:
    """Power off a moment after the SSH session returns (its reply is not lost with the link), through
    `sudo -n` with become; `poweroff` where it exists, else systemd's."""
    sudo = "sudo -n " if host.become else ""
    inner = f"sleep 1; {sudo}poweroff || {sudo}systemctl poweroff"
    probe = f"{sudo}true" if sudo else "true"
    return f"{probe} && (nohup sh -c {shlex.quote(inner)} >/dev/null 2>&1 &) && echo powering-off"


def poweroff(hosts: list[Host], timeout: float = POWEROFF_TIMEOUT_S, forks: int = 32,
             log: Log = lambda s: None) -> list[PowerResult]:
    """Power the hosts off (their results must already be on the head: the caller's duty) and wait, at
    most `timeout`, until each stops answering SSH."""
    t0 = time.monotonic()
    by_name = {h.name: h for h in hosts}
    results: dict[str, PowerResult] = {}
    with Group(hosts, forks=forks) as g:
        for name, r in g.run(poweroff_command).items():
            if r.ok:
                results[name] = PowerResult(name, "still-on")
            elif r.status == "unreachable":
                results[name] = PowerResult(name, "unreachable", error=r.error, fix=r.fix)
            else:
                h = by_name[name]
                text = (r.stderr or r.stdout or r.error or "").strip()[-300:]
                results[name] = PowerResult(name, "failed", error=f"poweroff failed: {text}", fix=(
                    f"let {h.user} power off without a password (sudoers: `{h.user} ALL=(root) NOPASSWD: "
                    "/usr/sbin/poweroff, /usr/bin/systemctl poweroff`) and set become: true"))
    going = [h for h in hosts if results[h.name].status == "still-on"]
    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(going) or 1))) as pool:
        for h, off in zip(going, pool.map(lambda h: _wait_off(h, t0 + timeout), going)):
            res = results[h.name]
            res.seconds = round(time.monotonic() - t0, 1)
            if off:
                res.status = "off"
                log(f"{h.name}: off after {res.seconds:g} s")
            else:
                res.error, res.fix = f"still answers SSH {timeout:g} s after poweroff", "switch it off by hand"
    return [results[h.name] for h in hosts]


def _wait_off(host: Host, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if not answering([host]):
            return True
        time.sleep(POLL_S)
    return False
