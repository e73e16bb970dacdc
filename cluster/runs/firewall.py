"""A node's host firewall opened for one run and closed after it (with `become`).

A run's ports are picked at start (torchrun's rendezvous, gloo's and NCCL's own), so a firewall that drops
what it does not know would stop it (cluster/nodes/firewall.py judges that, from `nft -j list ruleset`).
Where it would, and the node has `become`, launch inserts one rule at the top of each such `input` chain:
TCP from exactly the run's other nodes is accepted, tagged with the run's id; the node agent removes the
rules tagged so (the run's `firewall-close.sh`) when the run ends, is stopped or is killed, and `clusterctl
stop` does too. Without `become`, launch refuses, naming the fix.
"""
from __future__ import annotations

import shlex
from typing import Any

from cluster.inventory.model import Host
from cluster.nodes import firewall as judge
from cluster.nodes.fanout import Group

chains_to_open = judge.chains_to_open  # the judging is the nodes' (room/ opens Slurm's ports with it too)
CLOSE = "firewall-close.sh"  # in the run folder: the node agent runs it when the run ends


def tag(run_id: str) -> str:
    return f"clusterctl {run_id}"


def _sudo(h: Host) -> str:
    return "sudo -n " if h.become else ""


def nft(h: Host) -> str:
    """nft as the node runs it: through `sudo -n` with `become`; /usr/sbin is on no ordinary user's PATH."""
    return f'{_sudo(h)}env PATH="$PATH:/usr/sbin:/sbin" nft'


def probe(h: Host) -> str:
    return f"if [ -x /usr/sbin/nft ] || command -v nft >/dev/null 2>&1; then {nft(h)} -j list ruleset; else echo @@absent; fi"


def close_script(h: Host, run_id: str, chains: list[tuple[str, str, str]]) -> str:
    """Removes exactly the rules tagged with this run (by handle), wherever they are; safe to run again."""
    pick = shlex.quote('s/.*comment "' + tag(run_id) + '" # handle \\([0-9]*\\)$/\\1/p')
    lines = ["#!/bin/sh", f"# written by clusterctl launch: removes the firewall rules it inserted for {run_id}"]
    mark = shlex.quote(f'comment "{tag(run_id)}"')
    lines.append("left=")
    for fam, table, chain in chains:
        c = " ".join(shlex.quote(x) for x in (fam, table, chain))
        lines.append(f"{nft(h)} -a list chain {c} 2>/dev/null | sed -n {pick} | "
                     f'while read -r handle; do {nft(h)} delete rule {c} handle "$handle"; done')
        # what is still there is said (exit 1), so that the head can name the rule it could not close
        lines.append(f"if {nft(h)} list chain {c} 2>/dev/null | grep -qF -- {mark}; then "
                     f'left="$left {fam} {table} {chain}"; fi')
    lines.append('if [ -n "$left" ]; then echo "still open in:$left"; exit 1; fi')
    return "\n".join(lines) + "\n"


def open_for(group: Group, hosts: list[Host], run_id: str, run_dirs: dict[str, str]) -> dict[str, Any]:
    """Per node: the chains opened for the run, or why it cannot run ({"refused": why}). Nodes whose
    firewall lets the run in (or that have none, or whose rules cannot be listed) are left as they are."""
    addresses = [h.address for h in hosts]
    hosts = [h for h in hosts if h.connection == "ssh"]  # a `local` node is this machine: its firewall is never ours
    listed = group.run(probe, timeout=60, hosts=hosts)
    out: dict[str, Any] = {}
    todo: dict[str, list[tuple[str, str, str]]] = {}
    peers_of: dict[str, list[str]] = {}
    for h in hosts:
        r = listed[h.name]
        fact = judge.parse(r.stdout, r.exit_code if r.exit_code is not None else 1)
        if fact.get("state") != "ok":
            continue
        # the node itself too: its own connections to its lab address (the rendezvous it hosts) are on the
        # same hook, and a ruleset without `iif lo accept` drops them as well
        peers = [a for a in addresses if judge.is_ip(a)]
        chains = chains_to_open(fact["ruleset"], peers) if peers else []
        if not chains:
            continue
        if not h.become:  # refused only where it surely blocks (check warns where only some ports may be)
            if judge.judge(fact["ruleset"], peers).state == "blocked":
                out[h.name] = {"refused": "its host firewall would block the run "
                               f"({', '.join(' '.join(c) for c in chains)})"}
            continue
        todo[h.name], peers_of[h.name] = chains, peers

    def one(t: Any) -> dict[str, Any]:
        h = t.host
        chains, peers = todo[h.name], peers_of[h.name]
        t.put_bytes(close_script(h, run_id, chains).encode(), f"{run_dirs[h.name]}/{CLOSE}", 0o755)
        set_ = "{ " + ", ".join(peers) + " }"
        for fam, table, chain in chains:
            words = ["insert", "rule", fam, table, chain, "ip", "saddr", set_, "meta", "l4proto", "tcp",
                     "accept", "comment", f'"{tag(run_id)}"']  # nft's own quotes: its parser reads the words
            r = t.run(f"{nft(h)} " + " ".join(shlex.quote(w) for w in words), timeout=60)
            if r.exit_code != 0:
                return {"refused": f"opening {fam} {table} {chain} failed: {(r.stderr or r.stdout).strip()[-300:]}"}
        return {"opened": [list(c) for c in chains], "peers": peers}

    done = group.call(one, [h for h in hosts if h.name in todo])
    for n, r in done.items():
        out[n] = r.value if r.ok else {"refused": r.error or "unreachable"}
    return out
