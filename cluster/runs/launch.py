"""`clusterctl launch`: prepare the request (preflight -> render), then execute it (stage -> upload -> start).

torchx's shape: `prepare` returns the LaunchRequest that `launch --dry-run` prints (every node's files
and start command, nothing changed), and `execute` starts exactly that request. Every node is started
by the node agent (cluster/agent/nodeagent.py) in a session of its own, so a run outlives the SSH
connection that started it. What happens after the start (poll, judge, settle, refresh, follow, stop,
logs) is cluster/runs/state.py.
"""
from __future__ import annotations

import os
import posixpath
import shlex
import time
from typing import Any, Callable, NoReturn

from cluster import __version__, errors, paths
from cluster.runs import (carryover, code, datasets, elastic, firewall, layers, payload, preflight, records as runs,
                          render)
from cluster.errors import ClusterError
from cluster.nodes.fanout import Group, GroupResult
from cluster.inventory.model import Inventory
from cluster.runs.jobs import JobSpec
from cluster.runs.schema import JobError
from cluster.runs.render import LaunchRequest
from cluster.nodes.replies import agent_reply, error_tail
from cluster.runs.state import stop_and_record
from cluster.transport import Transport


START_TIMEOUT_S = 30.0  # the node agent's `start` forks and answers in well under a second
DEFAULT_PORTS = {"torchrun": 29400, "tensorflow": 23456, "plain": 29500}  # per launcher
Log = Callable[[str], None]


# --------------------------------------------------------------------------- the request


def prepare(inv: Inventory, spec: JobSpec, limit: str | None = None, forks: int = 32,
            log: Log = lambda s: None, run_id: str | None = None, unchecked: bool = False) -> LaunchRequest:
    """What `launch` would start: the job's nodes, checked provisioned and identical (read-only, over SSH),
    and every node's rendered files. Nothing is changed on the nodes or the head. `run_id`: a run already
    recorded (a queued one, started once its scheduler gave it PCs). `unchecked`: the nodes are not contacted
    (PCs a room's Slurm switched off): rendered as the inventory says, checked when the run starts on them."""
    payload.secret_values(spec)  # every env_from source readable now (values dropped), so --dry-run checks them too
    carryover.continued(spec)  # a run it continues: ended, here, the same job (--dry-run checks it too)
    hosts = preflight.select_hosts(inv, spec, limit)
    if spec["min_nodes"] > len(hosts):
        raise JobError(str(spec.path), None, "min_nodes", f"min_nodes is {spec['min_nodes']}, but the job has "
                       f"{len(hosts)} nodes ({', '.join(h.name for h in hosts)})",
                       f"set min_nodes to at most {len(hosts)} (0: all of them)")
    tree = payload.program_tree(spec)  # a user's code refused here (too large, links out), before any node
    data = payload.data_tree(spec) if spec.own and spec["data"] is not None else None  # and its data, the same way
    if unchecked:
        request = request_for(inv, spec, [render.Target(h) for h in hosts], run_id or runs.new_run_id(spec.name))
        request.code, request.data = tree, data
        return request
    log(f"checking {len(hosts)} nodes are provisioned and identical")
    left_out: dict[str, str] = {}
    with Group(hosts, forks=forks) as group:
        targets = preflight.check(group, hosts, spec, left_out,
                                   embedded=inv.path.resolve() == paths.LOCAL_INVENTORY.resolve())
        hosts = [h for h in hosts if h.name in targets]
        if left_out:
            log(f"starting on {len(hosts)} nodes without {', '.join(left_out)} (min_nodes {spec['min_nodes']})")
        layer = None
        if spec.own and spec["requirements"]:  # resolved on the head for the nodes' Python, over their base
            log("resolving the job's requirements on the head")
            layer = layers.resolve(spec, *layers.base_environment(group, hosts[0]), log=log)
    request = request_for(inv, spec, [targets[h.name] for h in hosts], run_id or runs.new_run_id(spec.name),
                          layer=layer)
    request.code, request.data = tree, data
    request.left_out = left_out
    return request


def request_for(inv: Inventory, spec: JobSpec, targets: list[render.Target], run_id: str,
                data_file: str | None = None, layer: layers.Layer | None = None) -> LaunchRequest:
    """The request for these verified nodes (no I/O but naming the dataset file: the golden tests' entry).
    Without the job's `port:`, the files show the framework's default port and the run gets one free at
    its start."""
    port = spec["port"]
    ports = {t.host.name: port or DEFAULT_PORTS[spec.launcher] for t in targets}
    data = "" if spec.own else data_file or datasets.file_name(spec)  # a user program brings its own data
    request = render.render(spec, targets, run_id, data, ports, payload.layer_dir(layer))
    request.layer = layer
    request.port_picked_at_start = not port
    names = {t.host.name for t in targets}
    request.inventory = {"path": str(inv.path), "name": inv.name,
                         "hosts": [h.to_dict() for h in inv.hosts.values() if h.name in names]}
    return request


def execute(request: LaunchRequest, log: Log = lambda s: None, prediction: dict[str, Any] | None = None,
            watch: bool = True, forks: int = 32) -> runs.RunRecord:
    """Start the request on its nodes; returns the run record (saved, `running`).
    `prediction`: the `clusterctl plan` candidate this run applies, kept in the record for the report.
    `watch`: start the head-side watcher that judges the run when no clusterctl command is running.

    Until the record says `running`, the start can be called off: by `clusterctl stop` (seen between
    steps), by Ctrl-C or by a failed step. Either way what was started is stopped and the record says
    which nodes confirmed it (StartAborted)."""
    secret = payload.secret_values(request.job)  # read at the start, never kept in the request or the record
    hosts = [t.host for t in request.targets]
    with Group(hosts, forks=forks) as group:
        record = _reserve(request, prediction, watch)
        try:
            record = _start(group, record, request, secret, log)
        except StartAborted:
            raise
        except BaseException as e:
            now = runs.load(record.run_id)
            if now.state == "starting":
                what = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
                _abort_start(record, f"launch {what}: {e}" if str(e) else f"launch {what} ({type(e).__name__})",
                             cause=what)
            if now.state == "running" and watch:  # Ctrl-C just after the start: the run goes on, watched
                from cluster.runs import watch as watch_mod

                watch_mod.spawn(record.run_id)
            raise
    if watch:
        from cluster.runs import watch as watch_mod  # started as its own process; imported only when wanted

        watch_mod.spawn(record.run_id)
    return record


def launch(inv: Inventory, spec: JobSpec, limit: str | None = None, forks: int = 32, log: Log = lambda s: None,
           prediction: dict[str, Any] | None = None, watch: bool = True) -> tuple[runs.RunRecord, LaunchRequest]:
    """prepare + execute in one call (the job's secrets are read first, before any node is contacted)."""
    request = prepare(inv, spec, limit, forks, log)
    return execute(request, log, prediction, watch, forks), request


def _reserve(request: LaunchRequest, prediction: dict[str, Any] | None, watch: bool) -> runs.RunRecord:
    """The busy check and the new record in one step under the launch lock: two launches on the same
    nodes cannot both pass. The record says which process is starting it (see runstate.refresh)."""
    with runs.launch_lock():
        preflight.refuse_busy([t.host for t in request.targets])
        record = _record(request, "starting")
        record.endpoint = None if request.port_picked_at_start else request.endpoint  # known once picked
        record.prediction = prediction
        record.extra["launcher"] = {"pid": os.getpid(), "started": time.time(), "watch": watch}
        record.secrets = sorted(request.job["env_from"])
        runs.save(record)
    return record


def _start(group: Group, record: runs.RunRecord, request: LaunchRequest, secret: dict[str, str],
           log: Log) -> runs.RunRecord:
    _stage(group, record, request, log)
    _unless_stopped(record)
    if request.port_picked_at_start:  # the only thing that differs from what --dry-run printed
        request = _with_ports(request, _ports(group, request, record))
        record = runs.update(record.run_id, lambda r: setattr(r, "endpoint", request.endpoint))
    _keep_rendered(request)
    _upload(group, record, request, secret, log)
    _carry_over(group, record, request, log)
    _open_firewalls(group, record, request, log)
    _unless_stopped(record)
    log(f"starting {len(request.nodes)} nodes")
    by_node = {n.node: n for n in request.nodes}
    hosts = [t.host for t in request.targets]
    started = group.run(lambda h: by_node[h.name].start_command, timeout=START_TIMEOUT_S, hosts=hosts)
    _unless_stopped(record)  # a stop that came meanwhile wins (the nodes it reached first refused to start)
    if not started.ok:
        lost = sorted(n for n, r in started.items() if not r.ok and r.status == "unreachable"
                      or r.problem == "command-timeout")
        _abort_start(record, *_first_error(started, "start"), lost=lost)
    pids = {n: agent_reply(r.stdout) for n, r in started.items()}

    def running(r: runs.RunRecord) -> None:
        if r.stopped_by_user or not r.move("running"):
            return
        for n in r.nodes:
            n.pids = pids.get(n.node)
        r.started = time.time()
        r.extra.pop("launcher", None)
        r.periods = [elastic.first_period(r, request)]

    record = runs.update(record.run_id, running)
    if record.state != "running":  # the stop came between the last look and this update
        _abort_start(record, "stopped by `clusterctl stop` while it was starting", cause="stopped")
    return record


def _unless_stopped(record: runs.RunRecord) -> None:
    """Between two steps of the start: if `clusterctl stop` came meanwhile, call the start off."""
    if runs.load(record.run_id).stopped_by_user:
        _abort_start(record, "stopped by `clusterctl stop` while it was starting", cause="stopped")


def _stage(group: Group, record: runs.RunRecord, request: LaunchRequest, log: Log) -> None:
    """The node agent and the dataset on every node (the dataset sent once and relayed, verified); a user's
    program gets no dataset (its `code` is shipped by _upload)."""
    agent = payload.agent_files()
    hosts = [t.host for t in request.targets]

    def stage(t: Transport) -> None:
        t.run(f"mkdir -p -- {shlex.quote(t.host.workdir + '/clusterctl')}", timeout=60)
        for name, content in agent.items():
            t.put_bytes(content, f"{t.host.workdir}/{posixpath.dirname(render.AGENT)}/{name}")

    if request.job.own:
        log("staging the node agent")
        require(group.call(stage, hosts), "staging", record)
        return
    prepared = datasets.prepare(request.job, log)
    if prepared.file_name != request.data_file:
        _fail_start(record, f"the dataset changed since the request was made ({request.data_file} is now "
                            f"{prepared.file_name})")
    log(f"staging {prepared.file_name} ({prepared.size / 2**20:.1f} MiB) and the node agent")
    require(group.call(stage, hosts), "staging", record)
    require(datasets.stage_all(group, hosts, prepared, log=log), "staging", record)


def _upload(group: Group, record: runs.RunRecord, request: LaunchRequest, secret: dict[str, str],
            log: Log) -> None:
    """Each node's run folder: its rendered files, the program (a user's code shipped through each node's
    cache: only what it lacks is sent), the secrets (owner-only)."""
    _ship(group, record, request, request.code if request.code is not None else payload.program_tree(request.job),
          "program", log)
    if request.job.own and request.job["data"] is not None:
        _ship(group, record, request, request.data if request.data is not None else payload.data_tree(request.job), "data",
              log)
    if request.layer is not None:
        _install_layer(group, record, request, log)
    by_node = {n.node: n for n in request.nodes}
    private = {"secrets.env": payload.secrets_file(secret)} if secret else {}

    def upload(t: Transport) -> None:
        n = by_node[t.host.name]
        # NOTE: the run folder and its files are the owner's only: job settings may hold tokens.
        t.run(f"mkdir -p -m 700 -- {shlex.quote(n.run_dir)} && mkdir -p -- {shlex.quote(n.run_dir + '/program')} "
              f"{shlex.quote(n.run_dir + '/out')}", timeout=60)
        for name, content in {**n.files, **private}.items():
            t.put_bytes(content.encode(), f"{n.run_dir}/{name}", 0o700 if name.endswith(".sh") else 0o600)

    uploaded = group.call(upload, [t.host for t in request.targets])
    if not uploaded.ok:
        _fail_start(record, *_first_error(uploaded, "upload"))


def _carry_over(group: Group, record: runs.RunRecord, request: LaunchRequest, log: Log) -> None:
    """`launch --continue`: what the continued run left on each node, copied into the new run folders;
    none anywhere fails the start (the program would train from scratch, or not at all)."""
    old = carryover.continued(request.job)
    if old is None:
        return
    copied, bad = carryover.carry_over(group, old, request)
    if bad is not None:
        _fail_start(record, *_first_error(bad, f"copying what run {old.run_id} left"))
    if not copied:
        _fail_start(record, f"no node of this run holds what run {old.run_id} left "
                            f"({', '.join(request.job.carried_over())}): nothing to continue from")
    for n, p in copied.items():
        log(f"{n}: {', '.join(p)} from run {old.run_id}")
    runs.update(record.run_id, lambda r: r.extra.__setitem__("continues", {"run": old.run_id, "copied": copied}))




def _ship(group: Group, record: runs.RunRecord, request: LaunchRequest, tree: code.CodeTree, into: str,
          log: Log) -> None:
    """A tree (the program, or the job's data) into every node's run folder (program/ or data/) through the
    nodes' cache: each sent only what it lacks, verified; recorded per node as bytes sent and files reused."""
    shipped = code.ship(group, [t.host for t in request.targets], tree, {n.node: n.run_dir for n in request.nodes},
                        log=log, into=into)
    what = {"program": "code", "data": "data"}[into]
    if not shipped.ok:
        _fail_start(record, *_first_error(shipped, f"shipping the {what}"))
    sent = {n: r.value for n, r in shipped.items()}
    for n, v in sent.items():
        log(f"{n}: {what} {v.summary()}")
    runs.update(record.run_id, lambda r: r.extra.__setitem__(what, {
        "root": str(tree.root), "digest": tree.digest, "files": len(tree.files), "bytes": tree.total,
        "nodes": {n: {"bytes_sent": v.bytes_sent, "files_sent": v.files_sent, "files_reused": v.files_reused,
                      "via": v.via}
                  for n, v in sent.items()}}))


def _install_layer(group: Group, record: runs.RunRecord, request: LaunchRequest, log: Log) -> None:
    """The job's requirements on every node, offline, where a node does not have them yet."""
    layer: layers.Layer = request.layer
    done = layers.install(group, [t.host for t in request.targets], layer, log)
    if not done.ok:
        _fail_start(record, *_first_error(done, "installing the job's requirements"))
    for n, r in done.items():
        log(f"{n}: requirements " + (f"installed ({r.value['bytes']} bytes of wheels sent by {r.value['via']})"
                                     if r.value["installed"]
                                     else "already installed, nothing sent"))
    runs.update(record.run_id, lambda r: r.extra.__setitem__("requirements", {
        "lock": layer.lock.split(), "digest": layer.digest, "nodes": {n: v.value for n, v in done.items()}}))


def _with_ports(request: LaunchRequest, ports: dict[str, int]) -> LaunchRequest:
    """The same request with the ports picked at the start: rendered from the same inputs."""
    final = render.render(request.job, request.targets, request.run_id, request.data_file, ports,
                          payload.layer_dir(request.layer))
    final.inventory, final.code, final.layer = request.inventory, request.code, request.layer
    return final


def require(results: GroupResult, what: str, record: runs.RunRecord | None = None) -> None:
    """Raise, naming every node where `what` failed (and fail the run being started, if any)."""
    bad = {n: r for n, r in results.items() if not r.ok}
    if not bad:
        return
    message = f"{what} failed on " + "; ".join(f"{n}: {r.error or error_tail(r.stderr)}" for n, r in bad.items())
    if record is not None:
        _fail_start(record, message, next(iter(bad)))
    raise ClusterError(message, "fix the node shown (disk space, permissions) and launch again")


def _open_firewalls(group: Group, record: runs.RunRecord, request: LaunchRequest, log: Log) -> None:
    """A host firewall that would block the run: opened for exactly its nodes where the node has `become`
    (closed by the node agent when the run ends), else the start is refused naming the fix."""
    opened = firewall.open_for(group, [t.host for t in request.targets], request.run_id,
                               {n.node: n.run_dir for n in request.nodes})
    if not opened:
        return
    runs.update(record.run_id, lambda r: r.extra.__setitem__("firewall", opened))
    for n, v in opened.items():
        if "opened" in v:
            log(f"{n}: host firewall opened for the run's nodes ({', '.join(' '.join(c) for c in v['opened'])})")
    refused = {n: v["refused"] for n, v in opened.items() if "refused" in v}
    if refused:
        n = next(iter(refused))
        _fail_start(record, f"{n}: {refused[n]}; set `become: true` for it (launch then opens the firewall for "
                    "the run's nodes and closes it after) or accept the lab network there (`clusterctl check` "
                    "shows the rule)", n)


def _first_error(results: GroupResult, what: str) -> tuple[str, str]:
    """(a message naming every node where `what` failed, the first of them)."""
    bad = {n: r for n, r in results.items() if not r.ok}
    n, r = next(iter(bad.items()))
    detail = r.error or error_tail(r.stderr or r.stdout, 400) or f"exit {r.exit_code}"
    return f"{what} failed on {', '.join(bad)}: {detail}", n


class StartAborted(ClusterError):
    """The start was called off (a failed step, `clusterctl stop`, Ctrl-C); what it started is stopped."""


def _fail_start(record: runs.RunRecord, reason: str, node: str | None = None) -> NoReturn:
    _abort_start(record, reason, node)


def _abort_start(record: runs.RunRecord, reason: str, node: str | None = None, *, cause: str = "failed",
                 lost: list[str] | None = None) -> NoReturn:
    """Call the start off: every node pending until its agent confirms that nothing of the run runs there
    (a node reached first keeps a stop request, so a start still in flight to it is refused), the record
    `failed` (a step failed) or `stopped` (cause `stopped` or `interrupted`: the user's wish). Nodes not
    confirmed stay in `stop_pending`: the watcher, `status` and the next launch retry them.
    `lost`: nodes whose start reply never came (they may be running)."""
    user = cause != "failed"
    watch = (runs.load(record.run_id).extra.get("launcher") or {}).get("watch", True)

    def begin(r: runs.RunRecord) -> None:
        r.extra.pop("launcher", None)
        if user:
            if r.move("stopping"):
                r.stopped_by_user = True
        elif r.move("failed"):
            r.failure = r.failure or runs.Failure(node or r.nodes[0].node, reason)
        r.stop_pending = sorted(set(r.stop_pending) | set(r.node_dirs()))

    record = runs.update(record.run_id, begin)
    try:
        record = stop_and_record(record, list(record.node_dirs()))
    finally:
        if watch and runs.load(record.run_id).stop_pending:
            from cluster.runs import watch as watch_mod

            watch_mod.spawn(record.run_id)  # retries the stop as the nodes come back (bounded)
    pending = record.stop_pending
    confirmed = [n for n in record.node_dirs() if n not in pending]
    said = {"stopped": "stopped while it was starting", "interrupted": "interrupted while it was starting"}
    head = f"run {record.run_id}: {said.get(cause, reason)}"  # a failed step: its reason, once
    parts = []
    if lost:
        parts.append(f"no start reply from {', '.join(lost)}")
    if confirmed:
        parts.append(f"nothing of it runs on {', '.join(confirmed)}")
    if pending:
        parts.append(f"NOT confirmed stopped on {', '.join(pending)} (unreachable): it may still run there")
    fix = (f"bring {', '.join(pending)} back and run `clusterctl stop {record.run_id}` (its watcher retries "
           "meanwhile)" if pending else f"see `clusterctl status {record.run_id}`")
    code = (errors.EXIT_UNREACHABLE if pending or lost else
            errors.EXIT_INTERRUPTED if cause == "interrupted" else errors.EXIT_FAILED)
    raise StartAborted(head + ": " + "; ".join(parts), fix, exit_code=code)


def _ports(group: Group, request: LaunchRequest, record: runs.RunRecord) -> dict[str, int]:
    """A port free right now: on the first node (torchrun) or on every node (TF)."""
    hosts = [t.host for t in request.targets]
    targets = hosts if request.job.launcher == "tensorflow" else hosts[:1]  # TF: every worker listens
    results = group.run(lambda h: render.agent_command(h, "freeport"), timeout=30, hosts=targets)
    require(results, "finding a free port", record)
    ports = {n: (agent_reply(r.stdout) or {}).get("port") for n, r in results.items()}
    bad = [n for n, p in ports.items() if not isinstance(p, int)]
    if bad:
        _fail_start(record, f"finding a free port failed on {', '.join(bad)}: unreadable agent reply", bad[0])
    return {n: int(p) for n, p in ports.items() if p is not None}


def _record(request: LaunchRequest, state: str) -> runs.RunRecord:
    spec = request.job
    return runs.RunRecord(
        run_id=request.run_id, job=spec.name, framework=spec.framework, state=state, created=time.time(),
        clusterctl=__version__, settings=spec.settings, spec_file=str(spec.path), world_size=request.world_size,
        endpoint=request.endpoint, data_file=request.data_file, inventory=request.inventory,
        nodes=[runs.RunNode(n.node, n.node_rank, n.nproc, n.run_dir) for n in request.nodes],
        left_out=dict(request.left_out), scheduler=request.scheduler, target=request.target,
        # what a restart without a lost node renders from again (cluster/runs/elastic.py)
        extra={"targets": {t.host.name: {"gpus": t.gpus, "backend": t.backend} for t in request.targets},
               "layer_dir": payload.layer_dir(request.layer)})


def _keep_rendered(request: LaunchRequest) -> None:
    """The exact files each node got, kept on the head with the record."""
    base = runs.run_path(request.run_id) / "rendered"
    for n in request.nodes:
        d = base / n.node
        d.mkdir(parents=True, exist_ok=True)
        for name, content in n.files.items():
            (d / name).write_text(content)
            os.chmod(d / name, 0o600)
