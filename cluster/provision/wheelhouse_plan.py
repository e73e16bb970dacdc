"""The wheelhouses a head without internet needs, filled on a machine with internet (`wheelhouse build`).

Exactly those provision would download: the same facts -> builds -> requirement sets (apply.wheelhouse_sets),
from the nodes, from the head's `clusterctl check --json`, or for nodes described by `--for py3.11,cpu,cu126`.
pip downloads for this machine's platform, so it must be of the head's kind (Linux, the nodes' architecture)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.bounds import read_regular
from cluster.errors import ClusterError, UsageError
from cluster.nodes.facts import NodeFacts
from cluster.provision import apply, compat, playbook, wheelhouse
from cluster.provision.report import NodeOutcome

if TYPE_CHECKING:
    from cluster.inventory.model import Host, Inventory

FACTS_FIX = "on the head: clusterctl check INVENTORY --json > facts.json"
FACTS_MAX_BYTES = 64 << 20  # `check --json` of a few hundred nodes is a few MiB
FACTS_REWRITE = "write the file with `clusterctl check INVENTORY --json`"

# `--for` GPU words: the build each names, as the node a card of that kind makes (compat decides the rest)
VARIANT_GPUS: dict[str, tuple[str, str, str]] = {
    "cu126": ("NVIDIA GeForce GTX 1080", "6.1", compat.RECOMMENDED_DRIVER),  # Pascal on R580: this lab's PCs
    "cu130": ("NVIDIA GeForce RTX 5080", "12.0", compat.RECOMMENDED_DRIVER),  # Blackwell: only cu130 runs it
    "cu118": ("NVIDIA GeForce GTX 1080", "6.1", "470.256.02"),  # an R470 driver: only cu118 (torch 2.7.1) runs
}
TARGET_HELP = ("a comma list: the nodes' Python (py3.11) and one word per kind of node: cpu; cu126 (a Pascal "
               "card such as a GTX 1080 on the R580 driver), cu130 (a Blackwell card), cu118 (a card on an R470 "
               "driver); or cc6.1 / cc8.6@550.54.14 (a card's compute capability, @ its driver; default R580)")


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
        targets += [Target(word, pythons[0][2:], _gpu(word, value)) for word in kinds]
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
    return Inventory(Path("--for"), "targets", hosts, {}, next(iter(hosts))), nf


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
            raise UsageError(f"{path}: {h.name}: facts.python is not as `check --json` writes it", FACTS_REWRITE)
        gpus = (values.get("gpus") or {}).get("gpus", []) if isinstance(values.get("gpus"), dict) else None
        if not isinstance(gpus, list) or not all(_gpu_fact_ok(g) for g in gpus):
            raise UsageError(f"{path}: {h.name}: facts.gpus is not as `check --json` writes it", FACTS_REWRITE)
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


def select(inv: Inventory, hosts: list[Host], facts: dict[str, NodeFacts] | None = None,
           outcomes: dict[str, NodeOutcome] | None = None, forks: int = 32, source: str | None = None,
           log: apply.Log = lambda s: None) -> Selection:
    """The wheelhouses provision would build for these nodes: from `facts` when given (a facts file,
    `--for` targets), else gathered from the nodes as provision gathers them (read-only)."""
    if facts is None:
        request = apply.prepare(inv, hosts, forks=forks, log=log)
    else:
        hosts = inv.ordered(hosts)
        request = apply.request_for(inv, hosts, {n: f for n, f in facts.items() if n in {h.name for h in hosts}},
                                    playbook.load("provision"), outcomes)
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


def build(selection: Selection, dry_run: bool = False, log: apply.Log = lambda s: None) -> list[Built]:
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

