"""One peer-relayed distribution in progress (cluster/relay/distribute.py): each node's loop over its batches, the
relays on the nodes, and the head's copies where no peer can serve.

Why a class: the nodes' loops run at once and share one view of which nodes may still serve which files
(`dead`: failed as a whole; `bad`: served a corrupted piece of that file), so a failure one node sees
re-routes the others too.
"""
from __future__ import annotations

import json
import shlex
import threading
import time
from importlib import resources
from typing import Any, Callable

from cluster.errors import ClusterError, CommandTimeout, TransportError
from cluster.nodes.fanout import FAILED, OK, UNREACHABLE, Group, HostResult
from cluster.inventory.model import Host
from cluster.relay.routes import PIECE, Delivery, Item, Routes, batches, pidfile
from cluster.relay.progress import Tracker
from cluster.transport import Transport

SCRIPT_DIR = "clusterctl"  # under the node's workdir
# the node side: the entry point and the modules it imports, uploaded side by side (standard library only)
NODE_FILES = ("relaynode.py", "relaynode_common.py", "relaynode_serve.py", "relaynode_fetch.py")
SCRIPT = f"{SCRIPT_DIR}/{NODE_FILES[0]}"


def node_sources() -> dict[str, bytes]:
    """Every file of the node side, by name: what `ship` uploads."""
    pkg = resources.files("cluster.agent")
    return {name: pkg.joinpath(name).read_bytes() for name in NODE_FILES}


def ship(t: Transport, dest: str) -> None:
    """The destination made, and the node side of the relay uploaded next to the node agent."""
    h = t.host
    t.run(f"mkdir -p -- {shlex.quote(dest)} {shlex.quote(h.workdir + '/' + SCRIPT_DIR)}", timeout=60)
    for name, data in node_sources().items():
        t.put_bytes(data, f"{h.workdir}/{SCRIPT_DIR}/{name}")


def as_dict(value: object) -> dict[str, Any]:
    """A node's JSON field that should be an object; anything else reads as empty."""
    return value if isinstance(value, dict) else {}


def node_cmd(t: Transport, verb: str, req: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One relaynode.py command on the node; its JSON answer (the request goes on stdin: no token in argv)."""
    h = t.host
    r = t.run(f"{shlex.quote(h.python)} {shlex.quote(h.workdir + '/' + SCRIPT)} {verb}",
              timeout=timeout, stdin=json.dumps(req).encode())
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise ClusterError(f"{h.name}: relaynode.py {verb} gave no answer (exit {r.exit_code}): "
                           f"{(r.stderr or r.stdout).strip()[-400:]}",
                           f"check that `{h.python}` runs on the node (Python 3.8 or newer)")
    return doc


class Run:
    """One distribution in progress: the shared view of which nodes may still serve which files."""

    def __init__(self, group: Group, routes: Routes, by_name: dict[str, Item], dest: dict[str, str], token: str,
                 tracker: Tracker, log: Callable[[str], None]) -> None:
        self.group, self.routes, self.by_name, self.dest, self.token = group, routes, by_name, dest, token
        self.tracker, self.log = tracker, log
        self.ports: dict[str, int] = {}  # node -> its relay's port (only nodes whose relay started)
        self.address: dict[str, str] = {}
        self.dead: set[str] = set()  # nodes that may no longer serve anything
        self.bad: dict[str, set[str]] = {}  # file -> nodes that served it corrupted
        self.lock = threading.Lock()

    def sources(self, node: str, name: str) -> list[str]:
        """Nodes before `node` in the chain that may serve `name`, nearest first."""
        if self.routes.mode != "relay":
            return []
        i = self.routes.chain.index(node)
        with self.lock:
            return [n for n in reversed(self.routes.chain[:i])
                    if n in self.ports and n not in self.dead and n not in self.bad.get(name, set())]

    def node_loop(self, t: Transport, delivery: Delivery) -> Delivery:
        name = t.host.name
        try:
            for batch in batches([self.by_name[f] for f in self.routes.needs.get(name, [])]):
                self.one_batch(t, batch, delivery)
                delivery.files += len(batch)
                self.tracker.done(name, batch)
        except BaseException:
            with self.lock:
                self.dead.add(name)  # its relay may hold a stale .part: nobody asks it any more
            raise
        return delivery

    def one_batch(self, t: Transport, batch: list[Item], d: Delivery) -> None:
        """Fetch from peers what they can give (one command for the batch); the rest from the head."""
        node = t.host.name
        pending = list(batch)
        for _ in range(len(self.routes.chain) + 1):  # each failed try removes at least one source
            by_peers = [(i, s) for i in pending if (s := self.sources(node, i.name))]
            if not by_peers:
                break
            self.tracker.begin(node, batch, by_peers[0][1][0])
            results, progressed = self.fetch(t, by_peers, d)
            pending = [i for i in pending if not as_dict(results.get(i.name)).get("ok")]
            if not pending or not progressed:  # no source failed, yet not done: the head sends it
                break
        if pending:
            self.tracker.begin(node, batch, "head")
            self.head_send(t, pending, d)

    def fetch(self, t: Transport, by_peers: list[tuple[Item, list[str]]], d: Delivery) -> tuple[dict[str, Any], bool]:
        """One fetch command for these files, each from its peers; (results by file, whether a source failed)."""
        node = t.host.name
        req = {"token": self.token, "dir": self.dest[node], "piece": PIECE,
               "stall_s": t.stall_timeout, "connect_s": t.host.connect_timeout,
               "files": [{"name": i.name, "size": i.size, "sha256": i.sha256, "pieces": list(i.pieces),
                          "sources": [[self.address[n], self.ports[n]] for n in s]} for i, s in by_peers]}
        size = sum(i.size for i, _ in by_peers)
        # bounded: the node's fetch gives up on a source after stall_s without a byte; this is the backstop
        res = node_cmd(t, "fetch", req, timeout=max(t.host.command_timeout, size / 1e6 + 120))
        results = as_dict(res.get("files"))
        progressed = False
        for i, _ in by_peers:
            progressed |= self.account(node, i, as_dict(results.get(i.name)), d)
        return results, progressed

    def account(self, node: str, item: Item, r: dict[str, Any], d: Delivery) -> bool:
        """One file's fetch result into the delivery and the shared view; True when a source failed."""
        by_addr = {f"{self.address[n]}:{self.ports[n]}": n for n in self.ports}
        if r.get("source") in by_addr:
            src = by_addr[r["source"]]
            d.from_peers[src] = d.from_peers.get(src, 0) + int(r.get("received", 0))
        d.resumed += int(r.get("resumed_from", 0))
        failed = as_dict(r.get("failed"))
        for addr, why in failed.items():
            peer, why = by_addr.get(addr, addr), as_dict(why)
            with self.lock:
                if why.get("kind") == "corrupt":
                    self.bad.setdefault(item.name, set()).add(peer)
                    d.refused.append(f"{item.name} from {peer}: {why.get('detail')}")
                else:
                    self.dead.add(peer)
            self.log(f"{node}: {item.name} from {peer}: {why.get('kind')}: {why.get('detail')}")
        return bool(failed)

    def recheck(self, t: Transport, d: Delivery) -> None:
        """This node served corrupted pieces: hash its copies of those files; a bad one is dropped and sent
        again by the head (its peers may be the ones it fed)."""
        node = t.host.name
        files = {f: self.by_name[f].sha256 for f, nodes in self.bad.items() if node in nodes}
        res = node_cmd(t, "adopt", {"dir": self.dest[node], "files": files, "drop_bad": True}, timeout=1800)
        bad = [self.by_name[f] for f in res.get("bad") or [] if f in self.by_name]
        for i in bad:
            d.refused.append(f"its own {i.name}: sha256 differs from the head's (removed, sent again)")
        if bad:
            self.head_send(t, bad, d)
            d.files += len(bad)

    def head_send(self, t: Transport, batch: list[Item], d: Delivery) -> None:
        """The head's copies, over SSH; each resumes from a verified prefix (the node's own earlier pieces
        too), then one command checks and names them all."""
        node, dest = t.host.name, self.dest[t.host.name]
        pending = list(batch)
        for attempt in (1, 2):
            for item in pending:
                sent = t.send_file(item.path, f"{dest}/.{item.name}.part")
                d.from_head += sent
                d.resumed += item.size - sent
            res = node_cmd(t, "commit", {"dir": dest, "files": {i.name: i.sha256 for i in pending}}, timeout=1800)
            results = as_dict(res.get("files"))
            bad = [i for i in pending if not as_dict(results.get(i.name)).get("ok")]
            for i in bad:
                self.log(f"{node}: {i.name} from the head: {as_dict(results.get(i.name)).get('error')} "
                         f"(attempt {attempt})")
            pending = bad
            if not pending:
                return
        raise ClusterError(f"{node}: sha256 of {', '.join(i.name for i in pending)} differs from the head's "
                           "after two copies (removed)", "re-run; if it repeats, check the node's disk and memory")

    def guarded(self, host: Host, d: Delivery) -> HostResult:
        """One node's loop as a HostResult: lost connection -> unreachable, anything else -> failed."""
        r = self._outcome(host, d)
        self.tracker.finish(host.name, r.ok)
        return r

    def _outcome(self, host: Host, d: Delivery) -> HostResult:
        start = time.monotonic()
        t = self.group.transports[host.name]
        try:
            self.node_loop(t, d)
        except TransportError as e:
            return HostResult(host.name, UNREACHABLE, time.monotonic() - start, error=e.message, problem=e.problem,
                              fix=e.fix, value=d)
        except CommandTimeout as e:
            return HostResult(host.name, FAILED, time.monotonic() - start, error=e.message,
                              problem="command-timeout", value=d)
        except ClusterError as e:
            try:  # a node that died mid-command leaves no answer, not a TransportError: ask it once more
                t.run("true", timeout=2 * host.connect_timeout)
            except (TransportError, CommandTimeout) as lost:
                return HostResult(host.name, UNREACHABLE, time.monotonic() - start,
                                  error=f"{e.message} (then: {lost.message})", problem="unreachable", value=d)
            return HostResult(host.name, FAILED, time.monotonic() - start, error=e.message, fix=e.fix, value=d)
        return HostResult(host.name, OK, time.monotonic() - start, value=d)

    def start_servers(self, servers: list[Host], chain: list[Host]) -> None:
        """A relay on each node that may serve: bound to its address, answering only the chain's addresses."""
        for h in chain:
            self.address[h.name] = self.group.transports[h.name].peer_address or h.address
        allow = sorted(self.address.values())

        def start(t: Transport) -> int:
            h = t.host
            cfg = {"token": self.token, "bind": self.address[h.name], "port": 0, "root": self.dest[h.name],
                   "allow": allow, "stall_s": t.stall_timeout, "idle_s": max(120.0, 4 * t.stall_timeout),
                   "max_s": 6 * 3600, "pidfile": pidfile(h)}
            doc = node_cmd(t, "serve", cfg, timeout=60)
            if not doc.get("ok") or not isinstance(doc.get("port"), int):
                raise ClusterError(f"{h.name}: the relay did not start: {doc}")
            return int(doc["port"])

        for n, r in self.group.call(start, servers).items():
            if r.ok:
                self.ports[n] = r.value
            else:  # it can still receive; its downstream goes further up the chain or to the head
                self.log(f"{n}: no relay ({r.error}); its files reach the next nodes from another source")

    def stop_servers(self, servers: list[Host]) -> None:
        """Every relay ends with the distribution (the relays also stop by themselves when idle)."""
        self.group.call(lambda t: node_cmd(t, "stop", {"pidfile": pidfile(t.host)}, timeout=30), servers)
