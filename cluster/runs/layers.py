"""A job's own requirements: resolved on the head, installed offline on every node as a layer over the
provisioned environment, which they never change.

The lab has no internet, so the head downloads the wheels (its wheelhouse, provision/wheelhouse.py: cached,
so a head without internet uses what it downloaded before) for the nodes' Python version. The layer holds
only what the provisioned environment lacks: a requirement (or a dependency of one) that the environment
has at another version is refused, naming both versions (the base is what provision verified: torch, numpy
and the rest stay as they are). On a node, the layer is `<workdir>/clusterctl/layers/<lock digest>/site`,
installed by pip from the node's copy of the wheels with no index, and put first on the program's
PYTHONPATH; a second launch with the same lock finds it there and installs nothing.
"""
from __future__ import annotations

import hashlib
import json
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
from cluster.runs.jobs import JobSpec
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
    """The layer for these requirements on Python `python` over `base`; None when the base has them all."""
    reqs = requirements(spec)
    if not reqs:
        return None
    try:  # first with the environment's versions as constraints: dependencies it has are taken from it
        wh = wheelhouse.build(reqs, python, log=log, constraints=tuple(f"{n}=={v}" for n, v in sorted(base.items())))
    except ClusterError:
        try:  # they cannot all hold: resolved alone, the clash below names the versions
            wh = wheelhouse.build(reqs, python, log=log)
        except ClusterError as e:
            raise JobError(str(spec.path), None, "requirements", f"cannot resolve {', '.join(reqs)} for Python "
                           f"{python} on the head: {e.message}", "check the names and versions, or put their "
                           "wheels in the head's wheelhouse (clusterctl reads no index from the nodes)") from None
    pins = {f: wheelhouse.wheel_pin(f) for f in wh.files}
    clash = sorted(f"{n}=={v} would replace {n}=={base[n]}" for n, v in pins.values() if n in base and base[n] != v)
    if clash:
        raise JobError(str(spec.path), None, "requirements", "; ".join(clash) + " of the provisioned environment",
                       "pin the versions the environment has (clusterctl never changes the environment provision "
                       "verified), or change the environment with `clusterctl provision`")
    files = {f: m for f, m in wh.files.items() if pins[f][0] not in base}
    if not files:
        return None
    lock = "".join(f"{n}=={v}\n" for n, v in sorted(pins[f] for f in files))
    return Layer(Wheelhouse(wh.dir, wh.requirements, files), lock, hashlib.sha256(lock.encode()).hexdigest()[:16])


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
