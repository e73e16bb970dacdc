"""The peer relay's routes: what each node lacks, who it receives from, and what it got
(cluster/relay/distribute.py).

Why apart from the run: the routes are what `provision --dry-run` shows and what a run starts from, and it
needs no node-side code: each node answers one survey (sizes and its manifest of verified files).
"""
from __future__ import annotations

import hashlib
import json
import shlex
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.errors import ClusterError
from cluster.nodes.fanout import Group, GroupResult
from cluster.inventory.model import Host
from cluster.transport import Transport

PIECE = 4 << 20  # verified unit at every hop: small enough that a chain of 8 adds ~0.25 s at 1 GbE
MANIFEST = ".clusterctl-manifest.json"  # the node's verified files {name: sha256} (the same as wheelhouse.py's)
PIECES_CACHE = ".clusterctl-pieces.json"  # on the head, next to the files: piece hashes, keyed by size+mtime
MODES = ("relay", "push")
BATCH_BYTES = 64 << 20  # small files travel together: one command per batch, not per file
BATCH_FILES = 32


@dataclass(frozen=True)
class Item:
    """One file to put on every node: the head's copy and what every hop checks it against."""

    name: str
    path: Path
    size: int
    sha256: str
    pieces: tuple[str, ...] = ()


def _piece_hashes(path: Path, sha256: str) -> list[str]:
    """Each piece's sha256, in the same pass that checks the whole file against the manifest's: a node that
    matched every piece has the manifest's file (relaynode_fetch relies on it)."""
    out, whole = [], hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(PIECE):
            out.append(hashlib.sha256(block).hexdigest())
            whole.update(block)
    if whole.hexdigest() != sha256:
        raise ClusterError(f"{path}: its sha256 is not the one recorded for it (the file changed on disk)",
                           "remove the file: provision downloads the wheelhouse again, launch prepares its "
                           "dataset again")
    return out


def item(name: str, path: Path, size: int, sha256: str) -> Item:
    """One file as an Item under a name of its own (a code blob: named by its sha256), its piece hashes
    computed now (refused if the file is no longer the one scanned)."""
    return Item(name, path, size, sha256, tuple(_piece_hashes(path, sha256)))


def _save_cache(cache_path: Path, cache: dict[str, Any]) -> None:
    try:
        tmp = cache_path.with_name(f"{PIECES_CACHE}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(cache_path)
    except OSError:
        pass  # a read-only cache only costs hashing again next time


def items(directory: Path, files: dict[str, dict[str, Any]], with_pieces: bool = True) -> list[Item]:
    """Items for `files` ({name: {sha256, size}}) in `directory`, with their piece hashes (computed once per
    file version and cached beside the files: a 1 GB file costs a second of reading the first time).
    Routes alone (a dry run) need no piece hashes."""
    if not with_pieces:
        return [Item(n, directory / n, int(m["size"]), str(m["sha256"])) for n, m in files.items()]
    cache_path = directory / PIECES_CACHE
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    out, changed = [], False
    for name, meta in files.items():
        p = directory / name
        st = p.stat()
        key = f"{st.st_size}:{st.st_mtime_ns}:{meta['sha256']}:{PIECE}"
        entry = cache.get(name)
        if not isinstance(entry, dict) or entry.get("key") != key:
            entry = cache[name] = {"key": key, "pieces": _piece_hashes(p, str(meta["sha256"]))}
            changed = True
        out.append(Item(name, p, int(meta["size"]), str(meta["sha256"]), tuple(entry["pieces"])))
    if changed:
        _save_cache(cache_path, cache)
    return out


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


@dataclass
class Routes:
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
        first: dict[str, str] = {}
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
    r = t.run(f"rm -f -- {shlex.quote(pidfile(t.host))}; cd -- {q} 2>/dev/null && {{ stat -c '%s %n' -- "
              f"{' '.join(shlex.quote(n) for n in names)} 2>/dev/null; echo @@manifest; cat {MANIFEST} 2>/dev/null; "
              "}; true", timeout=120)
    return parse_survey(r.stdout)


def parse_sizes(stdout: str) -> dict[str, int]:
    """`stat -c '%s %n'` lines: {name: size}."""
    sizes = {}
    for line in stdout.splitlines():
        size, _, name = line.partition(" ")
        if size.isdigit():
            sizes[name] = int(size)
    return sizes


def parse_survey(stdout: str) -> tuple[dict[str, int], dict[str, str]]:
    """`stat -c '%s %n'` lines, then `@@manifest` and the node's manifest of verified files (JSON)."""
    sizes_txt, _, manifest_txt = stdout.partition("@@manifest\n")
    try:
        verified = json.loads(manifest_txt) if manifest_txt.strip() else {}
    except ValueError:
        verified = {}
    return parse_sizes(sizes_txt), verified if isinstance(verified, dict) else {}


def route(group: Group, hosts: list[Host], files: list[Item], dest: dict[str, str], mode: str = "relay",
         rehash: bool = False) -> tuple[Routes, GroupResult]:
    """Ask every node what it has; the routes cover the nodes that answered."""
    if mode not in MODES:
        raise ClusterError(f"distribution mode {mode!r} is unknown", f"use one of {', '.join(MODES)}")
    names = [i.name for i in files]
    by_name = {i.name: i for i in files}
    res = group.call(lambda t: survey(t, dest[t.host.name], names), hosts)
    p = Routes(mode, [h.name for h in hosts if res[h.name].ok], {}, {i.name: i.size for i in files})
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
