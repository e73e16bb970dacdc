"""Runs on a node (stdlib only, Python 3.8+): the node's half of shipping a user's program folder
(cluster/runs/code.py). nodeagent.py imports it for two actions; the head puts it beside the agent.

    nodeagent.py code-missing CACHE_DIR          < {"files": {PATH: {"sha256", "size", "mode"}}}
        -> {"ok": true, "missing": [SHA256, ...], "removed": [SHA256, ...]}
    nodeagent.py code-tree CACHE_DIR RUN_DIR     < the same manifest + {"incoming": {TMPNAME: SHA256}}
        -> {"ok": true, "files": N, "linked": L, "copied": C}   or   {"ok": false, "error": "..."}

The cache holds one file per content, CACHE_DIR/<sha256> (mode 0644). A blob is trusted only after its
sha256 was checked in this very call: `code-missing` re-hashes the blobs it has and removes any that does
not match (so the head sends it again); `code-tree` checks each upload (TMPNAME, written into the cache by
the head's copy) before naming it, then every blob of the manifest before RUN_DIR/program/ gets it.
A run's files are its own, so that a later run's edit never reaches an earlier run's folder (nor what
`collect` brings back of it): the program's files are copies (code is small: cluster/runs/code.py bounds it);
a data file is a hard link to its blob, which is read-only (0444), so that a program writing into its data in
place fails loudly (EACCES) instead of changing every run's copy; where the node's user is root, whom file
modes do not stop, and where a link cannot be made (another filesystem), a copy.

Paths are confined under RUN_DIR/program: relative, `/`-separated, no empty, `.` or `..` part, no NUL;
no symbolic link under it is followed. A manifest that breaks a rule is refused whole, before any write.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time
from typing import TYPE_CHECKING, Any, Dict, List, Set

if TYPE_CHECKING:  # the node's Python may be older than the head's: aliases for mypy only
    Doc = dict[str, Any]
    Files = dict[str, Doc]  # path -> {"sha256", "size", "mode"}

SHA_RE = re.compile(r"[0-9a-f]{64}\Z")
PART_RE = re.compile(r"\.([0-9a-f]{64})\.[0-9a-f]{8,64}\.part\Z")  # the names the head uploads into
MODES = (0o644, 0o755)
BLOB_MODE = 0o444  # a blob is never written in place: a data file linked to it is read-only too
STALE_PART_S = 86400.0  # an upload cut short (a lost link) is removed after a day
SHIPPED = ".shipped-%s.json"  # in the run folder: {path under program/ or data/: sha256} of what was shipped


class Refused(ValueError):
    """The manifest, an upload or a blob is not what it must be: the reply's error."""


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_path(p: object) -> str:
    if not isinstance(p, str) or not p or "\0" in p:
        raise Refused("path %r: expected a non-empty relative path without NUL: manifest refused" % (p,))
    if p.startswith("/"):
        raise Refused("path %r is absolute: manifest refused (paths stay under RUN_DIR/program)" % p)
    if any(part in ("", ".", "..") for part in p.split("/")):
        raise Refused("path %r has an empty, '.' or '..' part: manifest refused (paths stay under "
                      "RUN_DIR/program)" % p)
    return p


def load(doc: object) -> Files:
    """The manifest's files, every path and entry checked; raises Refused."""
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        raise Refused("expected a manifest object with `files`")
    folders: Set[str] = set()
    for p, f in files.items():
        check_path(p)
        if not (isinstance(f, dict) and isinstance(f.get("sha256"), str) and SHA_RE.match(f["sha256"])
                and type(f.get("size")) is int and f["size"] >= 0 and f.get("mode") in MODES):
            raise Refused("path %r: expected {sha256, size, mode 0644|0755}, got %r" % (p, f))
        parts = p.split("/")
        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = sorted(folders.intersection(files))
    if clash:
        raise Refused("path %r is both a file and a folder in the manifest" % clash[0])
    return files


def _paths(files: Files, sha: str) -> str:
    names = sorted(p for p, f in files.items() if f["sha256"] == sha)
    return ", ".join(names[:3]) + (" and %d more" % (len(names) - 3) if len(names) > 3 else "")


def _blob_ok(path: str, sha: str, size: int) -> bool | None:
    """None: no such blob; True: a regular file of that size and sha256; False: anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return stat.S_ISREG(st.st_mode) and st.st_size == size and sha256_of(path) == sha


def missing(cache: str, files: Files) -> Doc:
    """The blobs of the manifest the cache lacks; a blob that does not match its name is removed."""
    os.makedirs(cache, 0o700, exist_ok=True)
    now = time.time()
    for name in os.listdir(cache):
        try:
            if name.endswith(".part") and now - os.lstat(os.path.join(cache, name)).st_mtime > STALE_PART_S:
                os.unlink(os.path.join(cache, name))
        except OSError:  # named or removed meanwhile by another launch
            pass
    want = {f["sha256"]: f["size"] for f in files.values()}
    lack: List[str] = []
    removed: List[str] = []
    for sha in sorted(want):
        ok = _blob_ok(os.path.join(cache, sha), sha, want[sha])
        if ok is False:
            os.unlink(os.path.join(cache, sha))
            removed.append(sha)
        if not ok:
            lack.append(sha)
    return {"ok": True, "missing": lack, "removed": removed}


def _commit(cache: str, files: Files, incoming: object) -> None:
    """The head's uploads named by their sha256 once it matches; one that does not is removed."""
    sizes = {f["sha256"]: f["size"] for f in files.values()}
    if not isinstance(incoming, dict):
        raise Refused("expected `incoming` to be an object {TMPNAME: sha256}")
    for name, sha in sorted(incoming.items()):
        m = PART_RE.match(name)
        if not m or m.group(1) != sha or sha not in sizes:
            raise Refused("upload %r: not the temporary name of a blob of this manifest" % name)
        part = os.path.join(cache, name)
        if not _blob_ok(part, sha, sizes[sha]):
            if os.path.lexists(part):
                os.unlink(part)
            raise Refused("%s: the copy the head sent does not match the manifest's sha256 (removed; did the "
                          "file change on the head since it was scanned? launch again)" % _paths(files, sha))
        os.chmod(part, BLOB_MODE)
        os.replace(part, os.path.join(cache, sha))


def _folder(base: str, rel: str, made: Dict[str, str]) -> str:
    """BASE/REL made one part at a time; a part that exists as anything but a folder is refused."""
    if rel in made:
        return made[rel]
    parent, _, name = rel.rpartition("/")
    path = os.path.join(_folder(base, parent, made) if parent else base, name)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise Refused("%s exists and is not a folder (a symbolic link?): refused" % path) from None
    made[rel] = path
    return path


def _link(blob: str, dest: str) -> bool:
    """A read-only hard link to the blob; False where that cannot be had (root ignores modes; another fs)."""
    if os.geteuid() == 0:
        return False
    try:
        if stat.S_IMODE(os.lstat(blob).st_mode) != BLOB_MODE:
            os.chmod(blob, BLOB_MODE)  # a blob a cache of an older clusterctl left writable
        os.link(blob, dest)
    except OSError:
        return False
    return True


def tree(cache: str, run_dir: str, doc: object) -> Doc:
    """RUN_DIR/program/<path> for every file of the manifest, from verified blobs of the cache."""
    files = load(doc)
    assert isinstance(doc, dict)  # load checked it
    _commit(cache, files, doc.get("incoming", {}))
    for sha, size in sorted({f["sha256"]: f["size"] for f in files.values()}.items()):
        blob = os.path.join(cache, sha)
        ok = _blob_ok(blob, sha, size)
        if ok is None:
            raise Refused("%s: blob %s is not in the cache %s" % (_paths(files, sha), sha, cache))
        if not ok:
            os.unlink(blob)
            raise Refused("%s: blob %s in %s does not match its sha256 (corrupted: removed, not linked; the "
                          "next launch sends it again)" % (_paths(files, sha), sha, cache))
    into = doc.get("into", "program")  # the run's program/ (its code) or data/ (the job's `data`)
    if into not in ("program", "data"):
        raise Refused("into %r: expected program or data" % (into,))
    os.makedirs(run_dir, 0o700, exist_ok=True)
    made = {"": _folder(run_dir, into, {})}
    linked = copied = 0
    for rel in sorted(files):
        f = files[rel]
        parent, _, name = rel.rpartition("/")
        folder = _folder(made[""], parent, made) if parent else made[""]
        dest, tmp = os.path.join(folder, name), os.path.join(folder, ".%s.clusterctl-tmp" % f["sha256"][:16])
        if os.path.lexists(tmp):
            os.unlink(tmp)
        blob = os.path.join(cache, f["sha256"])
        if into == "data" and f["mode"] == 0o644 and _link(blob, tmp):
            linked += 1
        else:  # the program, an executable (a link shares the blob's mode), root, another filesystem
            shutil.copyfile(blob, tmp)
            os.chmod(tmp, f["mode"])
            copied += 1
        os.replace(tmp, dest)
        if os.path.lexists(tmp):  # dest was already a link to the same blob: rename(2) left both names
            os.unlink(tmp)
    # what was shipped, so that collect leaves it on the node (the head has it) and brings what the program wrote
    record = os.path.join(run_dir, SHIPPED % into)
    with open(record + ".tmp", "w") as out:
        json.dump({rel: files[rel]["sha256"] for rel in sorted(files)}, out)
    os.replace(record + ".tmp", record)
    return {"ok": True, "files": len(files), "linked": linked, "copied": copied}


def main(action: str, args: List[str], data: bytes) -> Doc:
    """One action's reply (never raises for bad input or a failing disk: the error is in the reply)."""
    want = {"code-missing": 1, "code-tree": 2}
    if want.get(action) != len(args):
        return {"ok": False, "error": "usage: code-missing CACHE_DIR | code-tree CACHE_DIR RUN_DIR (manifest on stdin)"}
    try:
        doc = json.loads(data.decode("utf-8"))
        if action == "code-missing":
            return missing(args[0], load(doc))
        return tree(args[0], args[1], doc)
    except ValueError as e:  # Refused, and stdin that is not a JSON manifest
        return {"ok": False, "error": str(e)}
    except OSError as e:
        return {"ok": False, "error": "%s: %s" % (e.filename or action, e.strerror or e)}
