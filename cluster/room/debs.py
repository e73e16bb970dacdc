"""Debian's munge and Slurm packages for the room: which each role needs, resolved as apt resolves them (from
`apt-cache depends` and `dpkg-query` output), a bundle of the .deb files per release and architecture on the
head (<home>/debs/<codename>-<arch>/, for PCs without a package index), and the shell script that installs
what a PC lacks without Debian's scripts starting daemons before their config exists. The bundle is carried
like the wheels (debs_carry: export, import, sha256-verified); 'wheelhouse' stays the Python wheels' name."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from cluster.errors import ClusterError, UsageError
from cluster.nodes.facts import OS_CMD, parse_os
from cluster.paths import home, write_atomic
from cluster.provision.wheelhouse import sha256_file
from cluster.provision.wheelhouse_export import file_meta_ok

Log = Callable[[str], None]
Progress = Callable[[int, int], None]  # (packages done, packages in all)

# the top packages each role installs; apt (or the bundle) brings their dependencies, slurm-wlm-basic-plugins too
ROLES: dict[str, tuple[str, ...]] = {"controller": ("munge", "slurmctld", "slurm-client"),
                                     "node": ("munge", "slurmd", "slurm-client")}
# what apt-get install follows: Depends and Pre-Depends (apt-cache depends prints PreDepends unless told not to)
DEPENDS_FLAGS = ("--recurse", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks",
                 "--no-replaces", "--no-enhances")
DPKG_QUERY = "dpkg-query -W -f '${Package}\\t${Version}\\t${db:Status-Abbrev}\\n'"
MANIFEST = "manifest.json"
FORMAT, FORMAT_VERSION = "clusterctl-debs", 1
RELEASE_RE = re.compile(r"[a-z0-9][a-z0-9.+-]*")  # a codename or a dpkg architecture: a folder name too
DEB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+~%_-]*\.deb")  # apt-get download's file name, never a path
PACKAGE_RE = re.compile(r"[a-z0-9][a-z0-9.+-]+")
POLICY = "/usr/sbin/policy-rc.d"
POLICY_MARK = "# clusterctl: no daemon starts while packages install"
DEFAULT_FOLDER = "/tmp/clusterctl-debs"


@dataclass(frozen=True)
class Depends:
    """`apt-cache depends --recurse` output: each real package's dependency groups (alternatives in apt's
    order; a virtual name as <name>) and, per name, the packages apt lists as providing it."""

    groups: dict[str, list[list[str]]]
    providers: dict[str, list[str]]

    def to_dict(self) -> dict[str, Any]:
        return {"groups": self.groups, "providers": self.providers}


def parse_depends(text: str) -> Depends:
    """A package line at column 0 (`<name>`: virtual, no groups), `  Depends:`/`  PreDepends:` under it, a
    leading `|` joining the next line as an alternative, and providers indented four spaces under a dependency."""
    groups: dict[str, list[list[str]]] = {}
    providers: dict[str, list[str]] = {}
    current: list[list[str]] | None = None
    last: str | None = None
    joined = False
    for line in text.splitlines():
        dep = re.fullmatch(r" (\|| )(?:Pre)?Depends: (\S+)", line)
        if not line.startswith(" ") and line.strip():
            name = line.strip()
            current = None if name.startswith("<") else groups.setdefault(name, [])
            last, joined = None, False
        elif dep and current is not None:
            target = dep[2].strip("<>")
            if joined and current:
                current[-1].append(target)
            else:
                current.append([target])
            last, joined = target, dep[1] == "|"
        elif line.startswith("    ") and last is not None:
            providers.setdefault(last, [])
            if line.strip() not in providers[last]:
                providers[last].append(line.strip())
    return Depends({k: _unique_groups(v) for k, v in groups.items()}, providers)


def _unique_groups(groups: list[list[str]]) -> list[list[str]]:
    """apt-cache prints a dependency twice when the control file names it twice (versioned ranges)."""
    return [g for i, g in enumerate(groups) if g not in groups[:i]]


def parse_installed(text: str) -> dict[str, str]:
    """DPKG_QUERY's output -> {package: version} of what is installed (status `ii`; `rc` is only config left)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[2][:2] == "ii":
            out[parts[0].split(":")[0]] = parts[1]
    return out


def resolve(dep: Depends, roots: Iterable[str], installed: Iterable[str] = ()) -> list[str]:
    """The packages apt would add to install `roots` on a PC that has `installed`, dependencies first. A group
    is met by any installed alternative or a provider of one; else apt takes the first alternative that is a
    real package (a virtual one: its first real provider). An installed package's own dependencies are met."""
    have = set(installed)
    chosen: list[str] = []
    seen: set[str] = set()

    def met(group: list[str]) -> bool:
        names = set(group) | {p for a in group for p in dep.providers.get(a, [])}
        return bool(names & (have | seen))

    def visit(name: str) -> None:
        if name in have or name in seen:
            return
        seen.add(name)
        for group in dep.groups[name]:
            if not met(group):
                visit(_pick(dep, name, group))
        chosen.append(name)

    for root in roots:
        if root not in dep.groups:
            raise ClusterError(f"the package index has no package {root}",
                               "apt-get update on that machine (Debian's main archive has it)")
        visit(root)
    return chosen


def _pick(dep: Depends, who: str, group: list[str]) -> str:
    for alt in group:
        if alt in dep.groups:
            return alt
    for alt in group:
        for p in dep.providers.get(alt, []):
            if p in dep.groups:
                return p
    raise ClusterError(f"{who} depends on {' | '.join(group)}, which no package of the index provides",
                       "apt-get update on that machine, or enable the archive area that has it")


@dataclass(frozen=True)
class Candidate:
    """One package's candidate in the index (`apt-cache show --no-all-versions`)."""

    package: str
    version: str
    arch: str
    sha256: str
    size: int

    @property
    def file(self) -> str:
        """The name apt-get download gives it (an epoch's colon written %3a)."""
        return f"{self.package}_{self.version.replace(':', '%3a')}_{self.arch}.deb"


def parse_show(text: str) -> dict[str, Candidate]:
    out: dict[str, Candidate] = {}
    for stanza in re.split(r"\n\s*\n", text):
        f = dict(re.findall(r"^([A-Za-z0-9-]+): ?(.*)$", stanza, re.M))
        if {"Package", "Version", "Architecture", "SHA256", "Size"} <= f.keys():
            out.setdefault(f["Package"], Candidate(f["Package"], f["Version"], f["Architecture"], f["SHA256"],
                                                   int(f["Size"])))
    return out


# --------------------------------------------------------------------------- the bundle on the head


def release_name(codename: str, arch: str) -> str:
    for what, v in (("release", codename), ("architecture", arch)):
        if not RELEASE_RE.fullmatch(v or ""):
            raise UsageError(f"{v!r} is not a Debian {what} name", "e.g. --release bookworm --arch amd64")
    return f"{codename}-{arch}"


def debs_root() -> Path:
    """Every bundle lives here, beside the head's other state (CLUSTERCTL_HOME)."""
    return home() / "debs"


def bundle_dir(codename: str, arch: str) -> Path:
    return debs_root() / release_name(codename, arch)


@dataclass(frozen=True)
class Bundle:
    """A bundle's manifest: its release, the .deb files (dependencies first) and the graph they were resolved
    from, so that a PC's missing set is resolved on the head without its index."""

    codename: str
    arch: str
    debs: tuple[dict[str, Any], ...]  # {package, version, file, sha256, size}
    depends: Depends

    @property
    def name(self) -> str:
        return release_name(self.codename, self.arch)

    @property
    def bytes(self) -> int:
        return sum(int(d["size"]) for d in self.debs)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": FORMAT_VERSION, "codename": self.codename, "arch": self.arch,
                "roles": {r: list(p) for r, p in ROLES.items()}, "debs": list(self.debs),
                "depends": self.depends.to_dict()}

    def summary(self) -> dict[str, Any]:
        return {"release": self.name, "codename": self.codename, "arch": self.arch, "debs": len(self.debs),
                "bytes": self.bytes, "dir": str(bundle_dir(self.codename, self.arch))}


def parse_manifest(data: bytes, where: str) -> Bundle:
    """A bundle's manifest.json -> Bundle; UsageError naming `where` and the field when it is not one."""
    fix = "build the bundle again (clusterctl debs build) or export it again from the machine that built it"
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise UsageError(f"{where}: not a clusterctl Debian-package bundle (format {FORMAT})", fix)
        if doc.get("version") != FORMAT_VERSION:
            raise UsageError(f"{where}: bundle format {doc.get('version')}, this clusterctl reads {FORMAT_VERSION}",
                             fix)
        release_name(doc["codename"], doc["arch"])
        debs, graph = doc["debs"], doc["depends"]
        for i, d in enumerate(debs):
            bad = next((k for k, ok in (("package", PACKAGE_RE.fullmatch(str(d.get("package"))) is not None),
                                        ("version", isinstance(d.get("version"), str)),
                                        ("file", DEB_RE.fullmatch(str(d.get("file"))) is not None),
                                        ("sha256/size", file_meta_ok(d))) if not ok), None)
            if bad:
                raise UsageError(f"{where}: debs[{i}]: no valid {bad}", fix)
        if len({d["file"] for d in debs}) != len(debs):
            raise UsageError(f"{where}: debs: a file is listed twice", fix)
        depends = Depends({str(k): [[str(a) for a in g] for g in v] for k, v in graph["groups"].items()},
                          {str(k): [str(p) for p in v] for k, v in graph["providers"].items()})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{where}: not a bundle manifest ({type(e).__name__}: {e})", fix) from None
    keys = ("package", "version", "file", "sha256", "size")
    return Bundle(doc["codename"], doc["arch"], tuple({k: d[k] for k in keys} for d in debs), depends)


def load(codename: str, arch: str) -> Bundle | None:
    """The head's bundle for that release, if it is complete (every file there at its size), else None."""
    d = bundle_dir(codename, arch)
    try:
        b = parse_manifest((d / MANIFEST).read_bytes(), str(d / MANIFEST))
        if all((d / x["file"]).stat().st_size == x["size"] and not (d / x["file"]).is_symlink() for x in b.debs):
            return b
    except (OSError, UsageError):
        pass
    return None


def bundles() -> list[Bundle]:
    """Every complete bundle on the head (`debs list`)."""
    try:
        names = sorted(p.name for p in debs_root().iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    found = [load(*n.split("-", 1)) for n in names if "-" in n]
    return [b for b in found if b is not None]


def this_release() -> tuple[str | None, str | None]:
    """This machine's codename and dpkg architecture, read as the os fact reads a PC's."""
    try:
        r = subprocess.run(["sh", "-c", OS_CMD], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    os_ = parse_os(r.stdout, r.returncode)
    return os_["codename"], os_["arch"]


def _run(argv: list[str], cwd: Path | None = None) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=1800,
                           env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"{argv[0]} failed: {e}", "run it on a Debian machine with apt") from None
    if r.returncode != 0:
        tail = " ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise ClusterError(f"`{shlex.join(argv[:4])}{' ...' if len(argv) > 4 else ''}` exited {r.returncode}: "
                           f"{tail}", "apt-get update, and check that the Debian mirror is reachable")
    return r.stdout


def build(codename: str | None = None, arch: str | None = None, log: Log = lambda s: None,
          progress: Progress | None = None) -> Bundle:
    """Download every package both roles need on a bare PC of this machine's release into the head's bundle
    (apt-get download of each resolved version, its sha256 checked against the index), then the manifest.
    Only on a machine of that release and architecture: apt resolves for its own."""
    have_codename, have_arch = this_release()
    codename, arch = codename or have_codename, arch or have_arch
    if not codename or not arch:
        raise ClusterError("this machine has no VERSION_CODENAME in /etc/os-release or no dpkg",
                           "build the bundle on a Debian machine of the PCs' release")
    name = release_name(codename, arch)
    if (codename, arch) != (have_codename, have_arch):
        raise ClusterError(f"this machine is {have_codename}-{have_arch}, the bundle asked for is {name}: apt "
                           "resolves and downloads for its own release",
                           f"build it on a connected machine of {name} (clusterctl debs build), then "
                           "`clusterctl debs export FILE` there and `clusterctl debs import FILE` on the head")
    roots = list(dict.fromkeys(p for pkgs in ROLES.values() for p in pkgs))
    depends = parse_depends(_run(["apt-cache", "depends", *DEPENDS_FLAGS, *roots]))
    names = resolve(depends, roots)
    cands = parse_show(_run(["apt-cache", "show", "--no-all-versions", *names]))
    absent = [n for n in names if n not in cands]
    if absent:
        raise ClusterError(f"the package index has no candidate for {', '.join(absent)}", "apt-get update")
    root = debs_root()
    root.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        debs = []
        log(f"downloading {len(names)} packages for {name}")
        for i, n in enumerate(names):
            c = cands[n]
            _run(["apt-get", "download", "-q", f"{n}={c.version}"], cwd=stage)
            p = stage / c.file
            digest = sha256_file(p) if p.is_file() else None
            if digest != c.sha256:
                raise ClusterError(f"{c.file}: " + ("not downloaded" if digest is None else
                                                    "its sha256 is not the index's"), "apt-get update, then build again")
            debs.append({"package": n, "version": c.version, "file": c.file, "sha256": digest,
                         "size": p.stat().st_size})
            if progress:
                progress(i + 1, len(names))
        bundle = Bundle(codename, arch, tuple(debs), depends)
        write_atomic(stage / MANIFEST, json.dumps({**bundle.to_dict(), "created": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
        put_in_place(stage, bundle_dir(codename, arch))
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return bundle


def put_in_place(stage: Path, target: Path) -> None:
    """A staged bundle becomes the release's folder in renames, the old one removed only once replaced."""
    old = stage.with_name(stage.name + "-old")
    if target.exists():
        os.replace(target, old)
    try:
        os.replace(stage, target)
    except OSError:
        if old.exists():
            os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- installing on a PC


@dataclass(frozen=True)
class Install:
    """What installing a role's packages on one PC takes: `script` (run with become; "" when nothing is
    missing), and for the bundle path the files to copy first (head path -> PC path, in `folder`)."""

    role: str
    missing: tuple[str, ...]
    script: str
    copies: tuple[tuple[Path, str], ...] = ()
    folder: str | None = None

    @property
    def message(self) -> str:
        return f"to install: {' '.join(self.missing)}" if self.missing else \
            f"already installed: {' '.join(ROLES[self.role])}"


def install(role: str, installed: Mapping[str, str] | Iterable[str], has_index: bool, bundle: Bundle | None = None,
            folder: str = DEFAULT_FOLDER) -> Install:
    """A role's packages on a PC that has `installed` (parse_installed of DPKG_QUERY there). With an index:
    apt-get install of the role's missing top packages (apt brings the rest). Without: the bundle's files of
    every missing package, copied into `folder`, and one dpkg -i of them; the folder removed after."""
    if role not in ROLES:
        raise UsageError(f"no role {role!r}", f"one of: {', '.join(ROLES)}")
    have = set(installed)
    if has_index:
        missing = tuple(p for p in ROLES[role] if p not in have)
        cmd = f"DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {_quoted(missing)}"
        return Install(role, missing, _guarded(cmd) if missing else "")
    if bundle is None:
        raise ClusterError("the PC has no package index and the head has no bundle of Debian packages",
                           "clusterctl debs build on a connected machine of the PCs' release, export, import")
    missing = tuple(resolve(bundle.depends, ROLES[role], have))
    if not missing:
        return Install(role, (), "")
    files = {d["package"]: d["file"] for d in bundle.debs}
    lacking = [p for p in missing if p not in files]
    if lacking:
        raise ClusterError(f"the bundle {bundle.name} has no .deb of {', '.join(lacking)}",
                           "build the bundle again (clusterctl debs build) with this clusterctl")
    here = bundle_dir(bundle.codename, bundle.arch)
    copies = tuple((here / files[p], f"{folder}/{files[p]}") for p in missing)
    cmd = f"DEBIAN_FRONTEND=noninteractive dpkg -i {_quoted(pc for _, pc in copies)}"
    return Install(role, missing, _guarded(cmd, folder), copies, folder)


def _quoted(words: Iterable[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def _guarded(cmd: str, folder: str | None = None) -> str:
    """`cmd` with a policy-rc.d that forbids starting daemons (exit 101) while it runs, removed by a trap on
    any exit (a failure, a signal), a PC's own policy-rc.d put back, and the bundle's `folder` removed."""
    return "\n".join([
        "set -e",
        f"p={shlex.quote(POLICY)}; keep={shlex.quote(POLICY + '.clusterctl-saved')}"
        + (f"; d={shlex.quote(folder)}" if folder else ""),
        f"if [ -e \"$p\" ] && ! grep -qF {shlex.quote(POLICY_MARK)} \"$p\"; then mv -f \"$p\" \"$keep\"; fi",
        "trap 'rm -f \"$p\"; if [ -e \"$keep\" ]; then mv -f \"$keep\" \"$p\"; fi"
        + ('; rm -rf -- "$d"' if folder else "") + "' EXIT",
        "trap 'exit 130' INT TERM HUP",
        f"printf '#!/bin/sh\\n%s\\nexit 101\\n' {shlex.quote(POLICY_MARK)} > \"$p\"",
        "chmod 755 \"$p\"",
        cmd,
    ]) + "\n"
