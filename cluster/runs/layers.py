"""A job's own requirements: resolved on the head, installed offline on every node as a layer over the
provisioned environment, which they never change.

The lab has no internet, so the head downloads the wheels (its wheelhouse, provision/wheelhouse.py: cached,
so a head without internet uses what it downloaded before) for the nodes' Python version. pip resolves the
requirements from the index's metadata with the environment's versions as constraints, and only the wheels
the environment lacks are downloaded (each once, whatever set names it). The layer holds only those: a
requirement (or a dependency of one) that the environment has at another version is refused, naming both
versions (the base is what provision verified: torch, numpy and the rest stay as they are). On a node, the
layer is `<workdir>/clusterctl/layers/<lock digest>/site`, installed by pip from the node's copy of the wheels
with no index, and put first on the program's PYTHONPATH; a second launch with the same lock finds it there
and installs nothing.
"""
from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cluster.bounds import FileRefused, read_regular
from cluster.errors import ClusterError
from cluster.inventory.model import Host
from cluster.nodes.fanout import Group, GroupResult
from cluster.relay import distribute
from cluster.provision import wheelhouse
from cluster.provision.wheelhouse import Wheelhouse
from cluster.runs.jobs import COMMAND_LINE, JobSpec
from cluster.runs.schema import JobError
from cluster.transport import Transport

INSTALL_TIMEOUT_S = 600.0
PROBE = ('"$CLUSTER_PYTHON" -c \'import json, sys; from importlib import metadata; print(json.dumps({"python": '
         '"%d.%d" % sys.version_info[:2], "packages": {d.metadata["Name"]: d.version for d in metadata.distributions()'
         ' if d.metadata["Name"]}}))\'')


@dataclass(frozen=True)
class Layer:
    """The wheels a job adds to the provisioned environment, and where each node keeps them."""

    wheels: Wheelhouse  # only the lock's files
    lock: str  # `name==version` lines, what the layer installs
    digest: str

    def dir(self, host: Host) -> str:
        return f"{host.workdir}/clusterctl/layers/{self.digest}"


def requirements(spec: JobSpec) -> list[str]:
    """The job's `requirements`: a list, or a requirements file inside its `code` (one per line, # comments)."""
    req = spec["requirements"]
    if req is None:
        return []
    if isinstance(req, list):
        return [str(r) for r in req]
    path = Path(str(spec["code"])) / str(req)
    fix = "requirements: a requirements file inside `code` (a regular text file), or a list"
    try:
        text = read_regular(path, fix, noun="a requirements file").decode()
    except FileRefused as e:
        raise JobError(str(spec.path), None, "requirements", f"cannot read {path}: it {e.problem}", fix) from None
    except OSError as e:
        raise JobError(str(spec.path), None, "requirements", f"cannot read {path}: {e.strerror}", fix) from None
    except UnicodeDecodeError as e:
        raise JobError(str(spec.path), None, "requirements", f"{path} is not UTF-8 text ({e.reason} at byte "
                       f"{e.start})", "save the requirements file as UTF-8") from None
    lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    return [ln for ln in lines if ln]


def base_environment(group: Group, host: Host) -> tuple[str, dict[str, str]]:
    """The provisioned environment on one node (they are identical: launch's preflight checks that):
    its Python version and every installed distribution's version, by normalised name."""
    r = group.run(lambda h: f". {shlex.quote(h.workdir)}/cluster.env && {PROBE}", timeout=60, hosts=[host])[host.name]
    try:
        doc = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ClusterError(f"{host.name}: cannot list the provisioned environment's packages: "
                           f"{r.error or r.stderr.strip()[-300:] or r.stdout[-300:]}",
                           "check the node with `clusterctl provision --verify`") from None
    return str(doc["python"]), {wheelhouse.normalize(k): str(v) for k, v in doc["packages"].items()}


def resolve(spec: JobSpec, python: str, base: dict[str, str],
            log: Callable[[str], None] = lambda s: None) -> Layer | None:
    """The layer for these requirements on Python `python` over `base`; None when the base has them all.
    Resolved from the index's metadata with the environment's versions as constraints, then only what the layer
    needs downloaded (pip download of the whole resolution would fetch the constrained torch and CUDA too: GBs
    in the head's wheelhouse for a MB layer)."""
    reqs = requirements(spec)
    if not reqs:
        return None
    if spec.path.name == COMMAND_LINE and spec["requirements"] == "requirements.txt":
        log("using requirements.txt from the program folder; `--requirements none` skips it")
    constraints = tuple(f"{n}=={public(v)}" for n, v in sorted(base.items()))  # 2.14.1 admits 2.14.1+cu130
    wh = wheelhouse.cached(reqs, python, None, constraints, layer=True)
    if wh is None:
        wh = wheelhouse.build_layer(reqs, python, constraints, pick(spec, reqs, python, base, constraints), log)
    if not wh.files:
        return None
    lock = "".join(f"{n}=={v}\n" for n, v in sorted(wheelhouse.wheel_pin(f) for f in wh.files))
    return Layer(wh, lock, hashlib.sha256(lock.encode()).hexdigest()[:16])



def public(version: str) -> str:
    """'2.14.1+cu130' -> '2.14.1': the release a local build label (`+cpu`, `+cu130`) belongs to."""
    return version.split("+", 1)[0]


def pick(spec: JobSpec, reqs: list[str], python: str, base: dict[str, str],
         constraints: tuple[str, ...]) -> list[dict[str, Any]]:
    """The entries of pip's resolution that the layer installs (`needed`); a package the environment has at
    another version is refused, naming both."""
    try:  # first with the environment's versions as constraints: dependencies it has are taken from it
        report = wheelhouse.resolution(reqs, python, constraints)
    except ClusterError:
        try:  # they cannot all hold: resolved alone, the clash below names the versions
            report = wheelhouse.resolution(reqs, python)
        except ClusterError as e:
            other = ", or launch without them: `--requirements none`" if spec.path.name == COMMAND_LINE else ""
            raise JobError(str(spec.path), None, "requirements", f"cannot resolve {', '.join(reqs)} for Python "
                           f"{python} on the head: {e.message}", "check the names and versions, or put their wheels "
                           "in the head's wheelhouse (clusterctl reads no index from the nodes)" + other) from None
    clash = clashes(report, base)
    if clash:
        raise JobError(str(spec.path), None, "requirements", "; ".join(clash) + " of the provisioned environment",
                       "pin the versions the environment has (clusterctl never changes the environment provision "
                       "verified), or change the environment with `clusterctl provision`")
    return needed(report, base)


def clashes(report: list[dict[str, Any]], base: dict[str, str]) -> list[str]:
    """Each package of pip's resolution that the environment has at another release: 'a==2 would replace a==1'."""
    return sorted(f"{n}=={v} would replace {n}=={base[n]}" for n, v in
                  ((wheelhouse.normalize(e["metadata"]["name"]), e["metadata"]["version"]) for e in report)
                  if n in base and public(base[n]) != public(v))


_EXTRA = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]""")  # a Requires-Dist marker's `extra == "http"`
_EXTRAS = re.compile(r"^[^\[;]*\[([^\]]*)\]")  # 'fsspec[http,s3]>=2022' -> 'http,s3'


def needed(report: list[dict[str, Any]], base: dict[str, str]) -> list[dict[str, Any]]:
    """The entries of pip's resolution (its report's `install`) that the layer installs: those the requirements
    reach without passing through a package of the environment, whose own dependencies are the environment's
    business (torch's CUDA wheels: pip lists them, the environment works without them) but for the extras asked
    of it (`fsspec[http]` needs aiohttp although fsspec is there)."""
    got = {wheelhouse.normalize(e["metadata"]["name"]): e for e in report}
    keep: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(n, frozenset(wheelhouse.normalize(x) for x in e.get("requested_extras") or ()))
            for n, e in got.items() if e.get("requested")]
    while todo:
        n, extras = todo.pop()
        if n not in got or (n, extras) in seen:
            continue
        seen.add((n, extras))
        if n not in base:
            keep.add(n)
        for r in got[n]["metadata"].get("requires_dist") or ():
            gated = {wheelhouse.normalize(x) for x in _EXTRA.findall(r.partition(";")[2])}
            if gated & extras or (not gated and n not in base):
                m = _EXTRAS.match(r)
                todo.append((wheelhouse.requirement_name(r), frozenset(
                    wheelhouse.normalize(x.strip()) for x in m.group(1).split(",") if x.strip()) if m else frozenset()))
    return [got[n] for n in sorted(keep)]


def install(group: Group, hosts: list[Host], layer: Layer, log: Callable[[str], None] = lambda s: None) -> GroupResult:
    """The layer on every node: skipped where it is already installed, else its wheels sent (sha256-verified;
    by the peer relay when the nodes lacking it need `distribute.RELAY_MIN_BYTES` or more in all, else over
    SFTP, each only the wheels it lacks) and installed offline. Each node's value: {"installed", "bytes"}."""
    from cluster.nodes.fanout import HostResult

    done = group.run(lambda h: f"test -f {shlex.quote(layer.dir(h))}/.done", timeout=30, hosts=hosts)
    lacking = [h for h in hosts if done[h.name].status == "failed" and done[h.name].exit_code == 1]
    out = GroupResult((h.name, done[h.name]) for h in hosts if not done[h.name].ok and h not in lacking)
    relayed: dict[str, int] = {}
    if distribute.worth_relaying(layer.wheels.total_bytes * len(lacking), len(lacking)):
        log(f"relaying {len(layer.wheels.files)} wheels ({layer.wheels.total_bytes / 2**20:.1f} MiB) to "
            f"{len(lacking)} nodes")
        _, res = distribute.distribute(group, lacking, distribute.items(layer.wheels.dir, layer.wheels.files),
                                       {h.name: f"{layer.dir(h)}/wheels" for h in lacking},
                                       mode=wheelhouse.distribution_mode(lacking[0]), log=log)
        for h in lacking:
            if res[h.name].ok:
                relayed[h.name] = res[h.name].value.received
            else:
                out[h.name] = res[h.name]

    def one(t: Transport) -> dict[str, Any]:
        d = layer.dir(t.host)
        q = shlex.quote(d)
        sent: list[int] = [relayed.get(t.host.name, 0)]
        if t.host.name not in relayed:
            t.run(f"mkdir -p -- {q}/wheels", timeout=30)
            wheelhouse.push(t, layer.wheels, f"{d}/wheels", progress=sent.append)
        pins = " ".join(shlex.quote(p) for p in layer.lock.split())
        r = t.run(f". {shlex.quote(t.host.workdir)}/cluster.env && rm -rf -- {q}/site && "
                  f'"$CLUSTER_PYTHON" -m pip install --disable-pip-version-check -q --no-index --no-deps '
                  f"--find-links {q}/wheels --target {q}/site {pins} && touch -- {q}/.done", timeout=INSTALL_TIMEOUT_S)
        if r.exit_code != 0:
            raise ClusterError(f"{t.host.name}: installing {layer.lock.split()} failed: {r.stderr.strip()[-500:]}")
        return {"installed": True, "bytes": sum(sent), "via": "relay" if t.host.name in relayed else "sftp"}

    installed = group.call(one, [h for h in lacking if h.name not in out])
    return GroupResult((h.name, out.get(h.name) or installed.get(h.name)
                        or HostResult(h.name, "ok", done[h.name].duration, value={"installed": False, "bytes": 0}))
                       for h in hosts)
