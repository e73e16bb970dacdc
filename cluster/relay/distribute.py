"""Peer-relayed distribution: the head sends each file once, the nodes pass it on along a chain.

Why: in a real lab every byte leaves through the head's one NIC, so pushing a wheelhouse to N PCs takes
N times as long as to one. Here the head sends each file to the first node that lacks it (over SSH,
`Transport.send_file`, resumable), and every other node fetches it from the nearest node before it in the
chain, piece by piece, while that node is still receiving it (cut-through): the first copy and the last
finish within a few pieces of each other. Time model and failure handling: docs/lab.md ("Peer relay").

Safety: only this inventory's nodes take part (each node's relay answers only their addresses and this
run's random token), pieces are checked against the head's sha256 manifest at every hop before they are
written, and every relay is stopped when the distribution ends (and stops itself when idle). A node that
fails mid-relay is routed around: its downstream fetches from the next node up the chain, or the head.

The parts: routes.py (what each node lacks, who it receives from), run.py (the nodes' loops, the relays,
the head's copies), progress.py (bytes per node while they move), and the node side in
agent/relaynode*.py (standard library only, uploaded for each distribution).
"""
from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from cluster.nodes.fanout import OK, Group, GroupResult, HostResult
from cluster.inventory.model import Host
from cluster.relay.routes import (BATCH_BYTES, BATCH_FILES, MANIFEST, MODES, PIECE, Delivery, Item, Routes, batches,
                                items, parse_survey, pidfile, route, survey)
from cluster.relay.progress import NodeProgress, ProgressFn, StatusFn, Tracker
from cluster.relay.run import NODE_FILES, SCRIPT, Run, node_cmd, ship
from cluster.transport import Transport

__all__ = ["BATCH_BYTES", "BATCH_FILES", "MANIFEST", "MODES", "NODE_FILES", "PIECE", "SCRIPT", "Delivery", "Item",
           "NodeProgress", "Routes", "batches", "distribute", "items", "parse_survey", "pidfile", "route", "survey"]


def _prepare(t: Transport, dest: str, p: Routes, files: list[Item], d: Delivery) -> None:
    """The node's side: the relay uploaded, the destination made, unverified complete files adopted."""
    h = t.host
    ship(t, dest)
    maybe = p.uncertain.get(h.name) or []
    if maybe:
        sums = {i.name: i.sha256 for i in files if i.name in maybe}
        res = node_cmd(t, "adopt", {"dir": dest, "files": sums}, timeout=1800)
        ok = set(res.get("verified") or [])
        p.needs[h.name] = [f for f in p.needs[h.name] if f not in ok]
    d.present = len(files) - len(p.needs[h.name])


def _prepare_all(group: Group, by_host: dict[str, Host], p: Routes, files: list[Item], dest: dict[str, str],
                 deliveries: dict[str, Delivery], out: GroupResult) -> None:
    """Every node of the chain prepared; one that fails leaves the chain (its result is in `out`)."""
    prep = group.call(lambda t: _prepare(t, dest[t.host.name], p, files, deliveries[t.host.name]),
                      [by_host[n] for n in p.chain])
    for n, r in prep.items():
        if not r.ok:
            out[n] = r
    p.needs = {n: v for n, v in p.needs.items() if n not in out}
    for n, v in p.needs.items():  # adoption found some files complete after all
        deliveries[n].present = len(files) - len(v)
    p.chain = [n for n in p.chain if n not in out]


def _recheck_suspects(run: Run, by_host: dict[str, Host], deliveries: dict[str, Delivery], out: GroupResult) -> None:
    """A node that served a file another node refused: its own copy is hashed, and replaced if bad."""
    suspects = {n for names in run.bad.values() for n in names if n not in out or out[n].ok}
    if suspects:
        rechecked = run.group.call(lambda t: run.recheck(t, deliveries[t.host.name]),
                                   [by_host[n] for n in run.routes.chain if n in suspects])
        for n, r in rechecked.items():
            if not r.ok:
                out[n] = r


def _deliver(run: Run, by_host: dict[str, Host], needing: list[str], deliveries: dict[str, Delivery],
             out: GroupResult) -> None:
    """Every node that lacks something, all at once; the relays of the nodes that may serve, around them."""
    p = run.routes
    servers: list[str] = []
    if needing and p.mode == "relay" and len(p.chain) > 1:
        servers = p.chain[:max(p.chain.index(n) for n in needing)]
    try:
        if servers:
            run.start_servers([by_host[n] for n in servers], [by_host[n] for n in p.chain])
        with run.tracker, ThreadPoolExecutor(max_workers=max(1, len(needing)), thread_name_prefix="relay") as pool:
            futures = {n: pool.submit(run.guarded, by_host[n], deliveries[n]) for n in needing}
            for n in needing:
                out[n] = futures[n].result()  # bounded: every wait in a node's loop has its own limit
        _recheck_suspects(run, by_host, deliveries, out)
    finally:
        if servers:
            run.stop_servers([by_host[n] for n in servers if n in run.ports])


RELAY_MIN_BYTES = 16 << 20  # below this in all, the head sends each node its files itself (SFTP)


def worth_relaying(total_bytes: int, nodes: int) -> bool:
    """Whether `total_bytes` (summed over the nodes that need them) go by relay: the relay's start-up
    (its node program, a port per node) costs about a second, which a few MiB per node do not repay."""
    return nodes > 1 and total_bytes >= RELAY_MIN_BYTES


def distribute(group: Group, hosts: list[Host], files: list[Item], dest: dict[str, str], mode: str = "relay",
               dry: bool = False, rehash: bool = False, progress: ProgressFn | None = None,
               log: Callable[[str], None] = lambda s: None,
               status: StatusFn | None = None) -> tuple[Routes, GroupResult]:
    """Put every file on every node under dest[node], verified. Returns the routes and, per node, a
    HostResult whose value is its Delivery (ok), or why it failed or could not be reached.

    `rehash`: files present at their size are hashed on the node even when its manifest lists them.
    `progress(node, n)`: n more bytes are on that node (polled about every second while they move: per
    byte, whoever sends them). `status(NodeProgress)`: the node's whole state (bytes of its total, files,
    where from, waiting/receiving/done/failed) at each change."""
    p, surveyed = route(group, hosts, files, dest, mode, rehash)
    out = GroupResult((h.name, surveyed[h.name]) for h in hosts if not surveyed[h.name].ok)
    if dry:
        for n in p.chain:
            out[n] = HostResult(n, OK, 0.0, value=Delivery(n, present=len(files) - len(p.needs[n])))
        return p, out
    by_host = {h.name: h for h in hosts}
    deliveries = {n: Delivery(n) for n in p.chain}
    start = time.monotonic()
    if any(p.needs[n] for n in p.chain):
        _prepare_all(group, by_host, p, files, dest, deliveries, out)
    needing = [n for n in p.chain if p.needs[n]]
    by_name = {i.name: i for i in files}
    # the progress poll's own connections, of the group's kind: never the one that carries the files
    tracker = Tracker(lambda n: type(group.transports[n])(by_host[n]), dest,
                      {n: (p.nbytes(n), len(p.needs[n])) for n in needing}, progress, status)
    run = Run(group, p, by_name, dest, secrets.token_hex(16), tracker, log)
    _deliver(run, by_host, needing, deliveries, out)
    for n in p.chain:
        out.setdefault(n, HostResult(n, OK, 0.0, value=deliveries[n]))
    log(f"distributed {len(files)} files to {len(needing)} nodes in {time.monotonic() - start:.1f}s ({mode})"
        if needing else f"every node already had {'the file' if len(files) == 1 else f'the {len(files)} files'}: "
        "nothing sent")
    return p, GroupResult((h.name, out[h.name]) for h in hosts)
