"""A head without internet: its wheelhouse built on a machine that has internet, carried on a disk, imported.

`build` fills this machine's wheelhouse cache (wheelhouse.cache_dir()) with exactly the wheelhouses
provision would download for an inventory: the same facts -> builds -> requirement sets
(apply.wheelhouse_sets), or for nodes described by `--for` targets (`py3.11,cpu,cu126`) put through the
same builds. `export DIR` copies cached wheelhouses to DIR (a USB disk) as they lie in the cache, one
folder per wheelhouse key, with a top-level manifest.json of every file's sha256 and size (and SHA256SUMS
for `sha256sum -c`). `import DIR` on the head copies each file into a staging folder inside the cache
while hashing it, and only when every file matched moves the wheelhouses into place, each with one
rename: a mismatch, a missing file or no room leaves the cache as it was. Provision then finds them
(wheelhouse.cached) and downloads nothing.

pip downloads for this machine's platform (as provision on the head does), so the machine that builds
must be of the head's kind (Linux, the nodes' architecture): the export says which platform it was
built on and import refuses another. The library raises ClusterError; the CLI (cli/wheelhouse.py) prints.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cluster import __version__
from cluster.bounds import FileRefused, file_kind, open_regular, read_regular
from cluster.errors import ClusterError, UsageError
from cluster.nodes.facts import NodeFacts
from cluster.provision import apply, compat, playbook, wheelhouse
from cluster.provision.report import NodeOutcome

if TYPE_CHECKING:
    from cluster.inventory.model import Host, Inventory

Log = Callable[[str], None]
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)

EXPORT_MANIFEST = "manifest.json"  # DIR/manifest.json: what the export holds, every file's sha256 and size
SUMS = "SHA256SUMS"  # the same hashes for `sha256sum -c SHA256SUMS` on any machine
FORMAT = "clusterctl-wheelhouse-export"
FORMAT_VERSION = 1
KEY_RE = re.compile(r"[0-9a-f]{16}")
# the only paths an export may name: a wheelhouse's manifest, its pip constraints, its wheels
PATH_RE = re.compile(r"(?P<key>[0-9a-f]{16})/(?:manifest\.json|constraints\.txt|files/(?P<wheel>[^/\\\x00]+\.whl))")
SHA_RE = re.compile(r"[0-9a-f]{64}")
STAGING_PREFIX = ".import-"
FACTS_FIX = "on the head: clusterctl check INVENTORY --json > facts.json"
FACTS_MAX_BYTES = 64 << 20  # `check --json` of a few hundred nodes is a few MiB
CHUNK = 1 << 20
ROOM_MARGIN = 64 << 20  # free space kept beyond the files themselves

# `--for` GPU words: the build each names, as the node a card of that kind makes (compat decides the rest)
VARIANT_GPUS: dict[str, tuple[str, str, str]] = {
    "cu126": ("NVIDIA GeForce GTX 1080", "6.1", compat.RECOMMENDED_DRIVER),  # Pascal on R580: this lab's PCs
    "cu130": ("NVIDIA GeForce RTX 5080", "12.0", compat.RECOMMENDED_DRIVER),  # Blackwell: only cu130 runs it
    "cu118": ("NVIDIA GeForce GTX 1080", "6.1", "470.256.02"),  # an R470 driver: only cu118 (torch 2.7.1) runs
}
TARGET_HELP = ("a comma list: the nodes' Python (py3.11) and one word per kind of node: cpu; cu126 (a Pascal "
               "card such as a GTX 1080 on the R580 driver), cu130 (a Blackwell card), cu118 (a card on an R470 "
               "driver); or cc6.1 / cc8.6@550.54.14 (a card's compute capability, @ its driver; default R580)")


def platform_tag() -> str:
    """The platform pip downloads for on this machine (linux-x86_64)."""
    return sysconfig.get_platform()


# --------------------------------------------------------------------------- what to build: the requirement sets


@dataclass(frozen=True)
class Target:
    """One kind of node named by `--for`."""

    word: str  # as given: cpu, cu126, cc6.1@470.256.02
    python: str  # "3.11"
    gpu: dict[str, str] | None  # facts' GPU entry (name, compute_capability, driver); None: no GPU


def parse_targets(values: list[str]) -> list[Target]:
    """`--for` values (`py3.11,cpu,cu126`, repeatable): each value's Python and one node per GPU word."""
    targets: list[Target] = []
    for value in values:
        words = [w.strip() for w in value.split(",") if w.strip()]
        pythons = [w for w in words if w.startswith("py")]
        kinds = [w for w in words if not w.startswith("py")]
        if len(pythons) != 1 or not re.fullmatch(r"py3\.\d{1,2}", pythons[0]):
            raise UsageError(f"--for {value!r}: name the nodes' Python once, as py3.11",
                             f"--for py3.11,cpu ({TARGET_HELP})")
        if not kinds:
            raise UsageError(f"--for {value!r}: no kind of node (cpu, cu126, ...)", f"--for {pythons[0]},cpu")
        python = pythons[0][2:]
        for word in kinds:
            targets.append(Target(word, python, _gpu(word, value)))
    if not targets:
        raise UsageError("--for: no targets given", f"e.g. --for py3.11,cpu ({TARGET_HELP})")
    return targets


def _gpu(word: str, value: str) -> dict[str, str] | None:
    if word == "cpu":
        return None
    if word in VARIANT_GPUS:
        name, cc, driver = VARIANT_GPUS[word]
        return {"name": name, "compute_capability": cc, "driver": driver}
    m = re.fullmatch(r"cc(\d{1,2}\.\d{1,2})(?:@(\d{2,4}(?:\.\d{1,4}){1,2}))?", word)
    if m is None:
        raise UsageError(f"--for {value!r}: unknown kind of node {word!r}", TARGET_HELP)
    return {"name": f"a GPU of compute capability {m[1]}", "compute_capability": m[1],
            "driver": m[2] or compat.RECOMMENDED_DRIVER}


def target_inventory(targets: list[Target], torch_index: str = "pytorch",
                     extra_packages: tuple[str, ...] = ()) -> tuple[Inventory, dict[str, NodeFacts]]:
    """The targets as the nodes of one lab, with the facts such nodes would report (what provision plans from)."""
    from cluster.inventory.model import Host, Inventory

    if torch_index not in ("pytorch", "pypi"):
        raise UsageError(f"--torch-index {torch_index!r}: expected pytorch or pypi", "--torch-index pytorch")
    hosts: dict[str, Host] = {}
    nf: dict[str, NodeFacts] = {}
    for t in targets:
        base = f"{t.word}-py{t.python}".replace("@", "-")
        name = base if base not in hosts else f"{base}-{sum(n.startswith(base) for n in hosts) + 1}"
        hosts[name] = Host(name=name, address="127.0.0.1", connection="local",
                           vars={"torch_index": torch_index, "extra_packages": list(extra_packages)})
        major, minor = (int(x) for x in t.python.split("."))
        nf[name] = NodeFacts(name, {"python": {"version": t.python, "version_tuple": [major, minor]},
                                    "gpus": {"source": "--for", "gpus": [t.gpu] if t.gpu else []}})
    first = next(iter(hosts))
    return Inventory(Path("--for"), "targets", hosts, {}, first), nf


def facts_file(path: Path, hosts: list[Host]) -> tuple[dict[str, NodeFacts], dict[str, NodeOutcome]]:
    """Facts from `clusterctl check --json` (run on the head, which reaches the nodes): each node's facts,
    and the nodes check could not reach (unreachable: no facts to choose builds from)."""
    try:
        doc = json.loads(read_regular(path, FACTS_FIX, FACTS_MAX_BYTES, "a facts file"))
        entries = {str(n["host"]): n for n in doc["nodes"]}
    except OSError as e:
        raise UsageError(f"{path}: cannot read the facts: {e.strerror}", "check the path") from None
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{path}: not the output of `clusterctl check --json`", FACTS_FIX) from None
    nf: dict[str, NodeFacts] = {}
    out = {h.name: NodeOutcome(h.name) for h in hosts}
    for h in hosts:
        n = entries.get(h.name)
        if n is None:
            raise UsageError(f"{path}: no facts for {h.name}",
                             "run `clusterctl check INVENTORY --json` with the same inventory on the head")
        f = n.get("facts") if isinstance(n, dict) else None
        if not isinstance(f, dict):
            out[h.name].fail("unreachable", f"{h.name} was not reached when {path} was written (no facts)",
                             "run `clusterctl check --json` again on the head once the node answers")
            continue
        values = {k: v for k, v in f.items() if k not in ("host", "address_nic", "clock_offset_s",
                                                          "clock_uncertainty_s")}
        py = values.get("python")
        if py is not None and not (isinstance(py, dict) and isinstance(py.get("version_tuple"), list)
                                   and len(py["version_tuple"]) >= 2
                                   and all(isinstance(x, int) for x in py["version_tuple"][:2])):
            raise UsageError(f"{path}: {h.name}: facts.python is not as `check --json` writes it",
                             "write the file with `clusterctl check INVENTORY --json`")
        gpus = (values.get("gpus") or {}).get("gpus", []) if isinstance(values.get("gpus"), dict) else None
        if not isinstance(gpus, list) or not all(_gpu_fact_ok(g) for g in gpus):
            raise UsageError(f"{path}: {h.name}: facts.gpus is not as `check --json` writes it",
                             "write the file with `clusterctl check INVENTORY --json`")
        nf[h.name] = NodeFacts(h.name, values, f.get("address_nic"))
    return nf, out


def _gpu_fact_ok(g: Any) -> bool:
    """A GPU as facts give it: a name, a driver version, a compute capability (or none: compat refuses it)."""
    cc = g.get("compute_capability") if isinstance(g, dict) else None
    return (isinstance(g, dict) and isinstance(g.get("name"), str)
            and isinstance(g.get("driver"), str) and re.fullmatch(r"\d+(\.\d+)*", g["driver"]) is not None
            and (cc is None or (isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc) is not None)))


@dataclass(frozen=True)
class Planned:
    """One wheelhouse provision would build, and the nodes (or targets) that use it."""

    requirements: tuple[str, ...]
    python: str
    index: str | None
    nodes: tuple[str, ...]

    @property
    def key(self) -> str:
        return wheelhouse.key(list(self.requirements), self.python, self.index)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "requirements": list(self.requirements), "python": self.python,
                "index": self.index, "nodes": list(self.nodes)}


@dataclass
class Selection:
    """What `build` and `export` work on: the builds chosen, their wheelhouses, and the nodes left out and why."""

    source: str  # the inventory's path, or "--for ..."
    choice: compat.BuildChoice | None
    sets: list[Planned]
    left_out: dict[str, NodeOutcome]

    @property
    def unreachable(self) -> bool:
        return any(o.status == "unreachable" for o in self.left_out.values())


def select(inv: Inventory, hosts: list[Host], facts: dict[str, NodeFacts] | None = None,
           outcomes: dict[str, NodeOutcome] | None = None, forks: int = 32, source: str | None = None,
           log: Log = lambda s: None) -> Selection:
    """The wheelhouses provision would build for these nodes: from `facts` when given (a facts file,
    `--for` targets), else gathered from the nodes as provision gathers them (read-only)."""
    if facts is None:
        request = apply.prepare(inv, hosts, forks=forks, log=log)
    else:
        pb = playbook.load("provision")
        hosts = inv.ordered(hosts)
        request = apply.request_for(inv, hosts, {n: f for n, f in facts.items() if n in {h.name for h in hosts}},
                                    pb, outcomes)
    out = request.outcomes
    groups = apply.wheelhouse_sets(request.planned, request.facts, request.choice, out)
    sets = [Planned(reqs, py, index, tuple(names)) for (reqs, py, index), names in groups.items()]
    left = {n: o for n, o in out.items() if o.status != "pending"}
    for h in request.hosts:  # `python_env: existing`: provision installs nothing there, so no wheelhouse
        if h.name not in left and not any(h.name in s.nodes for s in sets):
            o = NodeOutcome(h.name)
            o.fail("skipped", "no wheelhouse: the node's playbook installs nothing (python_env is not venv)")
            left[h.name] = o
    return Selection(source or str(inv.path), request.choice, sets, left)


# --------------------------------------------------------------------------- build


@dataclass
class Built:
    planned: Planned
    status: str  # cached | downloaded | failed | missing (a dry run: not in the cache)
    files: int = 0
    bytes: int = 0
    error: str | None = None
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.planned.to_dict(), "status": self.status, "files": self.files, "bytes": self.bytes,
                "dir": str(wheelhouse.cache_dir() / self.planned.key), "error": self.error, "fix": self.fix}


def build(selection: Selection, dry_run: bool = False, log: Log = lambda s: None) -> list[Built]:
    """Download every wheelhouse of the selection into this machine's cache (those already there stay):
    exactly what provision's wheelhouse.build does for each. A failed download is data, the others go on.
    `dry_run`: only say which are cached and which are missing."""
    out = []
    for p in selection.sets:
        wh = wheelhouse.cached(list(p.requirements), p.python, p.index)
        status = "cached"
        if wh is None and dry_run:
            out.append(Built(p, "missing"))
            continue
        if wh is None:
            try:
                wh = wheelhouse.build(list(p.requirements), p.python, p.index, log=log)
                status = "downloaded"
            except ClusterError as e:
                out.append(Built(p, "failed", error=e.message, fix=e.fix))
                continue
        out.append(Built(p, status, len(wh.files), wh.total_bytes))
    return out


# --------------------------------------------------------------------------- the cache's wheelhouses


@dataclass(frozen=True)
class Entry:
    """A wheelhouse folder (in the cache or on an export disk) as its manifest.json describes it."""

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
              and all(isinstance(f, str) and _wheel_name_ok(f) and isinstance(m, dict)
                      and isinstance(m.get("sha256"), str) and SHA_RE.fullmatch(m["sha256"]) is not None
                      and isinstance(m.get("size"), int) and not isinstance(m["size"], bool) and m["size"] >= 0
                      for f, m in files.items()))
        cons = tuple(line.strip() for line in (constraints or b"").decode().splitlines() if line.strip())
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise UsageError(f"{where}: not a wheelhouse manifest (requirements, python, index, files)",
                         "build the wheelhouse again with `clusterctl wheelhouse build`")
    return Entry(key, tuple(reqs), python, index, cons,
                 {f: {"sha256": m["sha256"], "size": m["size"]} for f, m in files.items()})


def _wheel_name_ok(name: str) -> bool:
    return (name.endswith(".whl") and not name.startswith(".") and "/" not in name and "\\" not in name
            and "\x00" not in name)


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


def cached_keys(root: Path | None = None) -> tuple[list[str], list[str]]:
    """The cache's wheelhouse folders: (complete, incomplete: an interrupted download or a damaged one)."""
    d = root or wheelhouse.cache_dir()
    try:
        keys = sorted(p.name for p in d.iterdir() if p.is_dir() and KEY_RE.fullmatch(p.name))
    except OSError:
        return [], []
    complete = [k for k in keys if cache_entry(k, d) is not None]
    return complete, [k for k in keys if k not in complete]


# --------------------------------------------------------------------------- export


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
            if _size(target) == size and wheelhouse.sha256_file(target) == (expected or wheelhouse.sha256_file(src)):
                digest = expected or wheelhouse.sha256_file(target)
                report.kept += 1
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_name(f".{target.name}.part")
                digest, size = _copy_hashed(src, part)
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
        _write_synced(dest / SUMS, "".join(f"{m['sha256']}  {rel}\n" for rel, m in listed.items()).encode())
        _write_synced(dest / EXPORT_MANIFEST, json.dumps(doc, indent=1).encode())
    except OSError as e:
        raise ClusterError(f"cannot write the export to {dest}: {e.strerror or e} ({e.filename or dest})",
                           "check that the disk is mounted writable and has room, then export again") from None
    return report


def _size(p: Path) -> int | None:
    try:
        return p.stat().st_size if p.is_file() and not p.is_symlink() else None
    except OSError:
        return None


def _copy_hashed(src: Path, dest: Path, progress: Callable[[int], None] | None = None,
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


def _write_synced(path: Path, data: bytes) -> None:
    """Write through a temporary file and one rename: readers see the old file or the whole new one."""
    part = path.with_name(f".{path.name}.part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


# --------------------------------------------------------------------------- import


@dataclass
class Imported:
    entry: Entry
    status: str  # imported | replaced | present (the cache has the same files) | kept (the cache has another build)

    def to_dict(self) -> dict[str, Any]:
        return {**self.entry.summary(), "status": self.status,
                "dir": str(wheelhouse.cache_dir() / self.entry.key)}


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
    """The export's files do not match its manifest (or cannot be read): nothing was imported."""

    def __init__(self, message: str, fix: str, mismatches: list[str]) -> None:
        super().__init__(message, fix)
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
        if match is None or match["key"] not in summaries or (match["wheel"] and not _wheel_name_ok(match["wheel"])):
            raise UsageError(f"{mpath}: lists {rel!r}, which no export holds",
                             "export again with clusterctl wheelhouse export DIR")
        if not (isinstance(m, dict) and isinstance(m.get("sha256"), str) and SHA_RE.fullmatch(m["sha256"])
                and isinstance(m.get("size"), int) and not isinstance(m["size"], bool) and m["size"] >= 0):
            raise UsageError(f"{mpath}: {rel}: no sha256 and size", "export again with clusterctl wheelhouse export DIR")
    for key in summaries:
        if not isinstance(key, str) or not KEY_RE.fullmatch(key) or f"{key}/manifest.json" not in files:
            raise UsageError(f"{mpath}: wheelhouse {key!r} without its manifest",
                             "export again with clusterctl wheelhouse export DIR")
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
        raw = _read_verified(source(f"{key}/manifest.json"), files[f"{key}/manifest.json"], mismatches,
                             f"{key}/manifest.json")
        cons_rel = f"{key}/constraints.txt"
        cons = _read_verified(source(cons_rel), files[cons_rel], mismatches, cons_rel) if cons_rel in files else None
        if raw is None or (cons_rel in files and cons is None):
            continue
        e = parse_entry(key, raw, cons, str(src / key / "manifest.json"))
        if e.expected_key() != key:
            raise UsageError(f"{src / key}: its requirements make the wheelhouse {e.expected_key()}, not {key}: "
                             "built by another clusterctl version", f"build and export with clusterctl {__version__}")
        listed = {PATH_RE.fullmatch(r)["wheel"]: m for r, m in files.items()  # type: ignore[index]
                  if r.startswith(f"{key}/files/")}
        if set(listed) != set(e.files) or any(listed[f]["sha256"] != m["sha256"] or listed[f]["size"] != m["size"]
                                              for f, m in e.files.items()):
            raise UsageError(f"{src / key}: the export's manifest and the wheelhouse's own disagree on its wheels",
                             "export again with clusterctl wheelhouse export DIR")
        entries[key] = e
    if mismatches:
        raise _refused(src, mismatches)

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
                    digest, size = _copy_hashed(p, dest, advance, limit=int(meta["size"]))
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
            raise _refused(src, mismatches)
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


def _refused(src: Path, mismatches: list[str]) -> ImportRefused:
    shown = "; ".join(mismatches[:10]) + (f"; and {len(mismatches) - 10} more" if len(mismatches) > 10 else "")
    return ImportRefused(f"{len(mismatches)} file(s) in {src} do not match the export's manifest, nothing was "
                         f"imported: {shown}",
                         "export again on the connected machine (clusterctl wheelhouse export DIR) or copy those "
                         "files again, then import; if it repeats, check the disk", mismatches)


__all__ = ["EXPORT_MANIFEST", "SUMS", "Built", "Entry", "ExportReport", "ImportRefused", "ImportReport", "Imported",
           "Planned", "Selection", "Target", "build", "cache_entry", "cached_keys", "export", "facts_file",
           "import_dir", "parse_targets", "platform_tag", "read_export", "select", "target_inventory"]
