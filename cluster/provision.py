"""`clusterctl provision`: facts -> build plan -> wheelhouse -> playbook -> verify -> state.

A node that fails never stops the others; every outcome is data in ProvisionReport.
"""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Iterable

from cluster import __version__, compat, facts, paths, playbook, wheelhouse
from cluster.errors import ClusterError
from cluster.fanout import Group
from cluster.inventory import Host, Inventory
from cluster.replies import agent_reply, error_tail

LOST_FIX = ("check that the node is up and on the network (`clusterctl check`), then re-run provision: "
            "it repeats only what is not done")
FINGERPRINT_ALL = ("python", "torch", "torchvision", "tensorflow")
FINGERPRINT_GPU = ("cuda", "cudnn", "nccl")
EXTRA_PACKAGES = ("numpy", "scikit-learn", "psutil",  # data and metrics of the workloads
                  "uv")  # the installer: a wheel with a static binary, installed first from the node's wheelhouse


@dataclass
class NodeOutcome:
    host: str
    status: str = "pending"  # ok | failed | unreachable | refused
    error: str | None = None
    fix: str | None = None
    steps: list[playbook.StepResult] = field(default_factory=list)
    build: compat.NodeBuild | None = None
    fingerprint: dict[str, Any] | None = None
    allreduce: dict[str, Any] | None = None
    duration: float = 0.0

    def fail(self, status: str, error: str, fix: str | None = None) -> None:
        self.status, self.error, self.fix = status, error, fix

    @property
    def changed(self) -> int:
        return sum(s.status in (playbook.CHANGED, playbook.WOULD_CHANGE) for s in self.steps)

    @property
    def unchanged(self) -> int:
        return sum(s.status in (playbook.UNCHANGED, playbook.SKIPPED) for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "status": self.status, "error": self.error, "fix": self.fix,
                "changed": self.changed, "unchanged": self.unchanged, "duration": round(self.duration, 2),
                "steps": [s.to_dict() for s in self.steps],
                "build": self.build.to_dict() if self.build else None,
                "fingerprint": self.fingerprint, "allreduce": self.allreduce}


@dataclass
class ProvisionReport:
    inventory: str
    dry_run: bool
    plan: compat.BuildPlan | None  # shown as "plan" in --json
    nodes: dict[str, NodeOutcome]
    fingerprint_diff: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    distribution: dict[str, Any] | None = None  # the wheels' relay plan: who receives from whom

    @property
    def ok(self) -> bool:
        return all(n.status == "ok" for n in self.nodes.values())

    @property
    def nothing_to_do(self) -> bool:
        return self.ok and not any(n.changed for n in self.nodes.values())

    def to_dict(self) -> dict[str, Any]:
        return {"inventory": self.inventory, "dry_run": self.dry_run, "ok": self.ok,
                "nothing_to_do": self.nothing_to_do, "plan": self.plan.to_dict() if self.plan else None,
                "nodes": [n.to_dict() for n in self.nodes.values()],
                "fingerprint_diff": self.fingerprint_diff, "notes": self.notes, "distribution": self.distribution}


def node_gpus(host: Host, nf: facts.NodeFacts) -> list[dict[str, Any]]:
    """GPUs from facts, corrected by the inventory's `gpu:` override."""
    gpus = [dict(g) for g in (nf.values.get("gpus") or {}).get("gpus", [])]
    if host.gpu is not None and host.gpu.count == 0:
        return []
    if host.gpu is not None and host.gpu.compute_capability:
        for g in gpus:
            g["compute_capability"] = g.get("compute_capability") or host.gpu.compute_capability
    return gpus


def _script(name: str) -> str:
    return resources.files("cluster.workloads").joinpath(name).read_text()


def _context(host: Host, nf: facts.NodeFacts, build: compat.NodeBuild, wh: wheelhouse.Wheelhouse | None,
             on_bytes: Callable[[int], None] | None) -> dict[str, Any]:
    env = host.vars.get("python_env", "venv")
    hn = nf.values.get("hostname") or {}
    return {
        "host": host.to_dict(), "vars": dict(host.vars), "facts": nf.to_dict(), "build": build.to_dict(),
        "wheelhouse": wh, "on_bytes": on_bytes,
        "env_python": f"{host.workdir}/venv/bin/python" if env == "venv" else host.python,
        "net": {"iface": nf.address_nic or "eth0", "gpus": len(node_gpus(host, nf)),
                "hostname_on_loopback": bool(hn.get("on_loopback"))},
        "scripts": {"envcheck": _script("envcheck.py"), "allreduce": _script("allreduce.py")},
    }


def env_python(host: Host) -> str:
    return f"{host.workdir}/venv/bin/python" if host.vars.get("python_env", "venv") == "venv" else host.python


def run(inv: Inventory, hosts: list[Host], dry_run: bool = False, verify: bool = False, forks: int = 32,
        pb_path: str = "provision", log: Callable[[str], None] = lambda s: None,
        on_step: Callable[[str, playbook.StepResult], None] | None = None,
        on_bytes: Callable[[str, int], None] | None = None) -> ProvisionReport:
    pb = playbook.load(pb_path)
    hosts = inv.ordered(hosts)
    out = {h.name: NodeOutcome(h.name) for h in hosts}
    report = ProvisionReport(str(inv.path), dry_run, None, out)
    with Group(hosts, forks=forks) as group:
        log(f"gathering facts from {len(hosts)} nodes")
        gathered = facts.gather(group)
        nf: dict[str, facts.NodeFacts] = {}
        for h in hosts:
            r = gathered[h.name]
            if r.ok:
                nf[h.name] = r.value
            else:
                out[h.name].fail("unreachable" if r.status == "unreachable" else "failed", r.error or r.status, r.fix)
        report.plan = _build_plan(inv, [h for h in hosts if h.name in nf], nf, out)
        planned = [h for h in hosts if report.plan and h.name in report.plan.builds and out[h.name].status == "pending"]
        whs = _wheelhouses(planned, nf, report.plan, dry_run, log, out)
        # every node's wheels at once, before the playbooks: the head sends each file once, the nodes relay it
        pending = [h for h in planned if out[h.name].status == "pending"]
        report.distribution = wheelhouse.distribute(
            group, pb, pending, {h.name: _context(h, nf[h.name], report.plan.builds[h.name], whs.get(h.name), None)
                                 for h in pending}, whs, dry_run, on_bytes, log,
            lambda n, status, error, fix: out[n].fail(status, error, fix))

        def do(t):
            h = t.host
            start = time.monotonic()
            ctx = _context(h, nf[h.name], report.plan.builds[h.name], whs.get(h.name),
                           (lambda n, name=h.name: on_bytes(name, n)) if on_bytes else None)
            pr = playbook.run(t, pb, ctx, dry=dry_run, on_step=on_step)
            o = out[h.name]
            o.steps, o.duration = pr.steps, time.monotonic() - start
            if pr.failed:
                o.fail("failed", f"step '{pr.failed.name}' failed: {pr.failed.detail}",
                       "fix the cause shown; the next `clusterctl provision` repeats only what is not done")
            return pr

        todo = [h for h in planned if out[h.name].status == "pending"]
        done = group.call(do, todo)
        _settle(group, todo, done, out, "the playbook")
        ready = [h for h in todo if out[h.name].status == "pending"]
        if not dry_run and ready:
            log("verifying: imports, fingerprints, all-reduce")
            _verify(group, ready, out, report, force=verify)
    for o in out.values():
        if o.status == "pending":
            o.status = "ok"
    if not dry_run:
        _record(inv, report)
    return report


def _lost(group: Group, names: Iterable[str]) -> set[str]:
    """Which of these nodes the head can no longer reach: a step or check that failed because the node
    went away (sshd killed, link down, reboot) makes the node unreachable (exit 3), not failed (exit 1)."""
    wanted = set(names)
    hosts = [h for h in group.hosts if h.name in wanted]
    if not hosts:
        return set()
    probe = group.call(lambda t: t.run("true", timeout=2 * t.host.connect_timeout), hosts)
    return {n for n, r in probe.items() if r.status == "unreachable"}


def _settle(group: Group, hosts: list[Host], results: Any, out: dict[str, NodeOutcome], stage: str) -> None:
    """Record each node's outcome of one fan-out stage: lost nodes unreachable, errors failed.
    A node still `pending` after its function raised must not end up `ok`."""
    bad = [h.name for h in hosts if not results[h.name].ok or out[h.name].status == "failed"]
    lost = _lost(group, bad)
    for h in hosts:
        o, r = out[h.name], results[h.name]
        failed_step = next((st for st in o.steps if st.status == playbook.FAILED), None)
        if r.status == "unreachable" or h.name in lost or (failed_step is not None and failed_step.unreachable):
            detail = o.error or r.error or "no answer"
            o.fail("unreachable", f"connection lost during {stage}: {detail}", LOST_FIX)
        elif not r.ok and o.status in ("pending", "ok"):
            o.fail("failed", f"{stage}: {r.error or r.status}", r.fix)


def _build_plan(inv: Inventory, hosts: list[Host], nf: dict[str, facts.NodeFacts],
                out: dict[str, NodeOutcome]) -> compat.BuildPlan | None:
    if not hosts:
        return None
    options = [compat.node_options(h.name, node_gpus(h, nf[h.name])) for h in hosts]
    index = hosts[0].vars.get("torch_index", "pytorch")
    cp = compat.build_plan(options, torch_index=None if index == "pypi" else "pytorch")
    for h, reason in cp.refused.items():
        out[h].fail("refused", reason, cp.nodes[h].fix)
    for h, b in cp.builds.items():
        out[h].build = b
    return cp


def _wheelhouses(hosts: list[Host], nf: dict[str, facts.NodeFacts], plan: compat.BuildPlan | None,
                 dry_run: bool, log: Callable[[str], None],
                 out: dict[str, NodeOutcome]) -> dict[str, wheelhouse.Wheelhouse]:
    """One wheelhouse per (requirements, Python minor); built on the head once, cached across runs."""
    result: dict[str, wheelhouse.Wheelhouse] = {}
    groups: dict[tuple[tuple[str, ...], str, str | None], list[str]] = {}
    for h in hosts:
        if h.vars.get("python_env", "venv") != "venv":
            continue
        py = nf[h.name].values.get("python")
        if py is None:
            out[h.name].fail("failed", f"`{h.python}` does not run on the node",
                             "install python3 and python3-venv there, or set `python:` in the inventory")
            continue
        b = plan.builds[h.name]
        reqs = tuple(b.requirements() + list(EXTRA_PACKAGES) + list(h.vars.get("extra_packages", [])))
        pyver = ".".join(str(x) for x in py["version_tuple"][:2])
        index = None if b.torch_index is None else b.torch_index
        groups.setdefault((reqs, pyver, index), []).append(h.name)
    for (reqs, pyver, index), names in groups.items():
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


def fingerprint_diff(fps: dict[str, dict[str, Any]], gpu_nodes: set[str]) -> tuple[list[str], set[str]]:
    """Lines like 'torch: node1, node2 = 2.14.1 | node3 = 2.13.0' and the nodes in a minority."""
    lines, odd = [], set()
    for key in FINGERPRINT_ALL + FINGERPRINT_GPU:
        names = [n for n in fps if key in FINGERPRINT_ALL or n in gpu_nodes]
        values: dict[str, list[str]] = {}
        for n in names:
            values.setdefault(str(fps[n].get(key)), []).append(n)
        if len(values) > 1:
            ranked = sorted(values.items(), key=lambda kv: -len(kv[1]))
            lines.append(f"{key}: " + " | ".join(f"{', '.join(ns)} = {v}" for v, ns in ranked))
            for _, ns in ranked[1:]:
                odd.update(ns)
    return lines, odd


def stamp_command(purelib: str) -> str:
    """Names, sizes and mtimes two levels into site-packages: changes when anything is (re)installed
    or a package's top-level files are edited, at the cost of a directory listing, not an import."""
    return f"find {shlex.quote(purelib)} -maxdepth 2 -printf '%P %s %T@\\n' 2>/dev/null | sort | sha256sum"


def _recorded(t, h: Host) -> tuple[dict[str, Any] | None, str | None]:
    """The node's state.json from its last verification, and the stamp its environment has now."""
    r = t.run(f"cat -- {shlex.quote(h.workdir + '/clusterctl/state.json')} 2>/dev/null", timeout=60)
    try:
        state = json.loads(r.stdout)
        purelib = state["fingerprint"]["purelib"]
    except (ValueError, KeyError, TypeError):
        return None, None
    return state, t.run(stamp_command(purelib), timeout=120).stdout.split()[0]


def _verify(group: Group, hosts: list[Host], out: dict[str, NodeOutcome], report: ProvisionReport,
            force: bool) -> None:
    """Imports, fingerprints and all-reduce where anything changed; otherwise the recorded result,
    after checking that the environment's stamp is still the one verified."""

    def check(t):
        h = t.host
        if not force and out[h.name].changed == 0:
            state, stamp = _recorded(t, h)
            if state and state.get("stamp") == stamp:
                return {**state["fingerprint"], "reused_from": state.get("time"), "stamp": stamp}
        r = t.run(f"{shlex.quote(env_python(h))} {shlex.quote(h.workdir + '/clusterctl/envcheck.py')}", timeout=600)
        if r.exit_code != 0:
            raise ClusterError(f"the environment check did not run: {error_tail(r.stderr or r.stdout, 400)}")
        fp = agent_reply(r.stdout)
        if fp is None:
            raise ClusterError(f"the environment check printed no JSON: {error_tail(r.stdout, 400)}")
        if fp.get("purelib"):
            fp["stamp"] = t.run(stamp_command(fp["purelib"]), timeout=120).stdout.split()[0]
        return fp

    results = group.call(check, hosts)
    lost = _lost(group, [n for n, r in results.items() if not r.ok])
    fps: dict[str, dict[str, Any]] = {}
    for h in hosts:
        r, o = results[h.name], out[h.name]
        if r.status == "unreachable" or h.name in lost:
            o.fail("unreachable", f"connection lost during verification: {r.error}", LOST_FIX)
            continue
        if not r.ok:
            o.fail("failed", f"verification: {r.error}", "re-run provision; the venv step rebuilds a broken venv")
            continue
        fp = r.value
        o.fingerprint = fp
        broken = [k for k in ("torch", "torchvision", "tensorflow") if fp.get(k) is None]
        if broken:
            o.fail("failed", f"verification: cannot import {', '.join(broken)}: "
                   + "; ".join(fp["errors"].get(k, "") for k in broken),
                   "the venv is marked broken: the next `clusterctl provision` rebuilds it")
            if h.vars.get("python_env", "venv") == "venv":
                group.transports[h.name].run(f"touch -- {shlex.quote(h.workdir + '/venv/.clusterctl-broken')}")
        elif o.build and o.build.backend == "nccl" and not fp.get("cuda_available"):
            o.fail("failed", "verification: the plan expects CUDA but torch sees no GPU",
                   "check the driver (`nvidia-smi`) and that the node's GPU is not in use by another process")
        else:
            fps[h.name] = fp
    gpu_nodes = {n for n in fps if out[n].build and out[n].build.gpu}
    report.fingerprint_diff, odd = fingerprint_diff(fps, gpu_nodes)
    for n in odd:
        out[n].fail("failed", "its environment differs from the other nodes' (see the fingerprint diff)",
                    "re-run provision; if it persists, remove the node's venv and provision again")
        fps.pop(n)
    verified = [h for h in hosts if h.name in fps]
    reused = {n for n, r in results.items() if r.ok and r.value.get("reused_from")}
    if reused == {h.name for h in hosts}:
        for h in verified:  # keep the bandwidth measured when the environment was last verified
            out[h.name].allreduce = _previous_allreduce(group, h)
        report.notes.append("nothing changed since the last verification (stamps match): imports and all-reduce "
                            "not repeated; `clusterctl provision --verify` repeats them")
        return
    _allreduce(group, verified, out, report)


def _previous_allreduce(group: Group, h: Host) -> dict[str, Any] | None:
    r = group.transports[h.name].run(f"cat -- {shlex.quote(h.workdir + '/clusterctl/state.json')}", timeout=60)
    try:
        return json.loads(r.stdout).get("allreduce")
    except ValueError:
        return None


def allreduce_command(h: Host, hosts: list[Host], port: int, backend: str, mb: float) -> str:
    """Node h's part of the all-reduce test (clusterctl/allreduce.py) across `hosts`, hosts[0] the master."""
    q = shlex.quote
    master = f"{hosts[0].address}:{port}"
    # the interpreter cluster.env names: what provisioning installed, whatever the inventory says today
    return (f"cd -- {q(h.workdir)} && . ./cluster.env && exec \"$CLUSTER_PYTHON\" clusterctl/allreduce.py "
            f"--rank {hosts.index(h)} --world {len(hosts)} --master {q(master)} --backend {q(backend)} --mb {mb:g}")


def _allreduce(group: Group, hosts: list[Host], out: dict[str, NodeOutcome], report: ProvisionReport) -> None:
    if len(hosts) < 2:
        report.notes.append("all-reduce test skipped: fewer than 2 verified nodes")
        return
    master = hosts[0]
    port = int(master.vars.get("allreduce_port", 29499))
    backend = out[master.name].build.backend if out[master.name].build else "gloo"
    mb = float(master.vars.get("allreduce_mb", 32))
    results = group.run(lambda h: allreduce_command(h, hosts, port, backend, mb), timeout=180, hosts=hosts)
    lost = _lost(group, [n for n, r in results.items() if not r.ok])
    for h in hosts:
        r, o = results[h.name], out[h.name]
        o.allreduce = agent_reply(r.stdout)
        if r.status == "unreachable" or h.name in lost:
            o.allreduce = None
            o.fail("unreachable", f"connection lost during the all-reduce test: {r.error}", LOST_FIX)
        elif not r.ok or not isinstance(o.allreduce, dict) or not o.allreduce.get("ok"):
            tail = error_tail(r.stderr or r.stdout or r.error, 500)
            o.fail("failed", f"all-reduce across {len(hosts)} nodes failed: {tail}",
                   "check that the nodes reach each other on the lab network (firewall, interface in cluster.env)")


def state_dir() -> Any:
    return paths.home() / "state"


def _record(inv: Inventory, report: ProvisionReport) -> None:
    """The verified state, on the head (one file per inventory) and on each node that passed."""
    now = time.time()
    ok = [inv.hosts[n] for n, o in report.nodes.items() if o.status == "ok"]
    if ok:
        with Group(ok) as g:
            def put(t):
                o = report.nodes[t.host.name]
                fp = dict(o.fingerprint or {})
                if fp.get("reused_from"):
                    return  # nothing was verified anew: the node's record stands
                stamp = fp.pop("stamp", None)
                node_doc = {"clusterctl": __version__, "time": now, "host": t.host.name,
                            "fingerprint": fp, "stamp": stamp, "allreduce": o.allreduce,
                            "build": o.build.to_dict() if o.build else None}
                t.put_bytes(json.dumps(node_doc, indent=1).encode(), f"{t.host.workdir}/clusterctl/state.json")

            # a node whose record could not be written is not provisioned as far as launch can tell
            _settle(g, ok, g.call(put), report.nodes, "recording the verified state")
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    doc = {"clusterctl": __version__, "time": now, **report.to_dict()}
    (d / f"{paths.inventory_key(inv.name, inv.path)}.json").write_text(json.dumps(doc, indent=1, default=str))
