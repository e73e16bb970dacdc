"""A run goes on without the nodes it lost (docs/reliability.md, "A PC that dies during the run").

When a node of a running run goes silent past the grace (its PC died, its link was cut) and the others
still meet the job's `min_nodes`, the run is not failed: the process that follows it (its watcher, else
whoever polls) stops the survivors, renders their files again for the smaller world (the first survivor
in inventory order hosts the rendezvous and is TensorFlow's chief), and starts them again through their
node agents, in the same run folders: the training programs resume from the newest checkpoint that any
node holds (every node keeps one). One mechanism for every launcher: torchrun's elastic rendezvous cannot
outlive its store's host (the first node), and MultiWorkerMirroredStrategy cannot shrink in place.

The built-in programs keep the global batch (each survivor's batch grows, so learning rate, steps per
epoch and schedule stay those of the run) and resume at the start of the epoch after the last checkpoint,
whose samples are split again among the new ranks: none is skipped or repeated within an epoch. A user's
program gets its new world (WORLD_SIZE, TF_CONFIG, CLUSTER_PERIOD) and owns its batch and its data.

The record keeps each membership period (nodes, from which epoch and step, why it changed) and the nodes
dropped; a dropped node that comes back stays out of this run (its leftovers are stopped); the next
launch includes it again.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from cluster.errors import ClusterError
from cluster.inventory.model import Host
from cluster.nodes.fanout import Group
from cluster.nodes.replies import agent_reply, error_tail
from cluster.runs import firewall, jobs, records, render
from cluster.runs.jobs import JobSpec
from cluster.transport import Transport

STOP_GRACE_S = 10.0
AGENT_TIMEOUT_S = 30.0


# state.stop_and_record, handed in by state.settle (this module is below the run's state machine: it imports
# nothing of it, so the two never import each other)
Stop = Callable[[records.RunRecord, list[str]], records.RunRecord]


def first_period(record: records.RunRecord, request: render.LaunchRequest) -> dict[str, Any]:
    """Period 1: the nodes the run starts on."""
    return _period(1, [n.node for n in request.nodes], request.world_size, None, request.endpoint,
                   node_batches(request.job.settings, {n.node: n.nproc for n in request.nodes}))


def _period(k: int, nodes: list[str], world: int, reason: str | None, endpoint: str | None,
            batches: dict[str, int] | None) -> dict[str, Any]:
    return {"period": k, "nodes": nodes, "world_size": world, "started": time.time(), "ended": None,
            "reason": reason, "from_epoch": None, "from_step": None, "endpoint": endpoint, "node_batch": batches}


def node_batches(settings: dict[str, Any], nprocs: dict[str, int]) -> dict[str, int] | None:
    """Each node's samples per micro-batch (its share, or `batch` on each of its processes); None for a
    user's program (its batch is its own)."""
    if settings.get("code") is not None:
        return None
    shares = settings.get("shares") or {}
    return {n: int(shares[n]) if n in shares else int(settings["batch"]) * p for n, p in nprocs.items()}


def keep_global_batch(before: dict[str, int], survivors: list[str]) -> dict[str, int]:
    """The survivors' batches, in proportion to what they had, summing to the same global batch
    (largest remainder; at least 1 each): the documented rule (docs/reliability.md)."""
    total = sum(before.values())
    have = sum(before[n] for n in survivors)
    exact = {n: before[n] * total / have for n in survivors}
    out = {n: max(1, int(v)) for n, v in exact.items()}
    for n in sorted(survivors, key=lambda n: (out[n] - exact[n], survivors.index(n)))[: total - sum(out.values())]:
        out[n] += 1
    return out


def _settings_for(settings: dict[str, Any], batches: dict[str, int] | None, nprocs: dict[str, int]) -> dict[str, Any]:
    """The job's settings for the new period: even batches stay `batch`, uneven ones become `shares`."""
    s = dict(settings)
    if batches is None:
        return s
    per_proc = {batches[n] / nprocs[n] for n in batches}
    if len(per_proc) == 1 and float(next(iter(per_proc))).is_integer():
        s["batch"], s["shares"] = int(next(iter(per_proc))), {}
    else:
        s["shares"] = dict(batches)
    return s


def may_continue(record: records.RunRecord, lost: list[str]) -> bool:
    """The job lets the run go on without `lost`: it has a min_nodes that the others still meet."""
    need = int((record.settings or {}).get("min_nodes") or 0)
    left = [n for n in record.members() if n not in lost]
    return need > 0 and bool(left) and len(left) >= need


def alive(pid: Any) -> bool:
    """A process of this head that still runs: a killed watcher nobody has reaped yet (a zombie) is gone."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X")


def begin(record: records.RunRecord, lost: list[str], reason: str, now: float) -> None:
    """Inside records.update: the run is `restarting` without `lost`; the watcher (if it lives, else this
    process) does the restart. Their leftovers are stopped as they come back (stop_pending)."""
    if not record.move("restarting"):
        return
    steps = {n: (record.last_status or {}).get(n, {}).get("step") for n in lost}
    k = len(record.periods) or 1
    for n in lost:
        record.dropped[n] = {"why": reason, "at": now, "period": k, "step": steps[n], "came_back": None}
    if record.periods:
        record.periods[-1]["ended"] = now
    watcher = (record.watcher or {}).get("pid")
    record.reform = {"pid": watcher if alive(watcher) else os.getpid(), "since": now, "lost": lost,
                     "reason": reason}
    record.stop_pending = sorted(set(record.stop_pending) | set(lost))


def claimed(record: records.RunRecord) -> bool:
    """This process is to restart the run: the claim is its own, or its holder is gone (taken over)."""
    if record.state != "restarting" or record.reform is None:
        return False
    pid = record.reform.get("pid")
    if pid == os.getpid():
        return True
    if alive(pid):
        return False

    def take(r: records.RunRecord) -> None:
        if r.state == "restarting" and r.reform is not None and not alive(r.reform.get("pid")):
            r.reform["pid"] = os.getpid()

    return (records.update(record.run_id, take).reform or {}).get("pid") == os.getpid()


def reform(record: records.RunRecord, stop: Stop) -> records.RunRecord:
    """Stop the survivors, render and upload their files for the new period, start them again. A survivor
    that cannot be stopped or started is lost too (while min_nodes is met); otherwise the run fails, every
    node stopped. Bounded: one round per node at most."""
    for _ in range(len(record.nodes)):
        record = records.load(record.run_id)
        if record.state != "restarting" or record.stopped_by_user:
            return record
        hosts = [h for h in record.hosts() if h.name in record.members()]
        with Group(hosts) as group:
            if _already_restarted(group, record):  # a restarter killed after it sent the restart: taken over
                nxt = (record.reform or {})["next"]
                return _running(record, nxt["nodes"], nxt["world_size"], nxt["endpoint"], nxt["node_batch"], stop)
            stopped = _stop(group, record, hosts)
            bad = {n: why for n, why in stopped.items() if why}
            if bad:
                record = _drop(record, bad, stop)
                continue
            if records.load(record.run_id).stopped_by_user:
                return records.load(record.run_id)
            try:
                request, batches = _request(group, record, hosts)
            except ClusterError as e:
                lost = ", ".join((record.reform or {}).get("lost", []))
                return _fail(record, f"cannot restart without {lost}: {e}", stop)
            _upload(group, record, request)
            _note_next(record, request, batches)
            started = _restart(group, record, request)
            bad = {n: why for n, why in started.items() if why}
            if records.load(record.run_id).stopped_by_user:  # its stop refused the restart, or comes after it
                return stop(records.load(record.run_id), list(record.node_dirs()))
            if bad:
                record = _drop(record, bad, stop)
                continue
        return _running(record, [n.node for n in request.nodes], request.world_size, request.endpoint, batches, stop)
    return _fail(record, "the survivors could not be restarted", stop)


def _note_next(record: records.RunRecord, request: render.LaunchRequest, batches: dict[str, int] | None) -> None:
    """The period about to be started, in the record before any node is asked to start it: a process that takes
    the restart over (this one killed meanwhile) learns from it what the survivors may already be running."""
    nxt = {"period": len(record.periods) + 1, "nodes": [n.node for n in request.nodes],
           "world_size": request.world_size, "endpoint": request.endpoint, "node_batch": batches}

    def change(r: records.RunRecord) -> None:
        if r.reform is not None:
            r.reform["next"] = nxt

    records.update(record.run_id, change)


def _already_restarted(group: Group, record: records.RunRecord) -> bool:
    """Every node of the period the restarter was starting (`reform.next`) runs it, or ran it: the restart went
    through before its restarter died, so a takeover records that period instead of stopping and starting
    it again (which would train part of it twice). Asked of the nodes' agents; any doubt says no."""
    nxt = (record.reform or {}).get("next")
    if not isinstance(nxt, dict) or nxt.get("period") != len(record.periods) + 1:
        return False
    dirs = record.node_dirs()
    hosts = [h for h in record.hosts() if h.name in nxt.get("nodes", [])]
    if len(hosts) != len(nxt.get("nodes", [])):
        return False
    res = group.run(lambda h: render.agent_command(h, "status", dirs[h.name], "0"), timeout=AGENT_TIMEOUT_S,
                    hosts=hosts)
    for h in hosts:
        pid = (agent_reply(res[h.name].stdout) or {}).get("pid")
        if not isinstance(pid, dict) or pid.get("period") != nxt["period"]:
            return False
    return True


def _stop(group: Group, record: records.RunRecord, hosts: list[Host]) -> dict[str, str | None]:
    """node -> None when its agent confirmed nothing of the run is left there, else why not."""
    dirs = record.node_dirs()
    res = group.run(lambda h: render.agent_command(h, "stop", dirs[h.name], str(STOP_GRACE_S), "reform"),
                    timeout=STOP_GRACE_S + 30)
    out: dict[str, str | None] = {}
    for h in hosts:
        r = res[h.name]
        doc = agent_reply(r.stdout)
        out[h.name] = None if doc is not None and doc.get("ok") else \
            f"could not be stopped for the restart ({r.error or error_tail(r.stderr) or r.status})"
    return out


def _request(group: Group, record: records.RunRecord,
             hosts: list[Host]) -> tuple[render.LaunchRequest, dict[str, int] | None]:
    """The survivors' files for the next period, rendered as launch renders them (new rendezvous host,
    new TF_CONFIG and chief, the global batch kept), and each survivor's batch."""
    prev = record.periods[-1] if record.periods else {}
    nprocs = {n.node: n.nproc for n in record.nodes}
    names = [h.name for h in hosts]
    before = prev.get("node_batch")
    batches = keep_global_batch({n: int(v) for n, v in before.items()}, names) if isinstance(before, dict) else None
    settings = _settings_for(record.settings, batches, {n: nprocs[n] for n in names})
    spec = JobSpec(Path(record.spec_file), jobs.with_defaults(settings))  # a run started by an older version
    known = record.extra.get("targets") or {}
    targets = [render.Target(h, int((known.get(h.name) or {}).get("gpus", 0)),
                             str((known.get(h.name) or {}).get("backend", "gloo"))) for h in hosts]
    request = render.render(spec, targets, record.run_id, record.data_file, _ports(group, spec, hosts),
                            record.extra.get("layer_dir"), period=len(record.periods) + 1)
    return request, batches


def _ports(group: Group, spec: JobSpec, hosts: list[Host]) -> dict[str, int]:
    """The job's port, or one free now on the new first node (torchrun, plain) or on every worker (TF)."""
    if spec["port"]:
        return {h.name: int(spec["port"]) for h in hosts}
    asked = hosts if spec.launcher == "tensorflow" else hosts[:1]
    res = group.run(lambda h: render.agent_command(h, "freeport"), timeout=AGENT_TIMEOUT_S, hosts=asked)
    ports = {n: (agent_reply(r.stdout) or {}).get("port") for n, r in res.items()}
    bad = [n for n, p in ports.items() if not isinstance(p, int)]
    if bad:
        raise ClusterError(f"no free port from {', '.join(bad)}", "see `clusterctl logs`")
    return {n: int(p) for n, p in ports.items() if p is not None}


def _upload(group: Group, record: records.RunRecord, request: render.LaunchRequest) -> None:
    """The new launch files into the survivors' run folders (the old ones are kept on the head)."""
    by_node = {n.node: n for n in request.nodes}
    period = len(record.periods) + 1
    base = records.run_path(record.run_id) / "rendered" / f"period-{period}"
    for n in request.nodes:
        (base / n.node).mkdir(parents=True, exist_ok=True)
        for name, content in n.files.items():
            (base / n.node / name).write_text(content)
            os.chmod(base / n.node / name, 0o600)

    def put(t: Transport) -> None:
        n = by_node[t.host.name]
        for name, content in n.files.items():
            t.put_bytes(content.encode(), f"{n.run_dir}/{name}", 0o700 if name.endswith(".sh") else 0o600)

    group.call(put, [t.host for t in request.targets])  # a node that fails here fails its restart below
    if record.extra.get("firewall"):  # the leader closed it when the last period ended: open it again
        firewall.open_for(group, [t.host for t in request.targets], record.run_id,
                          {n.node: n.run_dir for n in request.nodes})


def _restart(group: Group, record: records.RunRecord, request: render.LaunchRequest) -> dict[str, str | None]:
    period = len(record.periods) + 1
    lost = record.reform["lost"] if record.reform else []
    text = (f"period {period}: {', '.join(n.node for n in request.nodes)} (world {request.world_size}) go on "
            f"without {', '.join(lost)} ({record.reform['reason'] if record.reform else ''}), from the last "
            "checkpoint")
    dirs = {n.node: n.run_dir for n in request.nodes}
    res = group.run(lambda h: render.agent_command(h, "restart", dirs[h.name], str(period), text),
                    timeout=AGENT_TIMEOUT_S, hosts=[t.host for t in request.targets])
    out: dict[str, str | None] = {}
    for n, r in res.items():
        doc = agent_reply(r.stdout)
        out[n] = None if doc is not None and doc.get("ok") else \
            f"could not be restarted ({(doc or {}).get('error') or r.error or error_tail(r.stderr) or r.status})"
    return out


def _drop(record: records.RunRecord, bad: dict[str, str], stop: Stop) -> records.RunRecord:
    """More nodes lost during the restart: dropped as well, or the run fails when min_nodes is no longer met."""
    if not may_continue(record, list(bad)):
        n = next(iter(bad))
        return _fail(record, f"{n} {bad[n]}; without it fewer than min_nodes "
                             f"({record.settings.get('min_nodes')}) nodes are left", stop, n)
    now = time.time()

    def change(r: records.RunRecord) -> None:
        for n, why in bad.items():
            r.dropped[n] = {"why": why, "at": now, "period": len(r.periods), "step": None, "came_back": None}
        if r.reform is not None:
            r.reform["lost"] = sorted(set(r.reform["lost"]) | set(bad))
        r.stop_pending = sorted(set(r.stop_pending) | set(bad))

    return records.update(record.run_id, change)


def _fail(record: records.RunRecord, reason: str, stop: Stop, node: str | None = None) -> records.RunRecord:
    def change(r: records.RunRecord) -> None:
        if r.move("failed"):
            lost = (r.reform or {}).get("lost") or [n for n in r.dropped]
            r.failure = r.failure or records.Failure(node or (lost[0] if lost else r.nodes[0].node), reason)
            r.stop_pending = sorted(set(r.stop_pending) | set(r.members()))
        r.reform = None

    record = records.update(record.run_id, change)
    return stop(record, list(record.stop_pending)) if record.stop_pending else record


def _running(record: records.RunRecord, nodes: list[str], world: int, endpoint: str | None,
             batches: dict[str, int] | None, stop: Stop) -> records.RunRecord:
    now = time.time()
    reason = str((record.reform or {}).get("reason"))
    period = _period(len(record.periods) + 1, nodes, world, reason, endpoint, batches)

    def change(r: records.RunRecord) -> None:
        if not r.move("running"):
            return
        r.periods.append(period)
        r.reform = None
        r.world_size, r.endpoint = world, endpoint
        r.failure = None
        for n in period["nodes"]:
            r.last_seen[n] = now

    record = records.update(record.run_id, change)
    if record.stopped_by_user:  # the user's stop came during the restart: it wins
        return stop(record, list(record.node_dirs()))
    return record


def describe(record: records.RunRecord) -> list[str]:
    """The periods and the dropped nodes, a line each, for `status` and `launch`."""
    lines = []
    for p in record.periods if len(record.periods) > 1 or record.dropped else []:
        at = "" if p.get("from_epoch") is None else (
            f" from epoch {p['from_epoch']} (step {p['from_step']})" if p.get("from_step") else
            " from step 0 (no checkpoint yet)" if p["period"] > 1 else "")
        lines.append(f"period {p['period']}: {', '.join(p['nodes'])} (world {p['world_size']}){at}"
                     + (f"; {p['reason']}" if p.get("reason") else ""))
    for n, d in record.dropped.items():
        back = (f"; came back at {time.strftime('%H:%M:%S', time.localtime(d['came_back']))}, kept out of this run"
                if d.get("came_back") else "")
        lines.append(f"dropped: {n} ({d['why']}){back}")
    return lines


