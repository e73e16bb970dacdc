"""`clusterctl launch` and the run lifecycle: preflight -> stage -> render -> upload -> start -> follow.

Every node is started by the node agent (cluster/workloads/nodeagent.py) in a
session of its own, so a run outlives the SSH connection that started it. The
head only polls: one agent `status` per node per poll. A node that fails or
vanishes fails the run, and the others are stopped instead of being left
hanging in a collective; everything written so far stays on the nodes.

Who judges a run: whichever clusterctl process polls it (the foreground
`launch`, `status`, the busy check of another launch) and, so that a run left
alone overnight still gets its verdict, a watcher process on the head started
by launch (cluster/watch.py). They all write through runs.update, under the
run's lock, and the silence clock lives in the record, so they agree.
Independently of the head, the training programs' collective timeouts
(`collective_timeout_s`) end the survivors of a dead peer by themselves.
"""
from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from cluster import __version__, datasets, errors, provision, render, runs
from cluster.errors import ClusterError, UsageError
from cluster.fanout import Group
from cluster.inventory import Host, Inventory
from cluster.jobs import JobError, JobSpec
from cluster.replies import agent_reply, error_tail

PROGRAM_FILES = ("wlcommon.py", "wldata.py", "wlmetrics.py")
DEFAULT_PORTS = {"pytorch": 29400, "tensorflow": 23456}
# A node silent this long (since it last answered) fails the run: long enough for an old PC's sshd
# under training load, short enough that the survivors are stopped within a minute (docs/reliability.md).
UNREACHABLE_GRACE_S = 30.0
POLL_TIMEOUT_S = 20.0  # one agent `status` call
FAILED_STATES = ("failed", "vanished", "missing")  # as the node's agent reports them: final at once
SILENT_STATES = ("unreachable", "unanswered")  # no (readable) answer: failed only after the grace


AGENT_STATES = ("not started", "running", "stopping", "succeeded", "failed", "stopped", "vanished", "missing")


def _obj(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _num(x: Any, kind: type = float) -> Any:
    """x when it is a number (a whole one for kind=int), else None: agent replies are data from a node."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or (kind is int and not isinstance(x, int)):
        return None
    return x


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
        """The agent's JSON, read defensively: a field of the wrong type is dropped, an unknown state is
        `unanswered` (the grace applies), never an exception."""
        state = doc.get("state")
        if state not in AGENT_STATES:
            return cls(node, "unanswered", error=f"unreadable agent reply (state {str(state)[:40]!r})")
        log = doc.get("log")
        exit_doc, metrics = _obj(doc.get("exit")), _obj(doc.get("metrics"))
        s = cls(node, state, error=doc.get("error") if isinstance(doc.get("error"), str) else None,
                log=[x for x in log if isinstance(x, str)] if isinstance(log, list) else [],
                processes=len(doc["processes"]) if isinstance(doc.get("processes"), list) else 0,
                exit_code=_num(exit_doc.get("code"), int), ended=_num(exit_doc.get("ended")))
        ranks = {int(k): _obj(v) for k, v in metrics.items() if isinstance(k, str) and k.isascii() and k.isdecimal()}
        s.ranks = len(ranks)
        if ranks:
            recs = ranks[min(ranks)]  # the node's lowest rank speaks for it
            last, end = _obj(recs.get("step")), _obj(recs.get("end"))
            s.world = _num(_obj(recs.get("start")).get("world"), int)
            s.epoch, s.step = _num(last.get("epoch"), int), _num(end.get("step", last.get("step")), int)
            s.loss, s.images_per_s = _num(last.get("loss")), _num(last.get("images_per_s"))
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
    if not chosen and limit:
        raise UsageError(f"job {spec.name}: --limit {limit!r} leaves none of the job's nodes (nodes={nodes!r})",
                         "name hosts or groups that the job's `nodes:` includes")
    if not chosen:
        raise UsageError(f"job {spec.name}: nodes={nodes!r} selects no host of the inventory",
                         "set the job's `nodes:` to all, a group or host names of the inventory")
    clash = sorted(h.name for h in chosen if h.name in runs.RUN_FOLDER_ENTRIES)
    if clash:  # each node's results go to runs/<id>/<node>/ beside these
        raise UsageError(f"host name {clash[0]!r} is the name of a file clusterctl keeps in each run folder",
                         f"rename the host in the inventory (reserved: {', '.join(sorted(runs.RUN_FOLDER_ENTRIES))})")
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
                            or "check the nodes with `clusterctl check`", exit_code=errors.EXIT_UNREACHABLE)
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
    """Refuse to start on nodes another run still uses (after asking the nodes, not trusting the record),
    or where an earlier stop could not be confirmed. Called under runs.launch_lock()."""
    mine = {(h.address, h.port): h.name for h in hosts}  # the same machines, whatever they are called
    records, damaged = runs.scan()
    if damaged:
        raise LaunchRefused(f"cannot tell whether the nodes are free: {damaged[0].message}", damaged[0].fix)
    for rec in records:
        if not rec.active and not rec.stop_pending:
            continue
        shared = {mine[(h.address, h.port)] for h in rec.hosts() if (h.address, h.port) in mine}
        if not shared:
            continue
        rec = refresh(rec)
        pending = shared & set(rec.stop_pending)
        if rec.active:
            raise LaunchRefused(f"run {rec.run_id} is still {rec.state} on {', '.join(sorted(shared))}",
                                f"wait for it, or stop it: clusterctl stop {rec.run_id}")
        if pending:
            raise LaunchRefused(f"run {rec.run_id} could not be stopped on {', '.join(sorted(pending))} "
                                "(unreachable): its processes may still be running there",
                                f"bring the node back and run `clusterctl stop {rec.run_id}`",
                                exit_code=errors.EXIT_UNREACHABLE)


# --------------------------------------------------------------------------- launch


def _agent_source() -> str:
    return resources.files("cluster.workloads").joinpath("nodeagent.py").read_text()


def program_files(entry: str) -> dict[str, str]:
    """The training program a node runs: its entry point and the modules it imports."""
    wl = resources.files("cluster.workloads")
    return {n: wl.joinpath(n).read_text() for n in (entry, *PROGRAM_FILES)}


def secret_values(spec: JobSpec) -> dict[str, str]:
    """`env_from`: each secret read on the head, from a file or the head's environment, at launch time."""
    out = {}
    for name, src in sorted(spec["env_from"].items()):
        field_ = f"env_from.{name}"
        if "file" in src:
            path = Path(str(src["file"])).expanduser()
            try:
                out[name] = path.read_text().rstrip("\n")
            except (OSError, UnicodeDecodeError) as e:
                raise JobError(str(spec.path), None, field_, f"cannot read {path}: {getattr(e, 'strerror', e)}",
                               "point `file:` at a readable text file on the head") from None
        else:
            if src["env"] not in os.environ:
                raise JobError(str(spec.path), None, field_, f"the head's environment has no {src['env']}",
                               f"export {src['env']}=... before `clusterctl launch`")
            out[name] = os.environ[src["env"]]
    return out


def secrets_file(values: dict[str, str]) -> str:
    """The node's secrets.env (mode 0600), sourced by launch.sh: every value shell-quoted."""
    lines = ["# Secrets of this run (env_from), readable by its owner only. Never copied back by collect."]
    for k, v in values.items():
        lines += [f"{k}={shlex.quote(v)}", f"export {k}"]
    return "\n".join(lines) + "\n"


def dry_run(inv: Inventory, spec: JobSpec, limit: str | None = None, forks: int = 32) -> tuple[runs.RunRecord, render.LaunchPlan]:
    """What launch would do: the verified nodes and each node's rendered files, nothing started."""
    hosts = select_hosts(inv, spec, limit)
    run_id = runs.new_run_id(spec.name)
    with Group(hosts, forks=forks) as group:
        targets = preflight(group, hosts)
    port = spec["port"] or DEFAULT_PORTS[spec.framework]
    plan = render.render(spec, [targets[h.name] for h in hosts], run_id, datasets.file_name(spec),
                         {h.name: port for h in hosts})
    return _record(inv, spec, plan, "dry-run"), plan


def _reserve(inv: Inventory, spec: JobSpec, hosts: list[Host], targets: dict[str, render.Target],
             run_id: str, prediction: dict[str, Any] | None) -> runs.RunRecord:
    """The busy check and the new record in one step under the launch lock: two launches on the same
    nodes cannot both pass. The record says which process is starting it (see refresh)."""
    plan = render.LaunchPlan(run_id, spec, 0, None, datasets.file_name(spec), [
        render.NodeLaunch(h.name, i, render.procs_per_node(spec, targets[h.name]), render.run_dir(h, run_id), {}, "")
        for i, h in enumerate(hosts)])
    with runs.launch_lock():
        _busy(hosts)
        record = _record(inv, spec, plan, "starting")
        record.prediction = prediction
        record.extra["launcher"] = {"pid": os.getpid(), "started": time.time()}
        record.secrets = sorted(spec["env_from"])
        runs.save(record)
    return record


def launch(inv: Inventory, spec: JobSpec, limit: str | None = None, forks: int = 32,
           log: Callable[[str], None] = lambda s: None, prediction: dict[str, Any] | None = None,
           watch: bool = True) -> tuple[runs.RunRecord, render.LaunchPlan]:
    """Start the job on its nodes; returns the run record (saved) and the rendered plan.
    `prediction`: the `clusterctl plan` candidate this run applies, kept in the record for the report.
    `watch`: start the head-side watcher that judges the run when no clusterctl command is running."""
    hosts = select_hosts(inv, spec, limit)
    run_id = runs.new_run_id(spec.name)
    secret = secret_values(spec)
    with Group(hosts, forks=forks) as group:
        log(f"checking {len(hosts)} nodes are provisioned and identical")
        targets = preflight(group, hosts)
        record = _reserve(inv, spec, hosts, targets, run_id, prediction)
        try:
            return _start(group, record, spec, hosts, targets, secret, log, watch)
        except BaseException as e:
            if runs.load(run_id).state == "starting":
                _fail_start(record, f"launch interrupted: {e}" if str(e) else f"launch interrupted ({type(e).__name__})")
            raise


def _start(group: Group, record: runs.RunRecord, spec: JobSpec, hosts: list[Host],
           targets: dict[str, render.Target], secret: dict[str, str], log: Callable[[str], None],
           watch: bool) -> tuple[runs.RunRecord, render.LaunchPlan]:
    prepared = datasets.prepare(spec, log)
    agent = _agent_source()
    log(f"staging {prepared.file_name} ({prepared.size / 2**20:.1f} MiB) and the node agent")

    def stage(t: Any) -> Any:
        t.run(f"mkdir -p -- {shlex.quote(t.host.workdir + '/clusterctl')}", timeout=60)
        t.put_bytes(agent.encode(), f"{t.host.workdir}/{render.AGENT}")

    require(group.call(stage, hosts), "staging", record)
    require(datasets.stage_all(group, hosts, prepared, log=log), "staging", record)  # relayed: sent once
    ports = _ports(group, spec, hosts, record)
    plan = render.render(spec, [targets[h.name] for h in hosts], record.run_id, prepared.file_name, ports)
    _keep_rendered(plan)
    full = _record(record.inventory, spec, plan, "starting")

    def planned(r: runs.RunRecord) -> None:
        r.world_size, r.endpoint, r.data_file, r.nodes = full.world_size, full.endpoint, full.data_file, full.nodes

    record = runs.update(record.run_id, planned)
    program = {f"program/{n}": text for n, text in program_files(spec.entry).items()}
    by_node = {n.node: n for n in plan.nodes}
    private = {"secrets.env": secrets_file(secret)} if secret else {}

    def upload(t: Any) -> None:
        n = by_node[t.host.name]
        # NOTE: the run folder and its files are the owner's only: job settings may hold tokens.
        t.run(f"mkdir -p -m 700 -- {shlex.quote(n.run_dir)} && mkdir -p -- {shlex.quote(n.run_dir + '/program')} "
              f"{shlex.quote(n.run_dir + '/out')}", timeout=60)
        for name, content in {**n.files, **program, **private}.items():
            t.put_bytes(content.encode(), f"{n.run_dir}/{name}", 0o700 if name.endswith(".sh") else 0o600)

    uploaded = group.call(upload, hosts)
    if not uploaded.ok:
        _fail_start(record, *_first_error(uploaded, "upload"))
    log(f"starting {len(hosts)} nodes")
    started = group.run(lambda h: by_node[h.name].start_command, timeout=60, hosts=hosts)
    pids = {n: agent_reply(r.stdout) for n, r in started.items() if r.ok}
    if not started.ok:
        stop_nodes(record)
        _fail_start(record, *_first_error(started, "start"))

    def running(r: runs.RunRecord) -> None:
        for n in r.nodes:
            n.pids = pids.get(n.node)
        r.state, r.started = "running", time.time()
        r.extra.pop("launcher", None)

    record = runs.update(record.run_id, running)
    if watch:
        from cluster import watch as watch_mod  # the watcher imports this module

        watch_mod.spawn(record.run_id)
    return record, plan


def require(results: Any, what: str, record: runs.RunRecord | None = None) -> None:
    """Raise, naming every node where `what` failed (and fail the run being started, if any)."""
    bad = {n: r for n, r in results.items() if not r.ok}
    if not bad:
        return
    message = f"{what} failed on " + "; ".join(f"{n}: {r.error or error_tail(r.stderr)}" for n, r in bad.items())
    if record is not None:
        _fail_start(record, message, next(iter(bad)))
    raise ClusterError(message, "fix the node shown (disk space, permissions) and launch again")


def _first_error(results: Any, what: str) -> tuple[str, str]:
    """(a message naming every node where `what` failed, the first of them)."""
    bad = {n: r for n, r in results.items() if not r.ok}
    n, r = next(iter(bad.items()))
    detail = r.error or error_tail(r.stderr or r.stdout, 400) or f"exit {r.exit_code}"
    return f"{what} failed on {', '.join(bad)}: {detail}", n


def _fail_start(record: runs.RunRecord, reason: str, node: str | None = None) -> None:
    """The run could not start: recorded failed (nothing was started, or what was is stopped)."""
    node = node or record.nodes[0].node

    def failed(r: runs.RunRecord) -> None:
        r.state, r.ended = "failed", time.time()
        r.failure = r.failure or runs.Failure(node, reason)
        r.extra.pop("launcher", None)

    runs.update(record.run_id, failed)
    raise ClusterError(f"run {record.run_id}: {reason}",
                       f"nothing of it is left running; see `clusterctl status {record.run_id}`")


def _ports(group: Group, spec: JobSpec, hosts: list[Host], record: runs.RunRecord) -> dict[str, int]:
    """The spec's port, or one free right now: on the first node (torchrun) or on every node (TF)."""
    if spec["port"]:
        return {h.name: spec["port"] for h in hosts}
    targets = hosts[:1] if spec.framework == "pytorch" else hosts
    results = group.run(lambda h: render.agent_command(h, "freeport"), timeout=30, hosts=targets)
    require(results, "finding a free port", record)
    ports = {n: (agent_reply(r.stdout) or {}).get("port") for n, r in results.items()}
    bad = [n for n, p in ports.items() if not isinstance(p, int)]
    if bad:
        _fail_start(record, f"finding a free port failed on {', '.join(bad)}: unreadable agent reply", bad[0])
    return {n: int(p) for n, p in ports.items() if p is not None}


def _record(inventory: Inventory | dict[str, Any], spec: JobSpec, plan: render.LaunchPlan,
            state: str) -> runs.RunRecord:
    names = [n.node for n in plan.nodes]
    if isinstance(inventory, Inventory):
        inventory = {"path": str(inventory.path), "name": inventory.name,
                     "hosts": [h.to_dict() for h in inventory.hosts.values() if h.name in names]}
    return runs.RunRecord(
        run_id=plan.run_id, job=spec.name, framework=spec.framework, state=state, created=time.time(),
        clusterctl=__version__, settings=spec.settings, spec_file=str(spec.path), world_size=plan.world_size,
        endpoint=plan.endpoint, data_file=plan.data_file, inventory=inventory,
        nodes=[runs.RunNode(n.node, n.node_rank, n.nproc, n.run_dir) for n in plan.nodes])


def _keep_rendered(plan: render.LaunchPlan) -> None:
    """The exact files each node got, kept on the head with the record."""
    base = runs.run_path(plan.run_id) / "rendered"
    for n in plan.nodes:
        d = base / n.node
        d.mkdir(parents=True, exist_ok=True)
        for name, content in n.files.items():
            (d / name).write_text(content)
            os.chmod(d / name, 0o600)


# --------------------------------------------------------------------------- lifecycle


def poll(record: runs.RunRecord, group: Group | None = None, lines: int = 20) -> dict[str, NodeStatus]:
    """Every node's state, read by its agent (one bounded command per node).

    A node that cannot be reached is `unreachable`; one whose agent does not answer in time or answers
    something unreadable is `unanswered`: both get a grace time before they fail the run (see judge)."""
    dirs = record.node_dirs()
    hosts = record.hosts()

    def ask(g: Group) -> dict[str, NodeStatus]:
        res = g.run(lambda h: render.agent_command(h, "status", dirs[h.name], str(lines)), timeout=POLL_TIMEOUT_S)
        out = {}
        for h in hosts:
            r = res[h.name]
            doc = agent_reply(r.stdout)
            if doc is not None and isinstance(doc.get("state"), str):
                out[h.name] = NodeStatus.from_agent(h.name, doc)
            else:
                out[h.name] = NodeStatus(h.name, "unreachable" if r.status == "unreachable" else "unanswered",
                                         error=r.error or error_tail(r.stderr) or "no answer")
        return out

    if group is not None:
        return ask(group)
    with Group(hosts) as g:
        return ask(g)


def judge(record: runs.RunRecord, statuses: dict[str, NodeStatus], now: float | None = None) -> str:
    """The run's state from its nodes': any failure fails it, all succeeded succeeds it.

    A node silent (unreachable or unanswered) for UNREACHABLE_GRACE_S since it last answered fails the
    run; the clock is kept in the record, so it runs across `status` calls and processes."""
    now = time.time() if now is None else now
    start = record.started or record.created
    for n, s in statuses.items():
        if s.state not in SILENT_STATES:
            record.last_seen[n] = now
    failed = [s for s in statuses.values() if s.state in FAILED_STATES]
    lost = sorted(n for n, s in statuses.items()
                  if s.state in SILENT_STATES and now - record.last_seen.get(n, start) >= UNREACHABLE_GRACE_S)
    if failed or lost:
        if record.failure is None:
            first = min(failed, key=lambda s: s.ended or now) if failed else statuses[lost[0]]
            silent_for = now - record.last_seen.get(first.node, start)
            reason = (f"exit code {first.exit_code}" if first.state == "failed" else
                      f"{first.state} for {silent_for:.0f} s ({first.error})" if first.state in SILENT_STATES else
                      "its processes are gone without an exit record" if first.state == "vanished" else
                      first.error or first.state)
            known = (record.last_status or {}).get(first.node) or {}
            record.failure = runs.Failure(first.node, reason, (first.log or known.get("log") or [])[-20:],
                                          sorted(({s.node for s in failed} | set(lost)) - {first.node}))
        return "failed"
    states = {s.state for s in statuses.values()}
    if states == {"succeeded"}:
        return "succeeded"
    if "stopped" in states and not states & {"running", "stopping"}:
        return "stopped"
    return "running"


def _remember(record: runs.RunRecord, statuses: dict[str, NodeStatus]) -> None:
    """Keep each node's last status; a silent node keeps its last known log and metrics (the morning after,
    they are all that is left of a node that went away)."""
    before = record.last_status or {}
    now: dict[str, dict[str, Any]] = {}
    for n, s in statuses.items():
        d = s.to_dict()
        if s.state in SILENT_STATES and n in before:
            d = {**before[n], "state": s.state, "error": s.error}
        now[n] = d
    record.last_status = now


def _apply(record: runs.RunRecord, statuses: dict[str, NodeStatus]) -> None:
    """The verdict, written into the newest copy of the record (inside runs.update)."""
    if not record.active or record.stopped_by_user:
        _remember(record, statuses)
        return
    state = judge(record, statuses)
    _remember(record, statuses)
    if state in runs.FINAL and record.ended is None:
        record.ended = time.time()
    record.state = state
    if state == "failed":  # to be stopped; each node leaves this list once its agent confirms
        record.stop_pending = sorted(set(record.stop_pending) | {
            n for n, s in statuses.items() if s.state in ("running", "stopping", *SILENT_STATES)})


def settle(record: runs.RunRecord, statuses: dict[str, NodeStatus]) -> runs.RunRecord:
    """Apply the verdict; a failed run's other nodes are stopped and what could not be confirmed is kept
    in `stop_pending` (the next launch on those nodes tries again, and refuses while it cannot)."""
    record = runs.update(record.run_id, lambda r: _apply(r, statuses))
    if record.state == "failed" and record.stop_pending and not record.stopped_by_user:
        record = _stop_and_record(record, list(record.stop_pending))
    return record


def _stop_and_record(record: runs.RunRecord, nodes: list[str], grace: float = 10.0) -> runs.RunRecord:
    results = stop_nodes(record, grace, only=nodes)
    confirmed = {n for n, r in results.items() if r.get("ok")}
    statuses = poll(record) if confirmed else {}

    def change(r: runs.RunRecord) -> None:
        r.stop_results = {**(r.stop_results or {}), **results}
        r.stop_pending = sorted((set(r.stop_pending) | set(nodes)) - confirmed)
        if statuses:  # what the table shows: the confirmed nodes stopped, the others as last known
            r.last_status = {**(r.last_status or {}),
                             **{n: statuses[n].to_dict() for n in confirmed if n in statuses}}
        if r.stopped_by_user and r.state in runs.ACTIVE and not r.stop_pending:
            r.state = "stopped"
            r.ended = r.ended or time.time()

    return runs.update(record.run_id, change)


def _launcher_alive(record: runs.RunRecord) -> bool:
    """Is the clusterctl process that is starting this run still at work (on this head)?"""
    pid = (record.extra.get("launcher") or {}).get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def refresh(record: runs.RunRecord) -> runs.RunRecord:
    """Ask the nodes, judge, and save: what `clusterctl status` does. Also retries a stop that could not
    be confirmed on some node."""
    if record.state == "starting" and _launcher_alive(record):
        return record  # its launcher is still uploading; judging now would see no processes yet
    if record.active and not record.stopped_by_user:
        return settle(record, poll(record))  # a failure found now is stopped there
    if record.stop_pending:
        record = _stop_and_record(record, list(record.stop_pending))
    return record


def follow(record: runs.RunRecord, interval: float = 2.0,
           on_update: Callable[[runs.RunRecord, dict[str, NodeStatus]], None] | None = None) -> runs.RunRecord:
    """Poll until the run ends, stopping the others when a node fails."""
    hosts = record.hosts()
    group = Group(hosts)
    try:
        while True:
            statuses = poll(record, group)
            record = settle(record, statuses)
            if on_update:
                on_update(record, statuses)
            if not record.active:
                return record
            if any(s.state in SILENT_STATES for s in statuses.values()):
                group.close()  # the group remembers dead nodes: a fresh one tries them again
                group = Group(hosts)
            time.sleep(interval)
    finally:
        group.close()


def stop_nodes(record: runs.RunRecord, grace: float = 10.0, only: list[str] | None = None) -> dict[str, Any]:
    """SIGTERM, then SIGKILL after `grace`, every process of the run on every node (or `only` these).
    A node's result is ok only when its agent confirmed that nothing of the run is left."""
    dirs = record.node_dirs()
    hosts = [h for h in record.hosts() if only is None or h.name in only]
    with Group(hosts) as g:
        res = g.run(lambda h: render.agent_command(h, "stop", dirs[h.name], str(grace)), timeout=grace + 30)
    out = {}
    for n, r in res.items():
        doc = agent_reply(r.stdout)
        out[n] = doc if doc is not None else {"ok": False, "error": r.error or error_tail(r.stderr)
                                                                   or r.status, "status": r.status}
    return out


def stop(record: runs.RunRecord, grace: float = 10.0) -> runs.RunRecord:
    """`clusterctl stop`: end the run everywhere. The run is recorded `stopped` only once every node
    confirmed it; until then it stays `stopping`, with the nodes to retry in `stop_pending`."""

    def mark(r: runs.RunRecord) -> None:
        if r.state in runs.ACTIVE:
            r.state, r.stopped_by_user = "stopping", True

    record = runs.update(record.run_id, mark)
    return _stop_and_record(record, list(record.node_dirs()), grace)


def logs(record: runs.RunRecord, node: str | None = None, offsets: dict[str, int] | None = None,
         lines: int = 50) -> dict[str, tuple[str, int]]:
    """Each node's log: the last `lines`, or (with offsets) what was written since. node -> (text, new offset)."""
    hosts = [h for h in record.hosts() if node is None or h.name == node]
    if not hosts:
        raise UsageError(f"run {record.run_id} has no node '{node}'",
                         f"one of: {', '.join(record.node_dirs())}")
    dirs = record.node_dirs()

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
