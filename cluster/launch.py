"""`clusterctl launch` and the run lifecycle: preflight -> stage -> render -> upload -> start -> follow.

Every node is started by the node agent (cluster/workloads/nodeagent.py) in a
session of its own, so a run outlives the SSH connection that started it. The
head only polls: one agent `status` per node per poll. A node that fails or
vanishes fails the run, and the others are stopped instead of being left
hanging in a collective; everything written so far stays on the nodes.
"""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable

from cluster import __version__, datasets, provision, render, runs
from cluster.errors import ClusterError, UsageError
from cluster.fanout import Group
from cluster.inventory import Host, Inventory
from cluster.jobs import JobSpec

PROGRAM_FILES = ("wlcommon.py", "wldata.py", "wlmetrics.py")
DEFAULT_PORTS = {"pytorch": 29400, "tensorflow": 23456}
UNREACHABLE_GRACE_S = 60.0  # a node silent this long fails the run
FAILED_STATES = ("failed", "vanished", "missing")


class LaunchRefused(ClusterError):
    """The nodes are not ready for this job (not provisioned, environments differ, busy)."""


@dataclass
class NodeStatus:
    node: str
    state: str  # agent state, or unreachable
    epoch: int | None = None
    step: int | None = None
    loss: float | None = None
    images_per_s: float | None = None
    world: int | None = None
    ranks: int = 0
    exit_code: int | None = None
    processes: int = 0
    log: list[str] = field(default_factory=list)
    error: str | None = None
    ended: float | None = None

    @classmethod
    def from_agent(cls, node: str, doc: dict[str, Any]) -> NodeStatus:
        s = cls(node, doc.get("state", "missing"), error=doc.get("error"), log=doc.get("log") or [],
                processes=len(doc.get("processes") or []))
        if doc.get("exit"):
            s.exit_code, s.ended = doc["exit"].get("code"), doc["exit"].get("ended")
        metrics = doc.get("metrics") or {}
        s.ranks = len(metrics)
        if metrics:
            recs = metrics[min(metrics, key=int)]  # the node's lowest rank speaks for it
            last = recs.get("step") or {}
            s.world = (recs.get("start") or {}).get("world")
            s.epoch, s.step, s.loss = last.get("epoch"), last.get("step"), last.get("loss")
            s.images_per_s = last.get("images_per_s")
            if recs.get("end"):
                s.step = recs["end"].get("step", s.step)
        return s

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# --------------------------------------------------------------------------- preflight


def select_hosts(inv: Inventory, spec: JobSpec, limit: str | None) -> list[Host]:
    nodes = spec["nodes"]
    chosen = inv.select(None if nodes == "all" else ",".join(nodes) if isinstance(nodes, list) else nodes)
    if limit:
        allowed = {h.name for h in inv.select(limit)}
        chosen = [h for h in chosen if h.name in allowed]
    if not chosen:
        raise UsageError(f"job {spec.name}: no node left after nodes={nodes!r} and --limit {limit!r}",
                         "check the job's `nodes:` and --limit")
    return inv.ordered(chosen)


def preflight(group: Group, hosts: list[Host]) -> dict[str, render.Target]:
    """Each node's verified environment (its provision state.json); refuse unless all exist and match."""

    def read(t):
        q = shlex.quote(t.host.workdir)
        r = t.run(f"cat -- {q}/clusterctl/state.json && test -f {q}/cluster.env", timeout=60)
        return json.loads(r.stdout) if r.exit_code == 0 and r.stdout.strip() else None

    results = group.call(read, hosts)
    unreachable = {n: r for n, r in results.items() if not r.ok and r.status == "unreachable"}
    if unreachable:
        raise LaunchRefused("cannot reach " + "; ".join(f"{n}: {r.error}" for n, r in unreachable.items()),
                            next((r.fix for r in unreachable.values() if r.fix), None)
                            or "check the nodes with `clusterctl check`")
    missing = [n for n, r in results.items() if not r.ok or not r.value]
    if missing:
        raise LaunchRefused(f"not provisioned (no verified environment): {', '.join(missing)}",
                            "run `clusterctl provision` for these nodes first")
    states = {n: r.value for n, r in results.items()}
    fps = {n: s.get("fingerprint") or {} for n, s in states.items()}
    gpu_nodes = {n for n, s in states.items() if (s.get("build") or {}).get("gpu")}
    diff, _ = provision.fingerprint_diff(fps, gpu_nodes)
    if diff:
        raise LaunchRefused("the nodes' environments differ: " + "; ".join(diff),
                            "run `clusterctl provision` so every node gets the same builds")
    targets = {}
    for h in hosts:
        s = states[h.name]
        gpus = len(s["fingerprint"].get("gpus") or []) if s["fingerprint"].get("cuda_available") else 0
        targets[h.name] = render.Target(h, gpus, (s.get("build") or {}).get("backend") or "gloo")
    return targets


def _busy(hosts: list[Host]) -> None:
    """Refuse to start on nodes an active run still uses (after asking the nodes, not trusting the record)."""
    mine = {(h.address, h.port): h.name for h in hosts}  # the same machines, whatever they are called
    for rec in runs.list_runs():
        if rec.get("state") not in runs.ACTIVE:
            continue
        shared = {mine[(h.address, h.port)] for h in runs.hosts(rec) if (h.address, h.port) in mine}
        if shared:
            rec = refresh(rec)
            if rec["state"] in runs.ACTIVE:
                raise LaunchRefused(f"run {rec['run_id']} is still {rec['state']} on {', '.join(sorted(shared))}",
                                    f"wait for it, or stop it: clusterctl stop {rec['run_id']}")


# --------------------------------------------------------------------------- launch


def _agent_source() -> str:
    return resources.files("cluster.workloads").joinpath("nodeagent.py").read_text()


def program_files(entry: str) -> dict[str, str]:
    """The training program a node runs: its entry point and the modules it imports."""
    wl = resources.files("cluster.workloads")
    return {n: wl.joinpath(n).read_text() for n in (entry, *PROGRAM_FILES)}


def launch(inv: Inventory, spec: JobSpec, limit: str | None = None, dry_run: bool = False, forks: int = 32,
           log: Callable[[str], None] = lambda s: None,
           prediction: dict[str, Any] | None = None) -> tuple[dict[str, Any], render.LaunchPlan]:
    """Start the job on its nodes; returns the run record (saved) and the rendered plan.
    `prediction`: the `clusterctl plan` candidate this run applies, kept in the record for the report."""
    hosts = select_hosts(inv, spec, limit)
    run_id = runs.new_run_id(spec.name)
    with Group(hosts, forks=forks) as group:
        log(f"checking {len(hosts)} nodes are provisioned and identical")
        targets = preflight(group, hosts)
        if dry_run:
            port = spec["port"] or DEFAULT_PORTS[spec.framework]
            plan = render.render(spec, [targets[h.name] for h in hosts], run_id, datasets.file_name(spec),
                                 {h.name: port for h in hosts})
            return _record(inv, spec, plan, "dry-run"), plan
        _busy(hosts)
        prepared = datasets.prepare(spec, log)
        agent = _agent_source()
        log(f"staging {prepared.file_name} ({prepared.size / 2**20:.1f} MiB) and the node agent")

        def stage(t):
            t.run(f"mkdir -p -- {shlex.quote(t.host.workdir + '/clusterctl')}", timeout=60)
            t.put_bytes(agent.encode(), f"{t.host.workdir}/{render.AGENT}")
            return datasets.stage(t, prepared)

        require(group.call(stage, hosts), "staging")
        ports = _ports(group, spec, hosts)
        plan = render.render(spec, [targets[h.name] for h in hosts], run_id, prepared.file_name, ports)
        record = _record(inv, spec, plan, "starting")
        record["prediction"] = prediction
        _keep_rendered(plan)
        runs.save(record)
        program = {f"program/{n}": text for n, text in program_files(spec.entry).items()}
        by_node = {n.node: n for n in plan.nodes}

        def upload(t):
            n = by_node[t.host.name]
            t.run(f"mkdir -p -- {shlex.quote(n.run_dir + '/program')} {shlex.quote(n.run_dir + '/out')}", timeout=60)
            for name, content in {**n.files, **program}.items():
                t.put_bytes(content.encode(), f"{n.run_dir}/{name}", 0o755 if name.endswith(".sh") else 0o644)

        uploaded = group.call(upload, hosts)
        if not uploaded.ok:
            _fail_start(record, uploaded, "upload")
        log(f"starting {len(hosts)} nodes")
        started = group.run(lambda h: by_node[h.name].start_command, timeout=60, hosts=hosts)
        for n in record["nodes"]:
            r = started[n["node"]]
            if r.ok:
                n["pids"] = json.loads(r.stdout.strip().splitlines()[-1])
        if not started.ok:
            stop_nodes(record)
            _fail_start(record, started, "start")
        record["state"], record["started"] = "running", time.time()
        runs.save(record)
        return record, plan


def require(results: Any, what: str) -> None:
    """Raise, naming every node where `what` failed."""
    bad = {n: r for n, r in results.items() if not r.ok}
    if bad:
        raise ClusterError(f"{what} failed on " + "; ".join(f"{n}: {r.error or r.stderr.strip()[-300:]}"
                                                          for n, r in bad.items()),
                           "fix the node shown (disk space, permissions) and launch again")


def _fail_start(record: dict[str, Any], results: Any, what: str) -> None:
    bad = {n: r for n, r in results.items() if not r.ok}
    node = next(iter(bad))
    r = bad[node]
    record["state"], record["ended"] = "failed", time.time()
    record["failure"] = {"node": node, "reason": f"{what} failed: {r.error or f'exit {r.exit_code}'}",
                         "log": (r.stderr or r.stdout or "").strip().splitlines()[-20:]}
    runs.save(record)
    raise ClusterError(f"run {record['run_id']}: {what} failed on {', '.join(bad)}: "
                       f"{(r.error or r.stderr or r.stdout).strip()[-400:]}",
                       f"the other nodes were stopped; see `clusterctl status {record['run_id']}`")


def _ports(group: Group, spec: JobSpec, hosts: list[Host]) -> dict[str, int]:
    """The spec's port, or one free right now: on the first node (torchrun) or on every node (TF)."""
    if spec["port"]:
        return {h.name: spec["port"] for h in hosts}
    targets = hosts[:1] if spec.framework == "pytorch" else hosts
    results = group.run(lambda h: render.agent_command(h, "freeport"), timeout=30, hosts=targets)
    require(results, "finding a free port")
    return {n: json.loads(r.stdout)["port"] for n, r in results.items()}


def _record(inv: Inventory, spec: JobSpec, plan: render.LaunchPlan, state: str) -> dict[str, Any]:
    names = {n.node for n in plan.nodes}
    return {
        "run_id": plan.run_id, "job": spec.name, "framework": spec.framework, "state": state,
        "created": time.time(), "started": None, "ended": None, "clusterctl": __version__,
        "settings": spec.settings, "spec_file": str(spec.path), "world_size": plan.world_size,
        "endpoint": plan.endpoint, "data_file": plan.data_file,
        "inventory": {"path": str(inv.path), "name": inv.name,
                      "hosts": [h.to_dict() for h in inv.hosts.values() if h.name in names]},
        "nodes": [{"node": n.node, "node_rank": n.node_rank, "nproc": n.nproc, "run_dir": n.run_dir,
                   "pids": None} for n in plan.nodes],
        "failure": None, "last_status": None,
    }


def _keep_rendered(plan: render.LaunchPlan) -> None:
    """The exact files each node got, kept on the head with the record."""
    base = runs.run_path(plan.run_id) / "rendered"
    for n in plan.nodes:
        d = base / n.node
        d.mkdir(parents=True, exist_ok=True)
        for name, content in n.files.items():
            (d / name).write_text(content)


# --------------------------------------------------------------------------- lifecycle


def poll(record: dict[str, Any], group: Group | None = None, lines: int = 20) -> dict[str, NodeStatus]:
    """Every node's state, read by its agent (one command per node)."""
    dirs = {n["node"]: n["run_dir"] for n in record["nodes"]}
    hosts = runs.hosts(record)

    def ask(g: Group) -> dict[str, NodeStatus]:
        res = g.run(lambda h: render.agent_command(h, "status", dirs[h.name], str(lines)), timeout=60)
        out = {}
        for h in hosts:
            r = res[h.name]
            try:
                out[h.name] = NodeStatus.from_agent(h.name, json.loads(r.stdout.strip().splitlines()[-1]))
            except (ValueError, IndexError):
                out[h.name] = NodeStatus(h.name, "unreachable" if r.status == "unreachable" else "missing",
                                         error=r.error or (r.stderr or "").strip()[-300:] or "no answer")
        return out

    if group is not None:
        return ask(group)
    with Group(hosts) as g:
        return ask(g)


def judge(record: dict[str, Any], statuses: dict[str, NodeStatus], now: float | None = None) -> str:
    """The run's state from its nodes': any failure fails it, all succeeded succeeds it."""
    now = time.time() if now is None else now
    states = {n: s.state for n, s in statuses.items()}
    failed = [s for s in statuses.values() if s.state in FAILED_STATES]
    silent = record.setdefault("_silent_since", {})
    for n, s in statuses.items():
        if s.state == "unreachable":
            silent.setdefault(n, now)
        else:
            silent.pop(n, None)
    lost = [n for n, t in silent.items() if now - t >= UNREACHABLE_GRACE_S]
    if failed or lost:
        if record.get("failure") is None:
            first = min(failed, key=lambda s: s.ended or now) if failed else statuses[lost[0]]
            reason = (f"exit code {first.exit_code}" if first.state == "failed" else
                      f"unreachable for {UNREACHABLE_GRACE_S:.0f} s" if first.state == "unreachable" else
                      "its processes are gone without an exit record" if first.state == "vanished" else
                      first.error or first.state)
            record["failure"] = {"node": first.node, "reason": reason, "log": first.log[-20:],
                                 "also": sorted({s.node for s in failed if s is not first} | set(lost) - {first.node})}
        return "failed"
    if all(v == "succeeded" for v in states.values()):
        return "succeeded"
    if any(v == "stopped" for v in states.values()) and not any(v in ("running", "stopping") for v in states.values()):
        return "stopped"
    return "running"


def _settle(record: dict[str, Any], statuses: dict[str, NodeStatus]) -> dict[str, Any]:
    """Apply the verdict: a failed run's other nodes are stopped, a final state is recorded once."""
    state = judge(record, statuses)
    if state == "failed" and any(s.state in ("running", "stopping") for s in statuses.values()):
        record["stop_results"] = stop_nodes(record)
        statuses = poll(record)  # what the table shows: the others stopped, not still running
    if state in runs.FINAL and record.get("ended") is None:
        record["ended"] = time.time()
    record["state"] = state
    record["last_status"] = {n: s.to_dict() for n, s in statuses.items()}
    runs.save(record)
    return record


def refresh(record: dict[str, Any]) -> dict[str, Any]:
    """Ask the nodes, judge, and save: what `clusterctl status` does."""
    if record["state"] not in runs.ACTIVE:
        return record
    return _settle(record, poll(record))


def follow(record: dict[str, Any], interval: float = 2.0,
           on_update: Callable[[dict[str, Any], dict[str, NodeStatus]], None] | None = None) -> dict[str, Any]:
    """Poll until the run ends, stopping the others when a node fails."""
    hosts = runs.hosts(record)
    group = Group(hosts)
    try:
        while True:
            statuses = poll(record, group)
            record = _settle(record, statuses)
            if on_update:
                on_update(record, statuses)
            if record["state"] not in runs.ACTIVE:
                return record
            if any(s.state == "unreachable" for s in statuses.values()):
                group.close()  # the group remembers dead nodes: a fresh one tries them again
                group = Group(hosts)
            time.sleep(interval)
    finally:
        group.close()


def stop_nodes(record: dict[str, Any], grace: float = 10.0) -> dict[str, Any]:
    """SIGTERM, then SIGKILL after `grace`, every process of the run on every node."""
    dirs = {n["node"]: n["run_dir"] for n in record["nodes"]}
    with Group(runs.hosts(record)) as g:
        res = g.run(lambda h: render.agent_command(h, "stop", dirs[h.name], str(grace)), timeout=grace + 60)
    out = {}
    for n, r in res.items():
        try:
            out[n] = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out[n] = {"ok": False, "error": r.error or (r.stderr or "").strip()[-300:] or r.status}
    return out


def stop(record: dict[str, Any], grace: float = 10.0) -> dict[str, Any]:
    """`clusterctl stop`: end the run everywhere and record it stopped (unless it already ended)."""
    results = stop_nodes(record, grace)
    record["stop_results"] = results
    if record["state"] in runs.ACTIVE:
        record["state"], record["ended"] = "stopped", time.time()
        record["stopped_by_user"] = True
    try:
        record["last_status"] = {n: s.to_dict() for n, s in poll(record).items()}
    except ClusterError:
        pass
    runs.save(record)
    return record


def logs(record: dict[str, Any], node: str | None = None, offsets: dict[str, int] | None = None,
         lines: int = 50) -> dict[str, tuple[str, int]]:
    """Each node's log: the last `lines`, or (with offsets) what was written since. node -> (text, new offset)."""
    hosts = [h for h in runs.hosts(record) if node is None or h.name == node]
    if not hosts:
        raise UsageError(f"run {record['run_id']} has no node '{node}'",
                         f"one of: {', '.join(n['node'] for n in record['nodes'])}")
    dirs = {n["node"]: n["run_dir"] for n in record["nodes"]}

    def cmd(h: Host) -> str:
        f = shlex.quote(f"{dirs[h.name]}/node.log")
        if offsets is None:
            return f"wc -c < {f}; tail -n {int(lines)} -- {f}"
        return f"wc -c < {f}; tail -c +{offsets.get(h.name, 0) + 1} -- {f}"

    with Group(hosts) as g:
        res = g.run(cmd, timeout=60)
    out = {}
    for h in hosts:
        r = res[h.name]
        if not r.ok:
            out[h.name] = (f"[{r.status}: {r.error or r.stderr.strip()}]\n", (offsets or {}).get(h.name, 0))
            continue
        size, _, text = r.stdout.partition("\n")
        if offsets is not None:
            text = text.encode()[: max(0, int(size) - offsets.get(h.name, 0))].decode("utf-8", "replace")
        out[h.name] = (text, int(size))
    return out
