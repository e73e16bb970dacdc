"""`clusterctl collect`: every node's run folder on the head, incremental, verified, confined.

For each node: the agent lists the run's regular files with size and sha256 (links
are listed as skipped, never read); the head fetches only what it lacks. A local
copy that is a verified prefix of the node's file (a log that grew, a transfer
that was interrupted) gets only the missing tail. Every file is checked against
the node's sha256 before it takes its final name. Every path a node sends is
checked to stay inside runs/<run-id>/<node>/ on the head.

A running run's program deletes and rewrites files while they are listed and copied: a file
that vanished or changed before its copy verified is tried once more against a fresh listing
of that one file (the agent's `prefix`), and where it changed again it is named in the node's
`changed`; every other file is collected and the node stays ok.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from cluster.runs import records as runs, render
from cluster.nodes import facts, power
from cluster.provision.wheelhouse import sha256_file
from cluster.errors import ClusterError, TransportError, UsageError
from cluster.nodes.fanout import Group
from cluster.inventory.model import Host, Inventory
from cluster.nodes.replies import agent_reply, error_tail
from cluster.transport import Transport


class UnsafePath(ClusterError):
    """A path from a node that would land outside the run folder."""


class Changed(ClusterError):
    """The node's file vanished or changed between its listing and the end of its copy (a running program's);
    the message is the reason, collect_node names the file."""


CHANGED_FIX = "collect again once the run has ended: its files are final then"


@dataclass
class NodeCollect:
    node: str
    status: str = "ok"  # ok | failed | unreachable
    files: int = 0  # files the head now holds as the node has them
    fetched: int = 0  # files that needed bytes
    bytes: int = 0  # bytes transferred
    total_bytes: int = 0  # bytes the node holds for this run
    skipped: list[dict[str, str]] = field(default_factory=list)
    refused: list[dict[str, str]] = field(default_factory=list)
    changed: list[dict[str, str]] = field(default_factory=list)  # vanished or rewritten during the copy, twice
    shipped: int = 0  # files left on the node: shipped by launch, unchanged (the head has them)
    not_outputs: int = 0  # files and folders of the program's folder outside the job's `outputs`, left there
    large: list[dict[str, Any]] = field(default_factory=list)  # what the job names large, left there: path, size
    error: str | None = None
    fix: str | None = None
    duration: float = 0.0
    woke: str | None = None  # the PC was switched off (a room's power saving) and woken for the collect

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def safe_dest(base: Path, rel: str) -> Path:
    """base/rel, strictly inside base: refuses absolute paths, `.`, `..` and empty parts (so "", "." and
    "a/./b" too: the copy's `.part` file sits next to its target, so a path naming base itself would write
    beside base) and anything that resolves outside base (also through a symlink already on the head)."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or any(part in ("..", ".", "") for part in rel.split("/")) or "\0" in rel:
        raise UnsafePath(f"refused path {rel!r}: empty, absolute, '.' or climbing out of the run folder")
    dest = base.joinpath(*p.parts)
    root = base.resolve()
    if not dest.resolve().is_relative_to(root):
        raise UnsafePath(f"refused path {rel!r}: resolves outside {base}")
    if dest.resolve() == root:
        raise UnsafePath(f"refused path {rel!r}: names the run folder itself, not a file in it")
    for parent in [dest, *dest.parents]:
        if parent == base or not parent.is_relative_to(base):
            break
        if parent.is_symlink():
            raise UnsafePath(f"refused path {rel!r}: {parent} is a symbolic link on the head")
    return dest


def _valid_entry(entry: dict[str, Any]) -> bool:
    size, sha = entry.get("size"), entry.get("sha256")
    return (isinstance(size, int) and not isinstance(size, bool) and size >= 0 and isinstance(sha, str)
            and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha))


def _fetch(t: Transport, remote: str, entry: dict[str, Any], dest: Path,
           on_bytes: Callable[[int], None]) -> int:
    """Make dest equal the node's file (size, sha256); returns the bytes transferred.

    Work happens in dest.part: a copy cut short stays there for the next collect, and a head copy
    that the node's file has outgrown is extended from there (after checking it is a prefix)."""
    size, sha = int(entry["size"]), str(entry["sha256"])
    if dest.exists() and dest.stat().st_size == size and sha256_file(dest) == sha:
        return 0
    part = dest.with_name(dest.name + ".part")
    if part.is_symlink():
        part.unlink()
    if not part.exists() and dest.exists() and dest.stat().st_size < size:
        shutil.copyfile(dest, part)  # a local copy: its bytes need not cross the network again
    offset = part.stat().st_size if part.exists() else 0
    if 0 < offset < size:
        r = t.run(render.agent_command(t.host, "prefix", remote, str(offset)), timeout=600)
        try:
            same = json.loads(r.stdout)["sha256"] == sha256_file(part)
        except (ValueError, KeyError):
            same = False
        offset = offset if same else 0
    elif offset >= size:
        offset = 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | (os.O_APPEND if offset else os.O_TRUNC)
    with os.fdopen(os.open(part, flags, 0o644), "ab" if offset else "wb") as f:
        def sink(chunk: bytes) -> None:
            f.write(chunk)
            on_bytes(len(chunk))

        why: str | None = None
        try:
            t.get_range(remote, offset, size - offset, sink)
        except FileNotFoundError:
            why = "deleted on the node before its copy"
        except TransportError:  # the node or the connection, not the file: the node fails
            raise
        except ClusterError:  # the file ended before the listed size (sftp)
            why = "shortened on the node during its copy"
    if why is None and sha256_file(part) != sha:
        why = "rewritten on the node during its copy (sha256 differs)"
    if why is not None:
        part.unlink(missing_ok=True)  # bytes of a file that is no more: nothing to resume from
        raise Changed(why, CHANGED_FIX)
    os.replace(part, dest)
    return size - offset


def _listed_again(t: Transport, remote: str, why: str) -> dict[str, Any]:
    """A fresh listing (size, sha256) of the one file `remote`, from the agent's `prefix`; Changed where it
    is gone or cannot be listed (an agent from before `prefix` listed whole files: launch shipped it)."""
    r = t.run(render.agent_command(t.host, "prefix", remote), timeout=600)
    doc = agent_reply(r.stdout)
    if doc is not None and doc.get("ok") and _valid_entry(doc):
        return doc
    if doc is not None and doc.get("gone"):
        raise Changed("gone from the node during the collect (deleted)", CHANGED_FIX)
    said = (doc or {}).get("error") or error_tail(r.stderr or r.stdout, 160)
    raise Changed(f"{why}; the node could not list it again: {said}", CHANGED_FIX)


def _fetch_settled(t: Transport, remote: str, entry: dict[str, Any], dest: Path,
                   on_bytes: Callable[[int], None]) -> tuple[int, int]:
    """_fetch, and where the file vanished or changed meanwhile, once more as the node has it now:
    (bytes transferred, the size the head holds). Changed where it changed again."""
    try:
        return _fetch(t, remote, entry, dest, on_bytes), int(entry["size"])
    except Changed as e:
        fresh = _listed_again(t, remote, e.message)
    try:
        return _fetch(t, remote, fresh, dest, on_bytes), int(fresh["size"])
    except Changed as e:
        raise Changed(f"{e.message}, again after a fresh listing", CHANGED_FIX) from None


def collect_node(t: Transport, run_dir: str, dest: Path, checkpoints: bool,
                 on_bytes: Callable[[int], None] = lambda n: None) -> NodeCollect:
    h = t.host
    res = NodeCollect(h.name)
    start = time.monotonic()
    args = [run_dir] + (["checkpoints"] if checkpoints else [])
    r = t.run(render.agent_command(h, "manifest", *args), timeout=1800)
    listing = agent_reply(r.stdout)
    if listing is None:
        raise ClusterError(f"no file list from the node: {error_tail(r.stderr or r.stdout)}",
                           "is the run folder still there? `clusterctl exec -- ls <workdir>/runs`")
    if not listing.get("ok") or not isinstance(listing.get("files"), list):
        raise ClusterError(f"no file list from the node: {listing.get('error') or str(listing)[:300]}",
                           "check `clusterctl runs`")
    dest.mkdir(parents=True, exist_ok=True)
    res.skipped = [x for x in listing.get("skipped", []) if isinstance(x, dict)]
    res.shipped, res.not_outputs = (int(listing.get(k) or 0) for k in ("shipped", "not_outputs"))
    res.large = [{"path": str(x["path"]), "size": int(x["size"])} for x in listing.get("large") or []
                 if isinstance(x, dict) and isinstance(x.get("path"), str) and isinstance(x.get("size"), int)]
    for entry in listing["files"]:
        rel = entry.get("path") if isinstance(entry, dict) else None
        try:
            if not isinstance(rel, str) or not _valid_entry(entry):
                raise UnsafePath(f"refused entry {str(entry)[:200]!r}: expected a path, a size and a sha256")
            target = safe_dest(dest, rel)
        except UnsafePath as e:
            res.refused.append({"path": str(rel), "reason": f"{h.name}: {e.message}; nothing written for it"})
            continue
        try:
            n, size = _fetch_settled(t, f"{run_dir}/{rel}", entry, target, on_bytes)
        except Changed as e:
            res.changed.append({"path": rel, "reason": e.message})
            continue
        res.files += 1
        res.total_bytes += size
        if n:
            res.fetched += 1
            res.bytes += n
    # what the node is: its provisioning record, as the head last saw it verified
    state = t.run(f"cat -- {shlex.quote(h.workdir + '/clusterctl/state.json')} 2>/dev/null", timeout=60)
    if state.exit_code == 0 and state.stdout.strip():
        (dest / "provision-state.json").write_text(state.stdout)
    res.duration = time.monotonic() - start
    return res


def collect(record: runs.RunRecord, checkpoints: bool = False, forks: int = 32,
            on_bytes: Callable[[str, int], None] | None = None,
            inventory_hosts: dict[str, Host] | None = None) -> dict[str, NodeCollect]:
    """Bring the run's files from every node into runs/<run-id>/<node>/; one node's failure is data.
    `inventory_hosts` (from -i) replaces the record's snapshot of how to reach each node."""
    dirs = record.node_dirs()
    hosts: list[Host] = [(inventory_hosts or {}).get(h.name, h) for h in runs.hosts(record) if h.name in dirs]
    base = runs.run_path(record.run_id)
    out: dict[str, NodeCollect] = {}

    def one(t: Transport) -> NodeCollect:
        name = t.host.name
        return collect_node(t, dirs[name], safe_dest(base, name), checkpoints,
                            (lambda n: on_bytes(name, n)) if on_bytes else (lambda n: None))

    with Group(hosts, forks=forks) as group:
        results = group.call(one)
        gathered = facts.gather(group, [h for h in hosts if results[h.name].ok])
    for h in hosts:
        r = results[h.name]
        if r.ok:
            out[h.name] = r.value
            f = gathered.get(h.name)
            if f is not None and f.ok:
                (base / h.name / "facts.json").write_text(json.dumps(f.value.to_dict(), indent=1, default=str))
        else:
            out[h.name] = NodeCollect(h.name, status=r.status, error=r.error, fix=r.fix, duration=r.duration)
    where = record.inventory
    if where.get("path") and where.get("name"):  # each node's MAC, for `wake` once these PCs are off
        inv = Inventory(Path(where["path"]), where["name"], {h.name: h for h in hosts}, {}, "")
        power.record(inv, {n: f.value for n, f in gathered.items() if f.ok})
    collected = {"time": time.time(), "nodes": {n: c.to_dict() for n, c in out.items()}}
    record.collected = collected
    # only this field, on the newest record: a run that ended while we copied keeps its final state
    runs.update(record.run_id, lambda newest: setattr(newest, "collected", collected))
    return out


# --------------------------------------------------------------------------- several runs: `clusterctl collect`

VERDICTS = ("ok", "failed", "unreachable")  # each worse than the one before: several runs get the worst


@dataclass
class RunCollect:
    """One run's collect: the head folder its files went to and each node's outcome."""

    run_id: str
    folder: Path
    nodes: dict[str, NodeCollect]

    @property
    def verdict(self) -> str:
        """unreachable: a node could not be reached; failed: a node failed or a file was refused; else ok
        (files a running program changed during the copy are named in `changed`, a note: collect again)."""
        if any(c.status == "unreachable" for c in self.nodes.values()):
            return "unreachable"
        if any(c.status != "ok" or c.refused for c in self.nodes.values()):
            return "failed"
        return "ok"

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "folder": str(self.folder), "nodes": [c.to_dict() for c in self.nodes.values()]}


@dataclass
class CollectSummary:
    runs: list[RunCollect]

    @property
    def verdict(self) -> str:
        """The worst of the runs' verdicts (VERDICTS order)."""
        return max((r.verdict for r in self.runs), key=VERDICTS.index, default="ok")


def chosen_runs(run: str | None, every: bool) -> list[runs.RunRecord]:
    """The run named (or the latest), or with `every` each recorded run that was not a dry run."""
    if every and run:
        raise UsageError("give a RUN or --all, not both", "clusterctl collect --all")
    return [r for r in runs.list_runs() if r.state != "dry-run"] if every else [runs.load(run)]
