"""After the playbook: is every node's environment what its build says, and the same everywhere?

Imports and fingerprints (clusterctl/envcheck.py on the node), a real all-reduce across the nodes, and
the verified state written where launch reads it (the node's clusterctl/state.json, and one record per
inventory on the head). Nothing is repeated when the environment's stamp is the one last verified.
"""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any

from cluster import __version__, paths
from cluster.errors import ClusterError
from cluster.nodes.fanout import Group
from cluster.inventory.model import Host, Inventory
from cluster.provision.report import LOST_FIX, NodeOutcome, ProvisionReport, lost, settle
from cluster.nodes.replies import agent_reply, error_tail
from cluster.transport import Transport

FINGERPRINT_ALL = ("python", "torch", "torchvision", "tensorflow")
FINGERPRINT_GPU = ("cuda", "cudnn", "nccl")


def env_python(host: Host) -> str:
    """The interpreter provisioning installs the frameworks for: the node's venv, or its own Python."""
    return f"{host.workdir}/venv/bin/python" if host.vars.get("python_env", "venv") == "venv" else host.python


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


def _recorded(t: Transport, h: Host) -> tuple[dict[str, Any] | None, str | None]:
    """The node's state.json from its last verification, and the stamp its environment has now."""
    r = t.run(f"cat -- {shlex.quote(h.workdir + '/clusterctl/state.json')} 2>/dev/null", timeout=60)
    try:
        state = json.loads(r.stdout)
        purelib = state["fingerprint"]["purelib"]
    except (ValueError, KeyError, TypeError):
        return None, None
    return state, t.run(stamp_command(purelib), timeout=120).stdout.split()[0]


def _fingerprint(t: Transport, o: NodeOutcome, force: bool) -> dict[str, Any]:
    """One node's fingerprint: the recorded one if nothing changed and its stamp holds, else envcheck's."""
    h = t.host
    if not force and o.changed == 0:
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


def verify(group: Group, hosts: list[Host], out: dict[str, NodeOutcome], report: ProvisionReport,
           force: bool) -> None:
    """Imports, fingerprints and all-reduce where anything changed; otherwise the recorded result,
    after checking that the environment's stamp is still the one verified."""
    results = group.call(lambda t: _fingerprint(t, out[t.host.name], force), hosts)
    gone = lost(group, [n for n, r in results.items() if not r.ok])
    fps: dict[str, dict[str, Any]] = {}
    for h in hosts:
        r, o = results[h.name], out[h.name]
        if r.status == "unreachable" or h.name in gone:
            o.fail("unreachable", f"connection lost during verification: {r.error}", LOST_FIX)
        elif not r.ok:
            o.fail("failed", f"verification: {r.error}", "re-run provision; the venv step rebuilds a broken venv")
        elif _usable(group, h, o, r.value):
            fps[h.name] = r.value
    gpu_nodes = {n for n in fps if (b := out[n].build) is not None and b.gpu}
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


def _usable(group: Group, h: Host, o: NodeOutcome, fp: dict[str, Any]) -> bool:
    """Keep the fingerprint; fail the node when a framework does not import or CUDA is missing."""
    o.fingerprint = fp
    broken = [k for k in ("torch", "torchvision", "tensorflow") if fp.get(k) is None]
    if broken:
        o.fail("failed", f"verification: cannot import {', '.join(broken)}: "
               + "; ".join(fp["errors"].get(k, "") for k in broken),
               "the venv is marked broken: the next `clusterctl provision` rebuilds it")
        if h.vars.get("python_env", "venv") == "venv":
            group.transports[h.name].run(f"touch -- {shlex.quote(h.workdir + '/venv/.clusterctl-broken')}")
        return False
    if o.build and o.build.backend == "nccl" and not fp.get("cuda_available"):
        o.fail("failed", "verification: the chosen build expects CUDA but torch sees no GPU",
               "check the driver (`nvidia-smi`) and that the node's GPU is not in use by another process")
        return False
    return True


def _previous_allreduce(group: Group, h: Host) -> dict[str, Any] | None:
    r = group.transports[h.name].run(f"cat -- {shlex.quote(h.workdir + '/clusterctl/state.json')}", timeout=60)
    try:
        doc = json.loads(r.stdout).get("allreduce")
    except (ValueError, AttributeError):
        return None
    return doc if isinstance(doc, dict) else None


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
    build = out[master.name].build
    backend = build.backend if build else "gloo"
    mb = float(master.vars.get("allreduce_mb", 32))
    results = group.run(lambda h: allreduce_command(h, hosts, port, backend, mb), timeout=180, hosts=hosts)
    gone = lost(group, [n for n, r in results.items() if not r.ok])
    for h in hosts:
        r, o = results[h.name], out[h.name]
        o.allreduce = agent_reply(r.stdout)
        if r.status == "unreachable" or h.name in gone:
            o.allreduce = None
            o.fail("unreachable", f"connection lost during the all-reduce test: {r.error}", LOST_FIX)
        elif not r.ok or not isinstance(o.allreduce, dict) or not o.allreduce.get("ok"):
            tail = error_tail(r.stderr or r.stdout or r.error, 500)
            o.fail("failed", f"all-reduce across {len(hosts)} nodes failed: {tail}",
                   "check that the nodes reach each other on the lab network (firewall, interface in cluster.env)")


def state_dir() -> Path:
    return paths.home() / "state"


def record_state(inv: Inventory, report: ProvisionReport) -> None:
    """The verified state, on the head (one file per inventory) and on each node that passed."""
    now = time.time()
    ok = [inv.hosts[n] for n, o in report.nodes.items() if o.status == "ok"]
    if ok:
        with Group(ok) as g:
            def put(t: Transport) -> None:
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
            settle(g, ok, g.call(put), report.nodes, "recording the verified state")
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    doc = {"clusterctl": __version__, "time": now, **report.to_dict()}
    (d / f"{paths.inventory_key(inv.name, inv.path)}.json").write_text(json.dumps(doc, indent=1, default=str))
