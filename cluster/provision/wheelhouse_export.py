"""The cache's wheelhouses copied to a disk (`wheelhouse export DIR`) for a head without internet: one folder
per key as it lies in the cache, each a manifest.json of its requirements and every wheel's sha256 and size
(Entry); DIR/manifest.json with every file's sha256 and size and the platform the wheels were built on
(wheelhouse_import refuses another); and SHA256SUMS for `sha256sum -c`."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster import __version__
from cluster.bounds import open_regular
from cluster.errors import ClusterError, UsageError
from cluster.paths import write_atomic
from cluster.provision import wheelhouse

Log = Callable[[str], None]
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)

EXPORT_MANIFEST = "manifest.json"  # DIR/manifest.json: what the export holds, every file's sha256 and size
SUMS = "SHA256SUMS"  # the same hashes for `sha256sum -c SHA256SUMS` on any machine
FORMAT = "clusterctl-wheelhouse-export"
FORMAT_VERSION = 1
CHUNK = 1 << 20
KEY_RE = re.compile(r"[0-9a-f]{16}")
SHA_RE = re.compile(r"[0-9a-f]{64}")


def platform_tag() -> str:
    """The platform pip downloads for on this machine (linux-x86_64)."""
    return sysconfig.get_platform()


@dataclass(frozen=True)
class Entry:
    """One wheelhouse folder, as its manifest lists it."""

    key: str
    requirements: tuple[str, ...]
    python: str
    index: str | None
    constraints: tuple[str, ...]
    files: dict[str, dict[str, Any]]  # wheel filename -> {sha256, size}

    @property
    def bytes(self) -> int:
        return sum(int(m["size"]) for m in self.files.values())

    def expected_key(self) -> str:
        return wheelhouse.key(list(self.requirements), self.python, self.index, self.constraints)

    def summary(self) -> dict[str, Any]:
        return {"key": self.key, "requirements": list(self.requirements), "python": self.python,
                "index": self.index, "constraints": list(self.constraints), "files": len(self.files),
                "bytes": self.bytes}


def parse_entry(key: str, manifest: bytes, constraints: bytes | None, where: str) -> Entry:
    """A wheelhouse's manifest.json (and constraints.txt) -> Entry; UsageError naming `where` if malformed."""
    try:
        doc = json.loads(manifest)
        reqs = doc["requirements"]
        python = doc["python"]
        index = doc.get("index")
        files = doc["files"]
        ok = (isinstance(reqs, list) and all(isinstance(r, str) for r in reqs) and isinstance(python, str)
              and (index is None or isinstance(index, str)) and isinstance(files, dict)
              and all(isinstance(f, str) and wheel_name_ok(f) and file_meta_ok(m) for f, m in files.items()))
        cons = tuple(line.strip() for line in (constraints or b"").decode().splitlines() if line.strip())
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise UsageError(f"{where}: not a wheelhouse manifest (requirements, python, index, files)",
                         "build the wheelhouse again with `clusterctl wheelhouse build`")
    return Entry(key, tuple(reqs), python, index, cons,
                 {f: {"sha256": m["sha256"], "size": m["size"]} for f, m in files.items()})


def wheel_name_ok(name: str) -> bool:
    """A wheel's file name, never a path: a manifest's names become paths in the cache."""
    return (name.endswith(".whl") and not name.startswith(".") and "/" not in name and "\\" not in name
            and "\x00" not in name)


def file_meta_ok(m: Any) -> bool:
    """A file's {sha256, size} as a manifest lists it: a hex sha256, a size in bytes."""
    return (isinstance(m, dict) and isinstance(m.get("sha256"), str) and SHA_RE.fullmatch(m["sha256"]) is not None
            and isinstance(m.get("size"), int) and not isinstance(m["size"], bool) and m["size"] >= 0)


def cache_entry(key: str, root: Path | None = None) -> Entry | None:
    """A complete wheelhouse of the cache (manifest readable, every wheel there at its size), else None."""
    d = (root or wheelhouse.cache_dir()) / key
    try:
        manifest = (d / "manifest.json").read_bytes()
        cons = (d / "constraints.txt").read_bytes() if (d / "constraints.txt").exists() else None
        e = parse_entry(key, manifest, cons, str(d / "manifest.json"))
    except (OSError, UsageError):
        return None
    for f, m in e.files.items():
        p = d / "files" / f
        try:
            if p.is_symlink() or p.stat().st_size != m["size"]:
                return None
        except OSError:
            return None
    return e


def cached_keys(root: Path) -> tuple[list[str], list[str]]:
    """The cache's wheelhouse folders: (complete, incomplete: an interrupted download or a damaged one)."""
    try:
        keys = sorted(p.name for p in root.iterdir() if p.is_dir() and KEY_RE.fullmatch(p.name))
    except OSError:
        return [], []
    complete = [k for k in keys if cache_entry(k, root) is not None]
    return complete, [k for k in keys if k not in complete]


@dataclass
class ExportReport:
    dir: Path
    wheelhouses: list[Entry]
    copied: int = 0  # files written this time
    kept: int = 0  # files already on the disk with the right sha256
    bytes_copied: int = 0
    incomplete: list[str] = field(default_factory=list)  # cache folders left out (no manifest, files missing)

    def to_dict(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "manifest": str(self.dir / EXPORT_MANIFEST),
                "wheelhouses": [e.summary() for e in self.wheelhouses],
                "files": self.copied + self.kept, "copied": self.copied, "kept": self.kept,
                "bytes": sum(e.bytes for e in self.wheelhouses), "bytes_copied": self.bytes_copied,
                "incomplete": self.incomplete}


def _inside(a: Path, b: Path) -> bool:
    """a is b or lies under it (links resolved): an export into the cache would copy files onto themselves."""
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def export(dest: Path, keys: list[str] | None = None, log: Log = lambda s: None,
           progress: Progress | None = None) -> ExportReport:
    """Copy the cache's wheelhouses (`keys`, default every complete one) to `dest` with a manifest of
    sha256s. Each wheel is hashed as it is read and must match the cache's manifest (a damaged cache is
    refused, naming the file). Incremental: a file already on the disk with its sha256 is not written again.
    The manifest is written last (after the old one is removed), so a cut export has none and import refuses it."""
    root = wheelhouse.cache_dir()
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"{dest} is a file", "give a folder (a mounted USB disk, or a folder on it)")
    if _inside(dest, root) or (root.exists() and _inside(root, dest)):
        raise UsageError(f"{dest} and the wheelhouse cache {root} overlap",
                         "export to a folder outside the cache (a mounted disk)")
    complete, incomplete = cached_keys(root)
    if keys is None:
        chosen = complete
        if not chosen:
            raise ClusterError(f"the wheelhouse cache {root} has no complete wheelhouse to export"
                               + (f" ({len(incomplete)} incomplete)" if incomplete else ""),
                               "fill it first: clusterctl wheelhouse build INVENTORY (or --for py3.11,cpu)")
    else:
        missing = [k for k in keys if k not in complete]
        if missing:
            raise ClusterError(f"not in the wheelhouse cache {root} (or incomplete): {', '.join(missing)}",
                               "build them first on this machine: clusterctl wheelhouse build with the same "
                               "inventory or --for targets")
        chosen = list(dict.fromkeys(keys))
        incomplete = []
    entries = [e for e in (cache_entry(k, root) for k in chosen) if e is not None]
    todo: list[tuple[Path, str, dict[str, Any] | None]] = []  # (source, path in the export, expected meta)
    for e in entries:
        d = root / e.key
        todo.append((d / "manifest.json", f"{e.key}/manifest.json", None))
        if (d / "constraints.txt").exists():
            todo.append((d / "constraints.txt", f"{e.key}/constraints.txt", None))
        todo += [(d / "files" / f, f"{e.key}/files/{f}", m) for f, m in sorted(e.files.items())]
    report = ExportReport(dest, entries, incomplete=incomplete)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / EXPORT_MANIFEST).unlink(missing_ok=True)  # an export cut short from here on has no manifest
        total = sum(src.stat().st_size for src, _, _ in todo)
        need = sum(src.stat().st_size for src, rel, _ in todo if _size(dest / rel) != src.stat().st_size)
        free = shutil.disk_usage(dest).free
        if need > free:
            raise ClusterError(f"{dest} has {free / 2**20:.0f} MiB free, the export needs {need / 2**20:.0f} MiB",
                               "use a larger disk, or export fewer wheelhouses (INVENTORY or --for)")
        log(f"exporting {len(entries)} wheelhouses ({total / 2**20:.0f} MiB) to {dest}")
        done = 0
        listed: dict[str, dict[str, Any]] = {}
        for src, rel, meta in todo:
            target = dest / rel
            size = src.stat().st_size
            expected = str(meta["sha256"]) if meta else None
            have = wheelhouse.sha256_file(target) if _size(target) == size else None
            if have is not None and have == (expected or wheelhouse.sha256_file(src)):
                digest = have
                report.kept += 1
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_name(f".{target.name}.part")
                digest, size = copy_hashed(src, part)
                if meta is not None and (digest != meta["sha256"] or size != meta["size"]):
                    part.unlink(missing_ok=True)
                    raise ClusterError(f"the cache's {src} does not match its manifest (sha256 {digest[:12]}..., "
                                       f"expected {str(meta['sha256'])[:12]}...): the cache is damaged",
                                       f"delete {src.parent.parent} and build it again "
                                       "(clusterctl wheelhouse build), then export again")
                os.replace(part, target)
                report.copied += 1
                report.bytes_copied += size
            listed[rel] = {"sha256": digest, "size": size}
            done += size
            if progress:
                progress(done, total)
        doc = {"format": FORMAT, "version": FORMAT_VERSION, "clusterctl": __version__, "layout": wheelhouse.LAYOUT,
               "platform": platform_tag(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "wheelhouses": {e.key: e.summary() for e in entries}, "files": listed}
        write_atomic(dest / SUMS, "".join(f"{m['sha256']}  {rel}\n" for rel, m in listed.items()))
        write_atomic(dest / EXPORT_MANIFEST, json.dumps(doc, indent=1))
    except OSError as e:
        raise ClusterError(f"cannot write the export to {dest}: {e.strerror or e} ({e.filename or dest})",
                           "check that the disk is mounted writable and has room, then export again") from None
    return report


def _size(p: Path) -> int | None:
    """A regular file's size, else None: what is on the disk already, if it can be kept."""
    try:
        return p.stat().st_size if p.is_file() and not p.is_symlink() else None
    except OSError:
        return None


def copy_hashed(src: Path, dest: Path, progress: Callable[[int], None] | None = None,
                limit: int | None = None) -> tuple[str, int]:
    """Copy src to dest, hashing what was read; synced to the disk. (sha256, bytes). `limit`: src is a file
    of the export, refused unless a regular file of at most `limit` bytes, and no more than one byte past
    it is read (a file that grows is a mismatch, not a full disk)."""
    h = hashlib.sha256()
    n = 0
    with open_regular(src, "a wheel is a regular file: build or export the wheelhouse again", limit,
                      "its entry in the manifest says") as fi, open(dest, "wb") as fo:
        for chunk in iter(lambda: fi.read(CHUNK if limit is None else min(CHUNK, limit + 1 - n)), b""):
            h.update(chunk)
            fo.write(chunk)
            n += len(chunk)
            if progress:
                progress(len(chunk))
        fo.flush()
        os.fsync(fo.fileno())
    return h.hexdigest(), n

