"""Would a node's host firewall let the run's traffic in? Read from `nft -j list ruleset` (nftables, which
ufw and firewalld write underneath on Debian and Ubuntu), judged for the packet a run needs accepted.

A run opens TCP connections from the other nodes to ports that are not known in advance (torchrun's
rendezvous and the relay pick free ports, gloo and NCCL pick their own). So the question is: is a new TCP
connection from a peer of the lab network, to any port, accepted by every `input` base chain? Each rule is
read as matching that packet always, sometimes (a port match: some ports), or never; anything the reader
does not know (a jump to another chain, a set lookup, a match it has no model of) makes the answer
"unknown", said as such, never guessed. Tested on recorded `nft -j` output.
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

ALWAYS, SOMETIMES, NEVER, UNKNOWN = "always", "sometimes", "never", "unknown"


@dataclass(frozen=True)
class Verdict:
    state: str  # open | blocked | partly | unknown | none (no nftables rules)
    why: str = ""


def _match(m: dict[str, Any], peers: list[str], nic: str | None) -> str:
    left, right, op = m.get("left", {}), m.get("right"), m.get("op", "==")
    if "payload" in left:
        field = f"{left['payload'].get('protocol')}.{left['payload'].get('field')}"
        if field in ("tcp.dport", "th.dport"):
            return SOMETIMES  # some ports (the run's are not known in advance)
        if field == "ip.saddr" and op in ("==", "in"):
            nets = right.get("set", [right]) if isinstance(right, dict) else right if isinstance(right, list) else [right]
            try:
                inside = [any(ipaddress.ip_address(p) in _net(n) for n in nets) for p in peers]
            except (ValueError, TypeError, KeyError):
                return UNKNOWN
            return ALWAYS if inside and all(inside) else NEVER if not any(inside) else SOMETIMES
        if field in ("udp.dport", "udp.sport", "icmp.type", "ip6.saddr"):
            return NEVER  # not the run's TCP over IPv4
        return UNKNOWN
    if "ct" in left and left["ct"].get("key") == "state":
        states = right if isinstance(right, list) else [right]
        return ALWAYS if "new" in states and op in ("==", "in") else NEVER if op in ("==", "in") else UNKNOWN
    if "meta" in left and left["meta"].get("key") in ("l4proto", "nfproto"):
        value = right if isinstance(right, str) else None
        if value in ("tcp", "ipv4", "inet"):
            return ALWAYS if op == "==" else NEVER
        if value is not None:
            return NEVER if op == "==" else ALWAYS
        return UNKNOWN
    if "meta" in left and left["meta"].get("key") in ("iifname", "iif"):
        if right == "lo":
            return NEVER if op == "==" else ALWAYS
        if nic and right == nic:
            return ALWAYS if op == "==" else NEVER
        return UNKNOWN
    return UNKNOWN


def _net(n: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    if isinstance(n, dict) and "prefix" in n:
        return ipaddress.ip_network(f"{n['prefix']['addr']}/{n['prefix']['len']}", strict=False)
    return ipaddress.ip_network(str(n), strict=False)


def _rule(expr: list[dict[str, Any]], peers: list[str], nic: str | None) -> tuple[str, str | None]:
    """(how often the rule matches the run's packet, its verdict: accept | drop | None for none)."""
    how, verdict = ALWAYS, None
    for e in expr:
        if "match" in e:
            got = _match(e["match"], peers, nic)
            if got == NEVER:
                return NEVER, None
            if got == UNKNOWN:
                how = UNKNOWN
            elif got == SOMETIMES and how == ALWAYS:
                how = SOMETIMES
        elif "accept" in e:
            verdict = "accept"
        elif "drop" in e or "reject" in e:
            verdict = "drop"
        elif any(k in e for k in ("jump", "goto", "queue")):
            return UNKNOWN, "unknown"
        elif any(k in e for k in ("counter", "log", "limit", "comment")):
            continue
        else:
            return UNKNOWN, "unknown"
    return how, verdict


def judge(ruleset: dict[str, Any], peers: list[str], nic: str | None = None) -> Verdict:
    """The verdict of every filter chain on the input hook for a new TCP connection from `peers`."""
    items = ruleset.get("nftables", [])
    chains = [i["chain"] for i in items if "chain" in i and i["chain"].get("hook") == "input"
              and i["chain"].get("type", "filter") == "filter"]
    if not chains:
        return Verdict("none")
    worst = Verdict("open")
    for c in chains:
        key = (c.get("family"), c.get("table"), c.get("name"))
        rules = [i["rule"] for i in items if "rule" in i and (i["rule"].get("family"), i["rule"].get("table"),
                                                              i["rule"].get("chain")) == key]
        v = _chain(c, rules, peers, nic)
        if v.state in ("blocked", "unknown") or (v.state == "partly" and worst.state == "open"):
            worst = v
        if v.state == "blocked":
            break
    return worst


def _chain(c: dict[str, Any], rules: list[dict[str, Any]], peers: list[str], nic: str | None) -> Verdict:
    name = f"{c.get('family')} {c.get('table')} {c.get('name')}"
    partly: str | None = None
    for r in rules:
        how, verdict = _rule(r.get("expr", []), peers, nic)
        if verdict == "unknown" or (how == UNKNOWN and verdict in ("accept", "drop")):
            return Verdict("unknown", f"chain {name}: rule {r.get('handle')} is not one clusterctl can read")
        if how == ALWAYS and verdict == "accept":
            return Verdict("partly", partly) if partly else Verdict("open")
        if how == ALWAYS and verdict == "drop":
            return Verdict("blocked", f"chain {name}: rule {r.get('handle')} drops TCP from the other nodes")
        if how == SOMETIMES and verdict == "drop":
            partly = f"chain {name}: rule {r.get('handle')} drops some ports"
    if c.get("policy", "accept") == "drop":
        return Verdict("blocked", f"chain {name} drops by default (policy drop) what no rule accepts: the run's "
                       "ports are picked at start (torchrun's rendezvous, gloo, the relay)")
    return Verdict("partly", partly) if partly else Verdict("open")


def is_ip(a: str) -> bool:
    """An IP address (not a DNS name): what a saddr rule can name."""
    try:
        ipaddress.ip_address(a)
    except ValueError:
        return False
    return True


def parse(out: str, rc: int) -> dict[str, Any]:
    """The fact: {"state": absent | unreadable | ok, "ruleset": the JSON when ok, "error": ...}."""
    if "@@absent" in out:
        return {"state": "absent"}
    if rc != 0:
        return {"state": "unreadable", "error": out.strip()[-300:]}
    try:
        return {"state": "ok", "ruleset": json.loads(out)}
    except ValueError:
        return {"state": "unreadable", "error": out.strip()[-300:]}


COMMAND = ('if [ -x /usr/sbin/nft ] || command -v nft >/dev/null 2>&1; then env PATH="$PATH:/usr/sbin:/sbin" nft -j '
           "list ruleset; else echo @@absent; fi")  # /usr/sbin: on no ordinary user's PATH
FIX = ("accept the lab network before the rules that drop, e.g. `nft insert rule inet filter input ip saddr "
       "10.0.0.0/24 accept` (or `ufw allow from 10.0.0.0/24`), with the lab's own subnet")


def chains_to_open(ruleset: dict[str, Any], peers: list[str], nic: str | None = None) -> list[tuple[str, str, str]]:
    """The input chains (family, table, chain) of families that match IPv4 whose rules would stop TCP from
    `peers` (each chain judged alone): where a rule accepting them has to go."""
    out = []
    for item in ruleset.get("nftables", []):
        c = item.get("chain")
        if not c or c.get("hook") != "input" or c.get("type", "filter") != "filter" or c.get("family") not in ("ip", "inet"):
            continue
        one = {"nftables": [i for i in ruleset["nftables"] if "chain" not in i or i["chain"] is c]}
        if judge(one, peers, nic).state != "open":
            out.append((str(c["family"]), str(c["table"]), str(c["name"])))
    return out
