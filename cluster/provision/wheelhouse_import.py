"""An export disk's wheelhouses into the head's cache (`wheelhouse import DIR`), all or nothing: each file
verified by sha256 while copied into a staging folder, then one rename per wheelhouse. Provision then finds
them (wheelhouse.cached) and downloads nothing."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster import __version__
from cluster.bounds import FileRefused, file_kind, read_regular
from cluster.errors import ClusterError, UsageError
from cluster.provision import wheelhouse
from cluster.provision.wheelhouse_export import (EXPORT_MANIFEST, FORMAT, FORMAT_VERSION, KEY_RE, Entry, Log,
                                                 Progress, cache_entry, copy_hashed, file_meta_ok, parse_entry,
                                                 platform_tag, wheel_name_ok)

# the only paths an export may name: a wheelhouse's manifest, its pip constraints, its wheels
PATH_RE = re.compile(r"(?P<key>[0-9a-f]{16})/(?:manifest\.json|constraints\.txt|files/(?P<wheel>[^/\\\x00]+\.whl))")
STAGING_PREFIX = ".import-"
ROOM_MARGIN = 64 << 20  # free space kept beyond the files themselves
EXPORT_AGAIN = "export again with clusterctl wheelhouse export DIR"


@dataclass
class Imported:
    entry: Entry
    status: str  # imported | replaced | present (the cache has the same files) | kept (the cache has another build)

    def to_dict(self) -> dict[str, Any]:
        return {**self.entry.summary(), "status": self.status, "dir": str(wheelhouse.cache_dir() / self.entry.key)}


@dataclass
class ImportReport:
    dir: Path
    wheelhouses: list[Imported]
    files: int = 0  # files verified and copied into the cache
    bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "cache": str(wheelhouse.cache_dir()),
                "wheelhouses": [w.to_dict() for w in self.wheelhouses], "files": self.files, "bytes": self.bytes}


class ImportRefused(ClusterError):
    """The export's files do not match its manifest (or cannot be read): nothing was imported. Every mismatch
    is kept (the first ten in the message): the fix is to copy those files again."""

    def __init__(self, src: Path, mismatches: list[str]) -> None:
        shown = "; ".join(mismatches[:10]) + (f"; and {len(mismatches) - 10} more" if len(mismatches) > 10 else "")
        super().__init__(f"{len(mismatches)} file(s) in {src} do not match the export's manifest, nothing was "
                         f"imported: {shown}",
                         "export again on the connected machine (clusterctl wheelhouse export DIR) or copy those "
                         "files again, then import; if it repeats, check the disk")
        self.mismatches = mismatches


def read_export(src: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """DIR/manifest.json, checked: (its wheelhouse summaries by key, every file's {sha256, size} by path)."""
    mpath = src / EXPORT_MANIFEST
    not_export = ("export the wheelhouse to the disk on a machine with internet: clusterctl wheelhouse export DIR; "
                  "a disk whose export was cut short has no manifest: export again")
    try:  # a regular file of bounded size: a FIFO would block the import, /dev/zero exhaust the memory
        doc = json.loads(read_regular(mpath, f"{EXPORT_MANIFEST} is the regular file `clusterctl wheelhouse export "
                                             "DIR` writes: export again, or copy the export's own files to the disk",
                                      noun="an export's manifest"))
    except FileNotFoundError:
        raise UsageError(f"{src}: no {EXPORT_MANIFEST}: not a wheelhouse export (or one cut short)",
                         not_export) from None
    except OSError as e:
        raise UsageError(f"{mpath}: cannot read: {e.strerror}", "check that the disk is mounted") from None
    except (ValueError, UnicodeDecodeError):
        raise UsageError(f"{mpath}: not JSON", not_export) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UsageError(f"{mpath}: not a clusterctl wheelhouse export", not_export)
    if doc.get("version") != FORMAT_VERSION or doc.get("layout") != wheelhouse.LAYOUT:
        raise UsageError(f"{mpath}: written by clusterctl {doc.get('clusterctl')} (export format "
                         f"{doc.get('version')}, wheelhouse layout {doc.get('layout')}); this head reads format "
                         f"{FORMAT_VERSION}, layout {wheelhouse.LAYOUT}",
                         f"build and export with clusterctl {__version__}, the head's version")
    if doc.get("platform") != platform_tag():
        raise UsageError(f"{mpath}: built on {doc.get('platform')}, this head is {platform_tag()}: the wheels "
                         "would not install on its nodes",
                         f"build on a machine of the head's kind ({platform_tag()})")
    files, summaries = doc.get("files"), doc.get("wheelhouses")
    if not isinstance(files, dict) or not isinstance(summaries, dict) or not summaries:
        raise UsageError(f"{mpath}: no wheelhouses listed", not_export)
    for rel, m in files.items():
        match = PATH_RE.fullmatch(rel) if isinstance(rel, str) else None
        if match is None or match["key"] not in summaries or (match["wheel"] and not wheel_name_ok(match["wheel"])):
            raise UsageError(f"{mpath}: lists {rel!r}, which no export holds", EXPORT_AGAIN)
        if not file_meta_ok(m):
            raise UsageError(f"{mpath}: {rel}: no sha256 and size", EXPORT_AGAIN)
    for key in summaries:
        if not isinstance(key, str) or not KEY_RE.fullmatch(key) or f"{key}/manifest.json" not in files:
            raise UsageError(f"{mpath}: wheelhouse {key!r} without its manifest", EXPORT_AGAIN)
    return summaries, files


def import_dir(src: Path, replace: bool = False, log: Log = lambda s: None,
               progress: Progress | None = None) -> ImportReport:
    """Every wheelhouse of the export in `src` into this head's cache, each file verified by sha256 as it is
    copied; only when all match are the wheelhouses moved into place (one rename each). A mismatch, a
    missing or unreadable file, a wheelhouse whose files are not what its manifest lists, or no room:
    ImportRefused / ClusterError, and the cache is as it was. A wheelhouse the cache has complete with the
    same files is left (present); with other files, kept unless `replace`."""
    summaries, files = read_export(src)
    root = wheelhouse.cache_dir()
    src_real = src.resolve()
    mismatches: list[str] = []

    def source(rel: str) -> Path | None:
        p = src / rel
        try:
            if p.is_symlink() or src_real not in p.resolve().parents:
                mismatches.append(f"{rel}: " + ("a link" if p.is_symlink() else "outside the export"))
                return None
            mode = p.stat().st_mode
        except FileNotFoundError:
            mismatches.append(f"{rel}: missing")
            return None
        except OSError as e:
            mismatches.append(f"{rel}: unreadable ({e.strerror})")
            return None
        if not stat.S_ISREG(mode):  # a FIFO would block the import, a device never end
            mismatches.append(f"{rel}: is {file_kind(mode)}, not a regular file")
            return None
        return p

    # the wheelhouses' own manifests first (small): what each must hold, and its key recomputed
    entries: dict[str, Entry] = {}
    for key in summaries:
        man_rel, cons_rel = f"{key}/manifest.json", f"{key}/constraints.txt"
        raw = _read_verified(source(man_rel), files[man_rel], mismatches, man_rel)
        cons = _read_verified(source(cons_rel), files[cons_rel], mismatches, cons_rel) if cons_rel in files else None
        if raw is None or (cons_rel in files and cons is None):
            continue
        e = parse_entry(key, raw, cons, str(src / man_rel))
        if e.expected_key() != key:
            raise UsageError(f"{src / key}: its requirements make the wheelhouse {e.expected_key()}, not {key}: "
                             "built by another clusterctl version", f"build and export with clusterctl {__version__}")
        listed = {PATH_RE.fullmatch(r)["wheel"]: {"sha256": m["sha256"], "size": m["size"]}  # type: ignore[index]
                  for r, m in files.items() if r.startswith(f"{key}/files/")}
        if listed != e.files:
            raise UsageError(f"{src / key}: the export's manifest and the wheelhouse's own disagree on its wheels",
                             EXPORT_AGAIN)
        entries[key] = e
    if mismatches:
        raise ImportRefused(src, mismatches)

    results: list[Imported] = []
    todo: list[Entry] = []
    for key, e in entries.items():
        have = cache_entry(key, root)
        if have is not None and have.files == e.files:
            results.append(Imported(e, "present"))
        elif have is not None and not replace:
            results.append(Imported(e, "kept"))
        else:
            results.append(Imported(e, "replaced" if (root / key).exists() else "imported"))
            todo.append(e)
    if not todo:
        return ImportReport(src, results)
    total = sum(int(files[r]["size"]) for r in files if r.split("/", 1)[0] in {e.key for e in todo})
    try:
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
    except OSError as err:
        raise ClusterError(f"cannot use the wheelhouse cache {root}: {err.strerror}",
                           "check CLUSTERCTL_WHEELHOUSE / CLUSTERCTL_HOME and the permissions") from None
    if total + ROOM_MARGIN > free:
        raise ClusterError(f"the wheelhouse cache {root} has {free / 2**20:.0f} MiB free, the import needs "
                           f"{total / 2**20:.0f} MiB (nothing imported)",
                           "make room on the head's disk, or point CLUSTERCTL_WHEELHOUSE at a larger one")
    log(f"verifying and copying {len(todo)} wheelhouses ({total / 2**20:.0f} MiB) into {root}")
    stage = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    report = ImportReport(src, results)
    try:
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress(done, total)

        for e in todo:
            for rel in [r for r in files if r.split("/", 1)[0] == e.key]:
                meta = files[rel]
                p = source(rel)
                if p is None:
                    continue
                dest = stage / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    digest, size = copy_hashed(p, dest, advance, limit=int(meta["size"]))
                except FileRefused as err:  # changed since source() looked at it
                    mismatches.append(f"{rel}: {err.problem}" if err.size is None
                                      else f"{rel}: {err.size} bytes, the manifest says {meta['size']}")
                    continue
                except OSError as err:
                    mismatches.append(f"{rel}: unreadable ({err.strerror})")
                    continue
                if size != meta["size"]:
                    mismatches.append(f"{rel}: {size} bytes, the manifest says {meta['size']}")
                elif digest != meta["sha256"]:
                    mismatches.append(f"{rel}: sha256 {digest[:16]}..., the manifest says {meta['sha256'][:16]}...")
                report.files += 1
                report.bytes += size
        if mismatches:
            raise ImportRefused(src, mismatches)
        for e in todo:  # all verified: each wheelhouse goes in with one rename, an old one out with another
            target, old = root / e.key, stage / f"old-{e.key}"
            if target.exists():
                os.replace(target, old)
            try:
                os.replace(stage / e.key, target)
            except OSError:
                if old.exists():
                    os.replace(old, target)
                raise
    except OSError as err:
        raise ClusterError(f"import into {root} failed: {err.strerror or err} ({err.filename or root})",
                           "check the head's disk and permissions, then import again") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return report


def _read_verified(p: Path | None, meta: dict[str, Any], mismatches: list[str], rel: str) -> bytes | None:
    """A small file of the export whole, if it matches its sha256; else one more mismatch (all are named)."""
    if p is None:
        return None
    try:
        data = read_regular(p, "export again", noun="a wheelhouse's manifest")
    except FileRefused as e:
        mismatches.append(f"{rel}: {e.problem}")
        return None
    except OSError as e:
        mismatches.append(f"{rel}: unreadable ({e.strerror})")
        return None
    if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
        mismatches.append(f"{rel}: does not match its sha256 in the manifest")
        return None
    return data

