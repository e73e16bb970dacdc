"""`clusterctl provision`: prepare the request (facts -> builds -> each node's steps), then execute it
(wheelhouse -> playbook -> verify -> state).

`prepare` only reads (facts over SSH) and returns the ProvisionRequest that `provision --dry-run` shows;
`execute` runs that request, for real or as a dry run (each step's guard checked on its node, nothing
changed). A node that fails never stops the others; every outcome is data in ProvisionReport.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from cluster.nodes import health, power
from cluster.provision import compat, diskspace, playbook, wheelhouse
from cluster.nodes import facts
from cluster.errors import ClusterError
from cluster.nodes.fanout import Group
from cluster.inventory.model import Host, Inventory
from cluster.provision.playbook import Playbook, RenderedStep
from cluster.provision.report import LOST_FIX, NodeOutcome, ProvisionReport, settle
from cluster.relay.progress import StatusFn
from cluster.transport import Transport
from cluster.provision.verify import (FINGERPRINT_ALL, FINGERPRINT_GPU, allreduce_command, env_python, fingerprint_diff,
                            record_state, stamp_command, state_dir, verify)

__all__ = ["EXTRA_PACKAGES", "FINGERPRINT_ALL", "FINGERPRINT_GPU", "LOST_FIX", "NodeOutcome", "ProvisionReport",
           "ProvisionRequest", "allreduce_command", "env_python", "execute", "fingerprint_diff", "node_gpus",
           "prepare", "request_for", "run", "stamp_command", "state_dir", "wheelhouse_sets"]

EXTRA_PACKAGES = ("numpy", "scikit-learn", "psutil",  # data and metrics of the workloads
                  "uv")  # the installer: a wheel with a static binary, installed first from the node's wheelhouse
Log = Callable[[str], None]
OnStep = Callable[[str, playbook.StepResult], None]
OnBytes = Callable[[str, int], None]


@dataclass
class ProvisionRequest:
    """What provision would do: each node's build (the builds chosen for all) and the playbook's steps as they
    would run there; the nodes it cannot do (unreachable, refused by the builds) with the reason. Printed by
    `provision --dry-run`; `execute` runs it."""

    inventory: Inventory
    hosts: list[Host]  # every node asked, in inventory order
    playbook: Playbook
    facts: dict[str, facts.NodeFacts]  # the nodes that answered
    choice: compat.BuildChoice | None
    outcomes: dict[str, NodeOutcome]  # `pending`: to provision; otherwise why not

    @property
    def planned(self) -> list[Host]:
        builds = self.choice.builds if self.choice else {}
        return [h for h in self.hosts if h.name in builds and self.outcomes[h.name].status == "pending"]

    def steps(self) -> dict[str, list[RenderedStep]]:
        """Each planned node's steps, rendered as the playbook would run them (guards shown, not checked;
        the wheelhouse is only known once provision builds it: the steps that need it show as skipped)."""
        return {h.name: playbook.render_steps(self.playbook, node_context(h, self.facts[h.name],
                                                                          self.build(h.name), None, None))
                for h in self.planned}

    def build(self, node: str) -> compat.NodeBuild:
        """A planned node's build."""
        if self.choice is None or node not in self.choice.builds:
            raise ClusterError(f"{node} has no build in the builds chosen")
        return self.choice.builds[node]

    def to_dict(self) -> dict[str, Any]:
        steps = self.steps()
        return {"inventory": str(self.inventory.path), "builds": self.choice.to_dict() if self.choice else None,
                "nodes": [{**{k: v for k, v in o.to_dict().items() if k in ("host", "status", "error", "fix")},
                           "build": o.build.to_dict() if o.build else None,
                           "steps": [dataclasses.asdict(s) for s in steps.get(o.host, [])]}
                          for o in self.outcomes.values()]}

    def to_text(self) -> str:
        """The printed request: the builds, then each node's build and steps, or why it is left out."""
        p = self.choice
        lines = [f"builds: torch {p.torch}, TensorFlow {p.tensorflow}, backend {p.backend}" if p else "builds: none"]
        steps = self.steps()
        for o in self.outcomes.values():
            if o.host not in steps:
                lines.append(f"{o.host}: {o.status}: {o.error}" + (f" (fix: {o.fix})" if o.fix else ""))
                continue
            b = self.build(o.host)
            lines.append(f"{o.host}: GPU {b.gpu or 'none'}, torch {b.torch_label}, TensorFlow {b.tensorflow} "
                         f"({'GPU' if b.tf_on_gpu else 'CPU'}), AMP {'on' if b.amp else 'off'}"
                         + "".join(f"; {n}" for n in b.notes + b.pins))
            lines += [s.to_text() for s in steps[o.host]]
        return "\n".join(lines) + "\n"


def node_gpus(host: Host, nf: facts.NodeFacts) -> list[dict[str, Any]]:
    """GPUs from facts, corrected by the inventory's `gpu:` override."""
    gpus = [dict(g) for g in (nf.values.get("gpus") or {}).get("gpus", [])]
    if host.gpu is not None and host.gpu.count == 0:
        return []
    if host.gpu is not None and host.gpu.compute_capability:
        for g in gpus:
            g["compute_capability"] = g.get("compute_capability") or host.gpu.compute_capability
    return gpus


def _script(package: str, name: str) -> str:
    return resources.files(f"cluster.{package}").joinpath(name).read_text()


def node_context(host: Host, nf: facts.NodeFacts, build: compat.NodeBuild, wh: wheelhouse.Wheelhouse | None,
                 on_bytes: Callable[[int], None] | None) -> dict[str, Any]:
    """What the playbook's templates and conditions see for one node."""
    hn = nf.values.get("hostname") or {}
    return {
        "host": host.to_dict(), "vars": dict(host.vars), "facts": nf.to_dict(), "build": build.to_dict(),
        "wheelhouse": wh, "on_bytes": on_bytes, "env_python": env_python(host),
        "net": {"iface": nf.address_nic or "eth0", "gpus": len(node_gpus(host, nf)),
                "hostname_on_loopback": bool(hn.get("on_loopback"))},
        "scripts": {"envcheck": _script("agent", "envcheck.py"), "allreduce": _script("programs", "allreduce.py")},
    }


# --------------------------------------------------------------------------- the request


def prepare(inv: Inventory, hosts: list[Host], forks: int = 32, pb_path: str = "provision",
            log: Log = lambda s: None) -> ProvisionRequest:
    """Facts from every node (read-only), then the request: nothing is installed or written anywhere."""
    pb = playbook.load(pb_path)
    hosts = inv.ordered(hosts)
    with Group(hosts, forks=forks) as group:
        log(f"gathering facts from {len(hosts)} nodes")
        gathered = facts.gather(group)
    out = {h.name: NodeOutcome(h.name) for h in hosts}
    nf: dict[str, facts.NodeFacts] = {}
    for h in hosts:
        r = gathered[h.name]
        if r.ok:
            nf[h.name] = r.value
        else:
            out[h.name].fail("unreachable" if r.status == "unreachable" else "failed", r.error or r.status, r.fix)
    power.record(inv, nf)  # for `wake`, once these PCs are off (as `check` records them)
    for p in health.shared_workdirs(hosts, nf):  # before anything is written: each would overwrite the other
        out[p.host].fail("failed", p.message, p.fix)
        nf.pop(p.host, None)
    return request_for(inv, hosts, nf, pb, out)


def request_for(inv: Inventory, hosts: list[Host], nf: dict[str, facts.NodeFacts], pb: Playbook,
                outcomes: dict[str, NodeOutcome] | None = None) -> ProvisionRequest:
    """The request for these nodes' facts (pure: the golden tests' entry); `outcomes`: nodes already out."""
    out = outcomes if outcomes is not None else {h.name: NodeOutcome(h.name) for h in hosts}
    choice = _choose_builds([h for h in hosts if h.name in nf], nf, out)
    return ProvisionRequest(inv, hosts, pb, nf, choice, out)


def execute(request: ProvisionRequest, dry_run: bool = False, verify_all: bool = False, forks: int = 32,
            log: Log = lambda s: None, on_step: OnStep | None = None,
            on_bytes: OnBytes | None = None, on_relay: StatusFn | None = None) -> ProvisionReport:
    """Run the request: wheels, playbook, and (not in a dry run) verification and the recorded state.
    `verify_all`: repeat the imports and all-reduce even where nothing changed (`--verify`)."""
    out = copy.deepcopy(request.outcomes)  # the request stays as prepared
    report = ProvisionReport(str(request.inventory.path), dry_run, request.choice, out)
    with Group(request.hosts, forks=forks) as group:
        planned = request.planned
        whs = _wheelhouses(planned, request.facts, request.choice, dry_run, log, out)
        pending = [h for h in planned if out[h.name].status == "pending"]
        contexts = {h.name: node_context(h, request.facts[h.name], request.build(h.name), whs.get(h.name), None)
                    for h in pending}
        _disk_room(group, request.playbook, pending, contexts, whs, out, log)
        # every node's wheels at once, before the playbooks: the head sends each file once, the nodes relay it
        pending = [h for h in pending if out[h.name].status == "pending"]
        report.distribution = wheelhouse.distribute(
            group, request.playbook, pending, contexts, whs, dry_run, on_bytes, log,
            lambda n, status, error, fix: out[n].fail(status, error, fix), status=on_relay)
        todo = [h for h in planned if out[h.name].status == "pending"]
        _playbooks(group, request, todo, whs, out, dry_run, on_step, on_bytes)
        ready = [h for h in todo if out[h.name].status == "pending"]
        if not dry_run and ready:
            log("verifying: imports, fingerprints, all-reduce")
            verify(group, ready, out, report, force=verify_all)
    for o in out.values():
        if o.status == "pending":
            o.status = "ok"
    if not dry_run:
        record_state(request.inventory, report)
    return report


SUDO_NEEDS_PASSWORD = ("a password is required", "a terminal is required")  # what `sudo -n` says instead of asking


def _step_fix(h: Host, detail: str) -> str:
    """The fix of a failed step: for a sudo that wanted a password, the NOPASSWD rule (never a password)."""
    if any(s in detail for s in SUDO_NEEDS_PASSWORD):
        return (f"clusterctl never asks for a password: give {h.user} passwordless sudo for what provision runs as "
                f"root, e.g. `echo '{h.user} ALL=(root) NOPASSWD: /usr/bin/install, /usr/bin/env' | "
                "sudo tee /etc/sudoers.d/clusterctl` (visudo -cf checks it), then provision again")
    return "fix the cause shown; the next `clusterctl provision` repeats only what is not done"


def run(inv: Inventory, hosts: list[Host], dry_run: bool = False, verify: bool = False, forks: int = 32,
        pb_path: str = "provision", log: Log = lambda s: None, on_step: OnStep | None = None,
        on_bytes: OnBytes | None = None) -> ProvisionReport:
    """prepare + execute in one call."""
    request = prepare(inv, hosts, forks, pb_path, log)
    return execute(request, dry_run, verify, forks, log, on_step, on_bytes)


def _disk_room(group: Group, pb: Playbook, hosts: list[Host], contexts: dict[str, dict[str, Any]],
               whs: dict[str, wheelhouse.Wheelhouse], out: dict[str, NodeOutcome], log: Log) -> None:
    """Fail, before anything is sent, the nodes whose disk cannot take their wheels and venv (diskspace);
    a node that cannot be measured is left to the steps that follow, which report what stops it."""
    dests = wheelhouse.wheel_destinations(pb, hosts, contexts)
    todo = [h for h in hosts if h.name in dests and h.name in whs]
    if not todo:
        return
    unpacked: dict[Path, int] = {}
    needs: dict[str, diskspace.Need] = {}
    for h in todo:
        wh = whs[h.name]
        if wh.dir not in unpacked:
            unpacked[wh.dir] = diskspace.installed_bytes(wh)
        needs[h.name] = diskspace.Need(wh.total_bytes, unpacked[wh.dir], wh.lock_text)
    res = group.run(lambda h: diskspace.command(h.workdir, dests[h.name], f"{h.workdir}/venv"), timeout=300,
                    hosts=todo)
    disks: dict[str, diskspace.NodeDisk] = {}
    for h in todo:
        try:
            disks[h.name] = diskspace.parse(res[h.name].stdout)
        except ValueError:
            log(f"{h.name}: free disk space not measured ({res[h.name].error or 'unexpected output'})")
    for n, why in diskspace.shortfalls(disks, needs).items():
        out[n].fail("failed", why, diskspace.FIX)


def _playbooks(group: Group, request: ProvisionRequest, hosts: list[Host], whs: dict[str, wheelhouse.Wheelhouse],
               out: dict[str, NodeOutcome], dry_run: bool, on_step: OnStep | None, on_bytes: OnBytes | None) -> None:
    """The playbook on every node at once; each node's steps and outcome into `out`."""

    def do(t: Transport) -> playbook.PlaybookRun:
        h = t.host
        start = time.monotonic()
        node_bytes = (lambda n, name=h.name: on_bytes(name, n)) if on_bytes else None
        ctx = node_context(h, request.facts[h.name], request.build(h.name), whs.get(h.name), node_bytes)
        pr = playbook.run(t, request.playbook, ctx, dry=dry_run, on_step=on_step)
        o = out[h.name]
        o.steps, o.duration = pr.steps, time.monotonic() - start
        if pr.failed:
            o.fail("failed", f"step '{pr.failed.name}' failed: {pr.failed.detail}", _step_fix(h, pr.failed.detail))
        return pr

    settle(group, hosts, group.call(do, hosts), out, "the playbook")


def _choose_builds(hosts: list[Host], nf: dict[str, facts.NodeFacts],
                out: dict[str, NodeOutcome]) -> compat.BuildChoice | None:
    if not hosts:
        return None
    options = [compat.node_options(h.name, node_gpus(h, nf[h.name])) for h in hosts]
    index = hosts[0].vars.get("torch_index", "pytorch")
    cp = compat.choose_builds(options, torch_index=None if index == "pypi" else "pytorch")
    for h, reason in cp.refused.items():
        out[h].fail("refused", reason, cp.nodes[h].fix)
    for h, b in cp.builds.items():
        out[h].build = b
    return cp


WheelhouseSet = tuple[tuple[str, ...], str, str | None]  # (requirements, Python minor, torch index)


def wheelhouse_sets(hosts: list[Host], nf: dict[str, facts.NodeFacts], choice: compat.BuildChoice | None,
                    out: dict[str, NodeOutcome]) -> dict[WheelhouseSet, list[str]]:
    """Each wheelhouse provision needs, with its nodes: one per (requirements, Python minor, index). What
    `_wheelhouses` builds here, and `clusterctl wheelhouse build` fills ahead on a machine with internet
    (provision/wheelhouse_plan.py). A node whose Python does not run fails in `out`."""
    groups: dict[WheelhouseSet, list[str]] = {}
    for h in hosts:
        if h.vars.get("python_env", "venv") != "venv" or choice is None:
            continue
        py = nf[h.name].values.get("python")
        if py is None:
            out[h.name].fail("failed", f"`{h.python}` does not run on the node",
                             "install python3 and python3-venv there, or set `python:` in the inventory")
            continue
        b = choice.builds[h.name]
        reqs = tuple(b.requirements() + list(EXTRA_PACKAGES) + list(h.vars.get("extra_packages", [])))
        pyver = ".".join(str(x) for x in py["version_tuple"][:2])
        groups.setdefault((reqs, pyver, b.torch_index), []).append(h.name)
    return groups


def _wheelhouses(hosts: list[Host], nf: dict[str, facts.NodeFacts], choice: compat.BuildChoice | None,
                 dry_run: bool, log: Log, out: dict[str, NodeOutcome]) -> dict[str, wheelhouse.Wheelhouse]:
    """One wheelhouse per (requirements, Python minor); built on the head once, cached across runs."""
    result: dict[str, wheelhouse.Wheelhouse] = {}
    for (reqs, pyver, index), names in wheelhouse_sets(hosts, nf, choice, out).items():
        try:
            wh = wheelhouse.cached(list(reqs), pyver, index) if dry_run else \
                wheelhouse.build(list(reqs), pyver, index, log=log)
        except ClusterError as e:
            for n in names:
                out[n].fail("failed", f"wheelhouse: {e.message}", e.fix)
            continue
        for n in names:
            if wh is not None:
                result[n] = wh
    return result
