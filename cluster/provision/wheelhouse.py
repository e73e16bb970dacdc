"""The head's wheelhouse: every wheel a node needs, downloaded once, distributed over the lab network.

Lab networks often have no internet: the head downloads (or finds on disk) the
wheels for each requirement set once, pins them in a lock, and puts them on every
node incrementally (only missing files travel) with sha256 verification: by default
the head sends each file once and the nodes relay it to each other (cluster/relay/distribute.py),
so a room of PCs takes about as long as one; `vars.distribute: push` sends to each node.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import unquote, urlsplit

from cluster import paths
from cluster.relay import distribute as relay
from cluster.relay.progress import StatusFn
from cluster.errors import ClusterError, UsageError
from cluster.transport import Transport

if TYPE_CHECKING:
    from cluster.nodes.fanout import Group
    from cluster.inventory.model import Host
    from cluster.provision.model import Playbook

MANIFEST = ".clusterctl-manifest.json"  # on the node: files verified there, with their sha256
PIP_DOWNLOAD_TIMEOUT_S = 6 * 3600.0  # CUDA wheels are GBs: hours on a slow lab uplink, never forever


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_pin(filename: str) -> tuple[str, str]:
    """'torch-2.14.1+cu126-cp311-...whl' -> ('torch', '2.14.1+cu126')."""
    name, version = filename.split("-")[:2]
    return normalize(name), version


@dataclass(frozen=True)
class Wheelhouse:
    dir: Path
    requirements: tuple[str, ...]
    files: dict[str, dict[str, int | str]]  # filename -> {sha256, size}

    @property
    def lock_text(self) -> str:
        pins = sorted(wheel_pin(f) for f in self.files)
        return "".join(f"{n}=={v}\n" for n, v in pins)

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


@dataclass(frozen=True)
class Delivered(Wheelhouse):
    """A wheelhouse this run already put on one node (relay or head push): its `wheels` step reports that."""

    detail: str = ""
    received: int = 0  # files the node received this run


LAYOUT = 2  # 2: tf-keras without the `tensorflow` it names where tensorflow-cpu provides it (_alone)


def key(requirements: list[str], python: str, index_url: str | None, constraints: tuple[str, ...] = (),
        layer: bool = False) -> str:
    doc: dict[str, Any] = {"r": sorted(requirements), "py": python, "index": index_url, "layout": LAYOUT}
    if constraints:
        doc["c"] = sorted(constraints)
    if layer:  # a job's layer lists only what the environment lacks: never the same set as a full download
        doc["layer"] = 1
    blob = json.dumps(doc, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def requirement_name(requirement: str) -> str:
    """'torch<4.0,>=2.1.0; extra == "x"' -> 'torch'."""
    return normalize(re.split(r"[<>=!~;\[ (@]", requirement.strip(), maxsplit=1)[0])


def _alone(requirements: list[str]) -> list[str]:
    """Requirements to download without their dependencies: tf-keras names `tensorflow`, which
    tensorflow-cpu provides under another name (the same modules, without the CUDA build's ~570 MB
    wheel and ~2 GB unpacked). With both, a CPU node would install two TensorFlows over each other."""
    names = {requirement_name(r) for r in requirements}
    return [r for r in requirements if requirement_name(r) == "tf-keras"] if "tensorflow-cpu" in names else []


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_dir() -> Path:
    """CLUSTERCTL_WHEELHOUSE, default $CLUSTERCTL_HOME/wheelhouse: shared by every lab of this head."""
    env = os.environ.get("CLUSTERCTL_WHEELHOUSE")
    return Path(env) if env else paths.home() / "wheelhouse"


def _dir(requirements: list[str], python: str, index_url: str | None, constraints: tuple[str, ...] = (),
         layer: bool = False) -> Path:
    return cache_dir() / key(requirements, python, index_url, constraints, layer)


def cached(requirements: list[str], python: str, index_url: str | None = None,
           constraints: tuple[str, ...] = (), layer: bool = False) -> Wheelhouse | None:
    """The wheelhouse built earlier for this set, if all its files are still there at their size."""
    d = _dir(requirements, python, index_url, constraints, layer)
    try:
        data = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    for f, m in data["files"].items():
        p = d / "files" / f
        if not p.exists() or p.stat().st_size != m["size"]:
            return None
    return Wheelhouse(d / "files", tuple(data["requirements"]), data["files"])


def _download(files: Path, requirements: list[str], python: str, index_url: str | None, *extra: str) -> None:
    """pip download into `files`, bounded in time."""
    _pip(["download", "--dest", str(files)], files, requirements, python, index_url, *extra)


def _pip(verb: list[str], files: Path, requirements: list[str], python: str, index_url: str | None,
         *extra: str) -> None:
    """pip `verb` (download, or a dry-run install) of wheels only for Python `python`, bounded in time; a failure
    says whether the index was out of reach and how to fill `files` without it."""
    what = f"pip {verb[0]}" + (" --dry-run" if "--dry-run" in verb else "")
    cmd = [sys.executable, "-m", "pip", *verb, "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", python, *extra, *requirements]
    if index_url:
        cmd[3 + len(verb):3 + len(verb)] = ["--extra-index-url", index_url]
    try:  # pip's own socket timeout (15 s, 5 retries) bounds each stall; this bounds the whole download
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{what} of {' '.join(requirements)} still running after "
                           f"{PIP_DOWNLOAD_TIMEOUT_S / 3600:g} h (stopped)",
                           "check the head's link to the package index, bring the wheels on a disk (`clusterctl "
                           "wheelhouse export DIR` on a connected machine, `clusterctl wheelhouse import DIR` here), "
                           f"or fill the wheelhouse by hand: pip download -d {files} ...") from None
    if proc.returncode != 0:
        offline = unreachable_index(proc.stderr)
        none_seen = not offline and "(from versions: none)" in proc.stderr  # pip without retries says no more
        why = (" (this head cannot reach the package index)" if offline else
               " (the package index gave no version: it is out of this head's reach, or a name is wrong)"
               if none_seen else "")
        fix = (offline_fix(python) if offline else
               offline_fix(python) + "; with internet here, check the requirements' names" if none_seen else
               "check the requirements and the head's access to the package index; a head without internet: "
               + offline_fix(python, lead="on"))
        raise ClusterError(f"{what} failed for {' '.join(requirements)}{why}:\n{proc.stderr.strip()[-1500:]}",
                           f"{fix}; or fill the wheelhouse by hand: pip download -d {files} ...")


# pip's words when it could not reach an index at all (urllib3's connection errors, DNS, no route, TLS)
_UNREACHABLE = ("Failed to establish a new connection", "NewConnectionError", "Temporary failure in name resolution",
                "Name or service not known", "Network is unreachable", "No route to host", "Connection refused",
                "ConnectTimeoutError", "Read timed out", "SSLError", "ProxyError")


def offline_fix(python: str, lead: str = "On") -> str:
    """How a head without internet gets its wheelhouse: built and exported elsewhere, imported here."""
    return (f"{lead} a machine with internet run `clusterctl wheelhouse build INVENTORY` (or `--for py{python},cpu`, "
            "a GPU's variant in place of cpu) and `clusterctl wheelhouse export DIR`, then here `clusterctl wheelhouse "
            "import DIR` and run this again: provision uses the imported wheels without network "
            "(docs/playbooks.md#a-head-without-internet)")


def unreachable_index(stderr: str) -> bool:
    """Whether pip's output says it could not reach the index, rather than that a requirement has no wheel."""
    return any(s in stderr for s in _UNREACHABLE)


def build(requirements: list[str], python: str, index_url: str | None = None,
          log: Callable[[str], None] = lambda s: None, constraints: tuple[str, ...] = ()) -> Wheelhouse:
    """Download (once) every wheel for `requirements` on Python `python` ("3.11") into the head's cache.
    `constraints` (`name==version` lines, pip's `-c`): the versions a dependency must have if it is needed
    (a job's layer: the provisioned environment's, so that its dependencies are the ones already there)."""
    wh = cached(requirements, python, index_url, constraints)
    if wh is not None:
        return wh
    d = _dir(requirements, python, index_url, constraints)
    manifest = d / "manifest.json"
    (d / "files").mkdir(parents=True, exist_ok=True)
    log(f"downloading wheels for {len(requirements)} requirements (Python {python}) into {d}")
    alone = _alone(requirements)
    extra: list[str] = []
    if constraints:
        (d / "constraints.txt").write_text("".join(f"{c}\n" for c in sorted(constraints)))
        extra = ["-c", str(d / "constraints.txt")]
    _download(d / "files", [r for r in requirements if r not in alone], python, index_url, *extra)
    if alone:
        _download(d / "files", alone, python, index_url, "--no-deps")
    wanted = {wheel_pin(f.name)[0] for f in (d / "files").glob("*.whl")}
    files: dict[str, dict[str, int | str]] = {}
    for f in sorted((d / "files").glob("*.whl")):
        files[f.name] = {"sha256": sha256_file(f), "size": f.stat().st_size}
    if not wanted:
        raise ClusterError(f"pip download left no wheels in {d}", "check the requirements")
    manifest.write_text(json.dumps({"requirements": requirements, "python": python, "index": index_url,
                                    "files": files}, indent=1))
    return Wheelhouse(d / "files", tuple(requirements), files)


LAYER_STORE = "layer-wheels"  # each wheel of every job's layer once; each set's files/ holds hard links to it


def resolution(requirements: list[str], python: str, constraints: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """What pip would install for `requirements` on Python `python` within `constraints`: the `install` entries
    of its JSON report (name, version, requires_dist, the wheel's URL and sha256). pip reads each wheel's
    metadata alone (PEP 658, or the file on a local index), so a constrained torch costs no download."""
    with tempfile.TemporaryDirectory(prefix="clusterctl-resolve-") as tmp:
        report, extra = Path(tmp) / "report.json", []
        if constraints:
            (Path(tmp) / "constraints.txt").write_text("".join(f"{c}\n" for c in sorted(constraints)))
            extra = ["-c", str(Path(tmp) / "constraints.txt")]
        _pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)],
             cache_dir() / LAYER_STORE, requirements, python, None, *extra)
        return list(json.loads(report.read_text())["install"])


def build_layer(requirements: list[str], python: str, constraints: tuple[str, ...], picked: list[dict[str, Any]],
                log: Callable[[str], None] = lambda s: None) -> Wheelhouse:
    """The wheels of `picked` (entries of `resolution`) by exact pin, without dependencies: each downloaded once
    into the store every set shares, checked against the index's sha256, and linked into this set's files/, whose
    manifest (as `build` writes it, so that export and import carry it) lets the next launch skip the index."""
    d, store = _dir(requirements, python, None, constraints, layer=True), cache_dir() / LAYER_STORE
    names = {unquote(urlsplit(e["download_info"]["url"]).path.rsplit("/", 1)[-1]): e for e in picked}
    todo = [f"{e['metadata']['name']}=={e['metadata']['version']}" for f, e in names.items()
            if not (store / f).is_file()]
    store.mkdir(parents=True, exist_ok=True)
    (d / "files").mkdir(parents=True, exist_ok=True)
    if todo:
        log(f"downloading {len(todo)} wheels the provisioned environment lacks (Python {python}) into {store}")
        _download(store, todo, python, None, "--no-deps")
    files: dict[str, dict[str, int | str]] = {}
    for f, e in sorted(names.items()):
        if not (store / f).is_file():
            raise ClusterError(f"pip download left no {f} in {store}", f"fill it by hand: pip download -d {store} "
                               f"--no-deps --only-binary=:all: --python-version {python} {e['metadata']['name']}")
        digest, want = sha256_file(store / f), e["download_info"].get("archive_info", {}).get("hashes", {})
        if want.get("sha256", digest) != digest:
            (store / f).unlink()
            raise ClusterError(f"{store / f} does not match the index's sha256 (removed)", "launch again")
        (d / "files" / f).unlink(missing_ok=True)
        try:
            os.link(store / f, d / "files" / f)
        except OSError:  # a filesystem without hard links: a copy
            shutil.copyfile(store / f, d / "files" / f)
        files[f] = {"sha256": digest, "size": (store / f).stat().st_size}
    if constraints:
        (d / "constraints.txt").write_text("".join(f"{c}\n" for c in sorted(constraints)))
    (d / "manifest.json").write_text(json.dumps({"requirements": requirements, "python": python, "index": None,
                                                 "files": files}, indent=1))
    return Wheelhouse(d / "files", tuple(requirements), files)


def remote_state(t: Transport, dest: str) -> tuple[dict[str, int], dict[str, str]]:
    """Sizes of the wheels on the node and the sha256 of those verified there earlier."""
    q = shlex.quote(dest)
    r = t.run(f"cd -- {q} 2>/dev/null && {{ for f in *.whl; do [ -f \"$f\" ] && stat -c '%s %n' -- \"$f\"; done; "
              f"echo @@manifest; cat {MANIFEST} 2>/dev/null; }}; true", timeout=120)
    return relay.parse_survey(r.stdout)


def missing(wh: Wheelhouse, sizes: dict[str, int], verified: dict[str, str]) -> list[str]:
    return [f for f, m in wh.files.items() if sizes.get(f) != m["size"] or verified.get(f) != m["sha256"]]


def push(t: Transport, wh: Wheelhouse, dest: str, dry: bool = False,
         progress: Callable[[int], None] | None = None) -> tuple[bool, str]:
    """Copy the wheels the node lacks, verify their sha256 there, record them. (changed?, detail)."""
    sizes, verified = remote_state(t, dest)
    todo = missing(wh, sizes, verified)
    if not todo and isinstance(wh, Delivered) and wh.received:
        return True, wh.detail
    if not todo:
        return False, f"{len(wh.files)} wheels present and verified"
    nbytes = sum(int(wh.files[f]["size"]) for f in todo)
    if dry:
        return True, f"would send up to {len(todo)} of {len(wh.files)} wheels, {nbytes / 2**20:.0f} MiB"
    q = shlex.quote(dest)
    t.run(f"mkdir -p -- {q}", timeout=60)
    # A file of the right size that was never verified (an interrupted run) may be whole: hash it first.
    maybe = [f for f in todo if sizes.get(f) == wh.files[f]["size"]]
    good = {f for f, h in _remote_hashes(t, dest, maybe).items() if h == wh.files[f]["sha256"]}
    send = [f for f in todo if f not in good]
    sent = 0
    for f in send:
        part = f"{dest}/.{f}.part"
        sent += t.send_file(wh.dir / f, part)  # a copy cut short earlier (a stall, a lost link) gets only its tail
        t.run(f"mv -f -- {shlex.quote(part)} {shlex.quote(dest + '/' + f)}", timeout=60)
        if progress:
            progress(int(wh.files[f]["size"]))
    got = _remote_hashes(t, dest, send)
    bad = [f for f in send if got.get(f) != wh.files[f]["sha256"]]
    if bad:
        t.run(f"cd -- {q} && rm -f -- {' '.join(shlex.quote(f) for f in bad)}", timeout=60)
        raise ClusterError(f"sha256 mismatch on the node for {', '.join(bad)} (removed there)",
                           "re-run provision; if it repeats, check the node's disk and memory")
    verified.update({f: str(wh.files[f]["sha256"]) for f in todo})
    t.put_bytes(json.dumps(verified, indent=0).encode(), f"{dest}/{MANIFEST}")
    return True, f"sent {len(send)} wheels ({sent / 2**20:.0f} MiB), verified {len(todo)}"


def _remote_hashes(t: Transport, dest: str, names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    r = t.run(f"cd -- {shlex.quote(dest)} && sha256sum -- {' '.join(shlex.quote(f) for f in names)}", timeout=1800)
    return {line.split()[1].lstrip("*"): line.split()[0] for line in r.stdout.splitlines() if line.strip()}


def installed(freeze: str) -> dict[str, str]:
    """`pip freeze --all` output -> {normalized name: version}."""
    out = {}
    for line in freeze.splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            out[normalize(name)] = version
    return out


def unsatisfied(lock_text: str, freeze: str) -> list[str]:
    have = installed(freeze)
    need = installed(lock_text)
    return [f"{n}=={v}" for n, v in need.items() if have.get(n) != v]


# --------------------------------------------------------------------------- distribution to many nodes at once


def wheel_destinations(pb: Playbook, hosts: list[Host], contexts: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each node's wheel directory, as its playbook's `wheels` step would render it (nodes whose step is
    skipped, e.g. `python_env: existing`, get none)."""
    from cluster.provision.render import Renderer

    step = next((s for s in pb.steps if s.action == "wheels"), None)
    out: dict[str, str] = {}
    if step is None:
        return out
    for h in hosts:
        r = Renderer(pb, contexts[h.name])
        if r.condition(step):
            spec = r.text(step, step.spec, "wheels")
            if not isinstance(spec, dict) or "dest" not in spec:
                raise r.error(step, "wheels: needs `dest:`")
            out[h.name] = str(spec["dest"])
    return out


def distribution_mode(h: Host) -> str:
    mode = h.vars.get("distribute", "relay")
    if mode not in relay.MODES:
        raise UsageError(f"{h.name}: inventory var distribute: {mode!r} is not one of {', '.join(relay.MODES)}",
                         "set `distribute: relay` (the nodes pass wheels on to each other) or `push` "
                         "(the head sends to every node) under vars:")
    return str(mode)


def distribute(group: Group, pb: Playbook, hosts: list[Host], contexts: dict[str, dict[str, Any]],
               whs: dict[str, Wheelhouse], dry: bool, progress: Callable[[str, int], None] | None,
               log: Callable[[str], None], fail: Callable[[str, str, str, str | None], None],
               status: StatusFn | None = None) -> dict[str, Any]:
    """Put each node's wheelhouse on it before the playbooks run, all nodes together (relay by default).
    `status` gets each node's whole distribution state (`relay.NodeProgress`) at each change.
    `whs` entries become Delivered, so each node's `wheels` step reports what it received; a node whose
    delivery failed is handed to `fail(node, status, error, fix)`. Returns the routes for the report."""
    dests = wheel_destinations(pb, hosts, contexts)
    groups: dict[Path, list[Host]] = {}
    for h in hosts:
        if h.name in dests and h.name in whs:
            groups.setdefault(whs[h.name].dir, []).append(h)
    report: dict[str, Any] = {"routes": [], "lines": []}
    unbuilt = [h for h in hosts if h.name in dests and h.name not in whs]
    if dry and unbuilt:  # a dry run does not download: the order is known, the sizes are not
        mode = distribution_mode(unbuilt[0])
        names = [h.name for h in unbuilt]
        report["lines"].append("the head downloads the wheelhouse first, then "
                               + (" -> ".join(["head", *names]) if mode == "relay"
                                  else f"head -> each of {', '.join(names)}") + f" ({mode})")
    for members in groups.values():
        wh = whs[members[0].name]
        mode = distribution_mode(members[0])
        items = relay.items(wh.dir, wh.files, with_pieces=not dry)
        routes, results = relay.distribute(group, members, items, {h.name: dests[h.name] for h in members},
                                         mode=mode, dry=dry, progress=progress, log=log, status=status)
        report["routes"].append(routes.to_dict())
        report["lines"] += routes.lines()
        for h in members:
            r = results[h.name]
            if not r.ok:
                fail(h.name, "unreachable" if r.status == "unreachable" else "failed",
                     f"wheels: {r.error or r.status}",
                     r.fix or "re-run provision: files already verified on the node are not sent again")
            elif not dry and isinstance(r.value, relay.Delivery):
                whs[h.name] = Delivered(wh.dir, wh.requirements, wh.files, r.value.detail(), r.value.files)
    return report
