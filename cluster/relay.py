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
"""
from __future__ import annotations

import hashlib
import json
import secrets
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from cluster.errors import ClusterError, CommandTimeout, TransportError
from cluster.fanout import FAILED, OK, UNREACHABLE, Group, GroupResult, HostResult
from cluster.inventory import Host
from cluster.transport import Transport

PIECE = 4 << 20  # verified unit at every hop: small enough that a chain of 8 adds ~0.25 s at 1 GbE
MANIFEST = ".clusterctl-manifest.json"  # the node's verified files {name: sha256} (the same as wheelhouse.py's)
PIECES_CACHE = ".clusterctl-pieces.json"  # on the head, next to the files: piece hashes, keyed by size+mtime
SCRIPT = "clusterctl/relaynode.py"  # under the node's workdir
MODES = ("relay", "push")


@dataclass(frozen=True)
class Item:
    """One file to put on every node: the head's copy and what every hop checks it against."""

    name: str
    path: Path
    size: int
    sha256: str
    pieces: tuple[str, ...] = ()


def _piece_hashes(path: Path) -> list[str]:
    out = []
    with open(path, "rb") as f:
        while block := f.read(PIECE):
            out.append(hashlib.sha256(block).hexdigest())
    return out


def items(directory: Path, files: dict[str, dict[str, Any]], with_pieces: bool = True) -> list[Item]:
    """Items for `files` ({name: {sha256, size}}) in `directory`, with their piece hashes (computed once per
    file version and cached beside the files: a 1 GB file costs a second of reading the first time).
    A plan alone (a dry run) needs no piece hashes."""
    if not with_pieces:
        return [Item(n, directory / n, int(m["size"]), str(m["sha256"])) for n, m in files.items()]
    cache_path = directory / PIECES_CACHE
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    out, changed = [], False
    for name, meta in files.items():
        p = directory / name
        st = p.stat()
        key = f"{st.st_size}:{st.st_mtime_ns}:{meta['sha256']}:{PIECE}"
        entry = cache.get(name)
        if not isinstance(entry, dict) or entry.get("key") != key:
            entry = cache[name] = {"key": key, "pieces": _piece_hashes(p)}
            changed = True
        out.append(Item(name, p, int(meta["size"]), str(meta["sha256"]), tuple(entry["pieces"])))
    if changed:
        try:
            tmp = cache_path.with_name(f"{PIECES_CACHE}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_path)
        except OSError:
            pass  # a read-only cache only costs hashing again next time
    return out


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """Who receives what from whom (first choice; failures re-route at run time)."""

    mode: str
    chain: list[str]  # nodes in relay order (inventory order)
    needs: dict[str, list[str]]  # node -> names of the files it lacks
    sizes: dict[str, int]  # file name -> bytes
    uncertain: dict[str, list[str]] = field(default_factory=dict)  # node -> files of the right size, unverified

    def source(self, node: str) -> str:
        """The first choice: the nearest node before this one in the chain, else the head."""
        i = self.chain.index(node)
        return self.chain[i - 1] if self.mode == "relay" and i > 0 else "head"

    def nbytes(self, node: str) -> int:
        return sum(self.sizes[f] for f in self.needs.get(node, []))

    @property
    def head_bytes(self) -> int:
        """What leaves the head's NIC: each file once (relay), or once per node that lacks it (push)."""
        if self.mode == "push":
            return sum(self.nbytes(n) for n in self.chain)
        first = {}
        for n in self.chain:
            for f in self.needs.get(n, []):
                first.setdefault(f, n)
        # a file the first node already has costs the head nothing: later nodes fetch it from a peer
        return sum(self.sizes[f] for f, n in first.items() if self.chain.index(n) == 0)

    def edges(self) -> list[tuple[str, str, int, int]]:
        """(from, to, files, bytes) for every node that lacks something."""
        return [(self.source(n), n, len(self.needs[n]), self.nbytes(n)) for n in self.chain if self.needs.get(n)]

    def lines(self) -> list[str]:
        if not any(self.needs.values()):
            return [f"every node has every file ({len(self.sizes)} files, verified)"]
        out = [f"{a} -> {b}: {k} files, {n / 2**20:.0f} MiB"
               + (f" (up to; {len(self.uncertain[b])} present but unverified)" if self.uncertain.get(b) else "")
               for a, b, k, n in self.edges()]
        out.append(f"{self.mode}: the head sends {self.head_bytes / 2**20:.0f} MiB in all")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "chain": self.chain, "head_bytes": self.head_bytes,
                "edges": [{"from": a, "to": b, "files": k, "bytes": n} for a, b, k, n in self.edges()]}


@dataclass
class Delivery:
    """What one node got and from where; `detail` is what provision shows."""

    node: str
    present: int = 0  # files already verified there
    files: int = 0  # files it received
    from_head: int = 0  # bytes the head sent it
    from_peers: dict[str, int] = field(default_factory=dict)  # peer -> bytes received from it
    resumed: int = 0  # bytes kept from an earlier, interrupted copy (verified prefix)
    refused: list[str] = field(default_factory=list)  # sources refused, and why

    @property
    def received(self) -> int:
        return self.from_head + sum(self.from_peers.values())

    def detail(self) -> str:
        if not self.files:
            return f"{self.present} files present and verified"
        peers = ", ".join(f"{p} {b / 2**20:.0f} MiB" for p, b in self.from_peers.items() if b)
        s = (f"received {self.files} files ({self.received / 2**20:.0f} MiB: head {self.from_head / 2**20:.0f} MiB"
             + (f", {peers}" if peers else "") + ")")
        if self.resumed:
            s += f", resumed {self.resumed / 2**20:.0f} MiB already there"
        if self.refused:
            s += "; refused " + "; ".join(self.refused)
        return s + ", sha256 verified"

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "present": self.present, "files": self.files, "from_head": self.from_head,
                "from_peers": self.from_peers, "resumed": self.resumed, "refused": self.refused}


def pidfile(h: Host) -> str:
    return f"{h.workdir}/clusterctl/relay.pid"


def survey(t: Transport, dest: str, names: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    """Sizes of these files on the node and the sha256 recorded for those verified there earlier.
    Also removes the pidfile of a relay left by a run whose head died: that relay then stops within 1 s."""
    q = shlex.quote(dest)
    r = t.run(f"rm -f -- {shlex.quote(pidfile(t.host))}; cd -- {q} 2>/dev/null && {{ stat -c '%s %n' -- {' '.join(shlex.quote(n) for n in names)} "
              f"2>/dev/null; echo @@manifest; cat {MANIFEST} 2>/dev/null; }}; true", timeout=120)
    return parse_survey(r.stdout)


def parse_survey(stdout: str) -> tuple[dict[str, int], dict[str, str]]:
    """`stat -c '%s %n'` lines, then `@@manifest` and the node's manifest of verified files (JSON)."""
    sizes_txt, _, manifest_txt = stdout.partition("@@manifest\n")
    sizes = {}
    for line in sizes_txt.splitlines():
        size, _, name = line.partition(" ")
        if size.isdigit():
            sizes[name] = int(size)
    try:
        verified = json.loads(manifest_txt) if manifest_txt.strip() else {}
    except ValueError:
        verified = {}
    return sizes, verified if isinstance(verified, dict) else {}


def _script_source() -> str:
    return resources.files("cluster.workloads").joinpath("relaynode.py").read_text()


def _node_cmd(t: Transport, verb: str, req: dict[str, Any], timeout: float) -> dict[str, Any]:
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


class _Run:
    """One distribution in progress: the shared view of which nodes may still serve which files."""

    def __init__(self, group: Group, plan: Plan, by_name: dict[str, Item], dest: dict[str, str], token: str,
                 progress: Callable[[str, int], None] | None, log: Callable[[str], None]) -> None:
        self.group, self.plan, self.by_name, self.dest, self.token = group, plan, by_name, dest, token
        self.progress, self.log = progress, log
        self.ports: dict[str, int] = {}  # node -> its relay's port (only nodes whose relay started)
        self.address: dict[str, str] = {}
        self.dead: set[str] = set()  # nodes that may no longer serve anything
        self.bad: dict[str, set[str]] = {}  # file -> nodes that served it corrupted
        self.lock = threading.Lock()

    def sources(self, node: str, name: str) -> list[str]:
        """Nodes before `node` in the chain that may serve `name`, nearest first."""
        if self.plan.mode != "relay":
            return []
        i = self.plan.chain.index(node)
        with self.lock:
            return [n for n in reversed(self.plan.chain[:i])
                    if n in self.ports and n not in self.dead and n not in self.bad.get(name, set())]

    def node_loop(self, t: Transport, delivery: Delivery) -> Delivery:
        name = t.host.name
        try:
            for batch in batches([self.by_name[f] for f in self.plan.needs.get(name, [])]):
                self.one_batch(t, batch, delivery)
                delivery.files += len(batch)
                if self.progress:
                    self.progress(name, sum(i.size for i in batch))
        except BaseException:
            with self.lock:
                self.dead.add(name)  # its relay may hold a stale .part: nobody asks it any more
            raise
        return delivery

    def one_batch(self, t: Transport, batch: list[Item], d: Delivery) -> None:
        """Fetch from peers what they can give (one command for the batch); the rest from the head."""
        node = t.host.name
        pending = list(batch)
        for _ in range(len(self.plan.chain) + 1):  # each failed try removes at least one source
            wanted = [(i, self.sources(node, i.name)) for i in pending]
            by_peers = [(i, s) for i, s in wanted if s]
            if not by_peers:
                break
            req = {"token": self.token, "dir": self.dest[node], "piece": PIECE,
                   "stall_s": t.stall_timeout, "connect_s": t.host.connect_timeout,
                   "files": [{"name": i.name, "size": i.size, "sha256": i.sha256, "pieces": list(i.pieces),
                              "sources": [[self.address[n], self.ports[n]] for n in s]} for i, s in by_peers]}
            by_addr = {f"{self.address[n]}:{self.ports[n]}": n for n in self.ports}
            size = sum(i.size for i, _ in by_peers)
            # bounded: the node's fetch gives up on a source after stall_s without a byte; this is the backstop
            res = _node_cmd(t, "fetch", req, timeout=max(t.host.command_timeout, size / 1e6 + 120))
            results = res.get("files") if isinstance(res.get("files"), dict) else {}
            progressed = False
            for i, _ in by_peers:
                r = results.get(i.name) or {}
                if r.get("source") in by_addr:
                    src = by_addr[r["source"]]
                    d.from_peers[src] = d.from_peers.get(src, 0) + int(r.get("received", 0))
                d.resumed += int(r.get("resumed_from", 0))
                failed = r.get("failed") if isinstance(r.get("failed"), dict) else {}
                progressed |= bool(failed)
                with self.lock:
                    for addr, why in failed.items():
                        peer = by_addr.get(addr, addr)
                        why = why if isinstance(why, dict) else {}
                        if why.get("kind") == "corrupt":
                            self.bad.setdefault(i.name, set()).add(peer)
                            d.refused.append(f"{i.name} from {peer}: {why.get('detail')}")
                        else:
                            self.dead.add(peer)
                for addr, why in failed.items():
                    why = why if isinstance(why, dict) else {}
                    self.log(f"{node}: {i.name} from {by_addr.get(addr, addr)}: {why.get('kind')}: {why.get('detail')}")
            pending = [i for i in pending if not (results.get(i.name) or {}).get("ok")]
            if not pending or not progressed:  # no source failed, yet not done: the head sends it
                break
        if pending:
            self.head_send(t, pending, d)

    def recheck(self, t: Transport, d: Delivery) -> None:
        """This node served corrupted pieces: hash its copies of those files; a bad one is dropped and sent
        again by the head (its peers may be the ones it fed)."""
        node = t.host.name
        files = {f: self.by_name[f].sha256 for f, nodes in self.bad.items() if node in nodes}
        res = _node_cmd(t, "adopt", {"dir": self.dest[node], "files": files, "drop_bad": True}, timeout=1800)
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
            res = _node_cmd(t, "commit", {"dir": dest, "files": {i.name: i.sha256 for i in pending}}, timeout=1800)
            results = res.get("files") if isinstance(res.get("files"), dict) else {}
            bad = [i for i in pending if not (results.get(i.name) or {}).get("ok")]
            for i in bad:
                self.log(f"{node}: {i.name} from the head: {(results.get(i.name) or {}).get('error')} "
                         f"(attempt {attempt})")
            pending = bad
            if not pending:
                return
        raise ClusterError(f"{node}: sha256 of {', '.join(i.name for i in pending)} differs from the head's "
                           "after two copies (removed)", "re-run; if it repeats, check the node's disk and memory")


BATCH_BYTES = 64 << 20  # small files travel together: one command per batch, not per file
BATCH_FILES = 32


def batches(files: list[Item]) -> list[list[Item]]:
    """Consecutive files grouped up to BATCH_BYTES / BATCH_FILES (a large file is a batch of its own)."""
    out: list[list[Item]] = []
    cur: list[Item] = []
    for i in files:
        if cur and (sum(x.size for x in cur) + i.size > BATCH_BYTES or len(cur) >= BATCH_FILES):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def plan(group: Group, hosts: list[Host], files: list[Item], dest: dict[str, str], mode: str = "relay",
         rehash: bool = False) -> tuple[Plan, GroupResult]:
    """Ask every node what it has; the plan covers the nodes that answered."""
    if mode not in MODES:
        raise ClusterError(f"distribution mode {mode!r} is unknown", f"use one of {', '.join(MODES)}")
    names = [i.name for i in files]
    by_name = {i.name: i for i in files}
    res = group.call(lambda t: survey(t, dest[t.host.name], names), hosts)
    p = Plan(mode, [h.name for h in hosts if res[h.name].ok], {}, {i.name: i.size for i in files})
    for n in p.chain:
        sizes, verified = res[n].value
        need, maybe = [], []
        for f in names:
            if sizes.get(f) == by_name[f].size and verified.get(f) == by_name[f].sha256 and not rehash:
                continue
            need.append(f)
            if sizes.get(f) == by_name[f].size:
                maybe.append(f)
        p.needs[n] = need
        if maybe:
            p.uncertain[n] = maybe
    return p, res


def distribute(group: Group, hosts: list[Host], files: list[Item], dest: dict[str, str], mode: str = "relay",
               dry: bool = False, rehash: bool = False, progress: Callable[[str, int], None] | None = None,
               log: Callable[[str], None] = lambda s: None) -> tuple[Plan, GroupResult]:
    """Put every file on every node under dest[node], verified. Returns the plan and, per node, a
    HostResult whose value is its Delivery (ok), or why it failed or could not be reached.

    `rehash`: files present at their size are hashed on the node even when its manifest lists them."""
    p, surveyed = plan(group, hosts, files, dest, mode, rehash)
    out = GroupResult()
    for h in hosts:
        if not surveyed[h.name].ok:
            out[h.name] = surveyed[h.name]
    if dry:
        for n in p.chain:
            out[n] = HostResult(n, OK, 0.0, value=Delivery(n, present=len(files) - len(p.needs[n])))
        return p, out
    by_host = {h.name: h for h in hosts}
    needing = [n for n in p.chain if p.needs[n]]
    start = time.monotonic()
    run = _Run(group, p, {i.name: i for i in files}, dest, secrets.token_hex(16), progress, log)
    deliveries = {n: Delivery(n) for n in p.chain}
    servers: list[str] = []
    try:
        if needing:
            prep = group.call(lambda t: _prepare(t, dest[t.host.name], p, files, deliveries[t.host.name]),
                              [by_host[n] for n in p.chain])
            for n, r in prep.items():
                if not r.ok:
                    out[n] = r
            p.needs = {n: v for n, v in p.needs.items() if n not in out}
            for n, v in p.needs.items():  # adoption found some files complete after all
                deliveries[n].present = len(files) - len(v)
            p.chain = [n for n in p.chain if n not in out]
            needing = [n for n in p.chain if p.needs[n]]
        if needing and mode == "relay" and len(p.chain) > 1:
            last = max(p.chain.index(n) for n in needing)
            servers = [n for n in p.chain[:last]]
            _start_servers(run, [by_host[n] for n in servers], [by_host[n] for n in p.chain], log)
        with ThreadPoolExecutor(max_workers=max(1, len(needing)), thread_name_prefix="relay") as pool:
            futures = {n: pool.submit(_guarded, run, by_host[n], deliveries[n]) for n in needing}
            for n in needing:
                out[n] = futures[n].result()  # bounded: every wait in a node's loop has its own limit
        # a node that served a file another node refused: its own copy is hashed, and replaced if bad
        suspects = {n for names in run.bad.values() for n in names if n not in out or out[n].ok}
        if suspects:
            rechecked = group.call(lambda t: run.recheck(t, deliveries[t.host.name]),
                                   [by_host[n] for n in p.chain if n in suspects])
            for n, r in rechecked.items():
                if not r.ok:
                    out[n] = r
        for n in p.chain:
            out.setdefault(n, HostResult(n, OK, 0.0, value=deliveries[n]))
        log(f"distributed {len(files)} files to {len(needing)} nodes in {time.monotonic() - start:.1f}s ({mode})")
    finally:
        if servers:
            _stop_servers(run, [by_host[n] for n in servers if n in run.ports])
    return p, GroupResult((h.name, out[h.name]) for h in hosts)


def _prepare(t: Transport, dest: str, p: Plan, files: list[Item], d: Delivery) -> None:
    """The node's side: the relay script uploaded, the destination made, unverified complete files adopted."""
    h = t.host
    t.run(f"mkdir -p -- {shlex.quote(dest)} {shlex.quote(h.workdir + '/clusterctl')}", timeout=60)
    t.put_bytes(_script_source().encode(), f"{h.workdir}/{SCRIPT}")
    maybe = p.uncertain.get(h.name) or []
    if maybe:
        sums = {i.name: i.sha256 for i in files if i.name in maybe}
        res = _node_cmd(t, "adopt", {"dir": dest, "files": sums}, timeout=1800)
        ok = set(res.get("verified") or [])
        p.needs[h.name] = [f for f in p.needs[h.name] if f not in ok]
    d.present = len(files) - len(p.needs[h.name])


def _guarded(run: _Run, host: Host, d: Delivery) -> HostResult:
    """One node's loop as a HostResult: lost connection -> unreachable, anything else -> failed."""
    start = time.monotonic()
    t = run.group.transports[host.name]
    try:
        run.node_loop(t, d)
    except TransportError as e:
        return HostResult(host.name, UNREACHABLE, time.monotonic() - start, error=e.message, problem=e.problem,
                          fix=e.fix, value=d)
    except CommandTimeout as e:
        return HostResult(host.name, FAILED, time.monotonic() - start, error=e.message, problem="command-timeout",
                          value=d)
    except ClusterError as e:
        try:  # a node that died mid-command leaves no answer, not a TransportError: ask it once more
            t.run("true", timeout=2 * host.connect_timeout)
        except (TransportError, CommandTimeout) as lost:
            return HostResult(host.name, UNREACHABLE, time.monotonic() - start,
                              error=f"{e.message} (then: {lost.message})", problem="unreachable", value=d)
        return HostResult(host.name, FAILED, time.monotonic() - start, error=e.message, fix=e.fix, value=d)
    return HostResult(host.name, OK, time.monotonic() - start, value=d)


def _start_servers(run: _Run, servers: list[Host], chain: list[Host], log: Callable[[str], None]) -> None:
    """A relay on each node that may serve: bound to its address, answering only the chain's addresses."""
    for h in chain:
        run.address[h.name] = run.group.transports[h.name].peer_address or h.address
    allow = sorted(run.address.values())

    def start(t: Transport) -> int:
        h = t.host
        cfg = {"token": run.token, "bind": run.address[h.name], "port": 0, "root": run.dest[h.name],
               "allow": allow, "stall_s": t.stall_timeout, "idle_s": max(120.0, 4 * t.stall_timeout),
               "max_s": 6 * 3600, "pidfile": pidfile(h)}
        doc = _node_cmd(t, "serve", cfg, timeout=60)
        if not doc.get("ok") or not isinstance(doc.get("port"), int):
            raise ClusterError(f"{h.name}: the relay did not start: {doc}")
        return int(doc["port"])

    for n, r in run.group.call(start, servers).items():
        if r.ok:
            run.ports[n] = r.value
        else:  # it can still receive; its downstream goes further up the chain or to the head
            log(f"{n}: no relay ({r.error}); its files reach the next nodes from another source")


def _stop_servers(run: _Run, servers: list[Host]) -> None:
    """Every relay ends with the distribution (the relays also stop by themselves when idle)."""
    run.group.call(lambda t: _node_cmd(t, "stop", {"pidfile": pidfile(t.host)}, timeout=30), servers)
