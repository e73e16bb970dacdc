"""A started run's life, seen from the head: poll the nodes' agents, judge, settle, stop, read logs.

The head only polls: one node agent `status` per node per poll. A node that fails
or vanishes fails the run, and the others are stopped instead of being left
hanging in a collective; everything written so far stays on the nodes.

Who judges a run: whichever clusterctl process polls it (the foreground
`launch`, `status`, the busy check of another launch) and, so that a run left
alone overnight still gets its verdict, a watcher process on the head started
by launch (cluster/runs/watch.py). They all write through records.update, under the
run's lock, and the silence clock lives in the record, so they agree.
Independently of the head, the training programs' collective timeouts
(`collective_timeout_s`) end the survivors of a dead peer by themselves.
"""
from __future__ import annotations

import json
import os
import shlex
import time
from typing import Any, Callable

from cluster.runs import elastic, records, render
from cluster.runs.nodestatus import FAILED_STATES, SILENT_STATES, NodeStatus, poll
from cluster.errors import UsageError
from cluster.nodes.fanout import Group
from cluster.inventory.model import Host
from cluster.nodes.replies import agent_reply, error_tail

# A node silent this long (since it last answered) fails the run: long enough for an old PC's sshd
# under training load, short enough that the survivors are stopped within a minute (docs/reliability.md).
UNREACHABLE_GRACE_S = 30.0
STOP_RETRY_S = 15.0  # between two stops sent to a node not yet confirmed stopped


def grace(record: records.RunRecord) -> float:
    """How long a node may be silent before it fails the run (or is dropped from it): the job's
    `silent_grace_s`, else UNREACHABLE_GRACE_S. Kept in the record, so every judge of the run agrees."""
    value = (record.settings or {}).get("silent_grace_s")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 \
        else UNREACHABLE_GRACE_S


def judge(record: records.RunRecord, statuses: dict[str, NodeStatus], now: float | None = None) -> str:
    """The run's state from its nodes': any failure fails it, all succeeded succeeds it.

    A node silent (unreachable or unanswered) for the grace (`grace`) since it last answered fails the
    run; the clock is kept in the record, so it runs across `status` calls and processes."""
    now = time.time() if now is None else now
    start = record.started or record.created
    for n, s in statuses.items():
        if s.state not in SILENT_STATES:
            record.last_seen[n] = now
    failed = [s for s in statuses.values() if s.state in FAILED_STATES]
    lost = sorted(n for n, s in statuses.items()
                  if s.state in SILENT_STATES and now - record.last_seen.get(n, start) >= grace(record))
    if failed or lost:
        if record.failure is None:
            first = min(failed, key=lambda s: s.ended or now) if failed else statuses[lost[0]]
            silent_for = now - record.last_seen.get(first.node, start)
            ranks = f" (rank{'s' if len(first.failed_ranks) > 1 else ''} {', '.join(map(str, first.failed_ranks))})" \
                if first.failed_ranks else ""
            reason = (f"exit code {first.exit_code}{ranks}" if first.state == "failed" else
                      f"{first.state} for {silent_for:.0f} s ({first.error})" if first.state in SILENT_STATES else
                      "its processes are gone without an exit record" if first.state == "vanished" else
                      first.error or first.state)
            known = (record.last_status or {}).get(first.node) or {}
            tail = (first.log or known.get("log") or [])[-20:]
            shown = [*first.traceback, "...", *tail[-8:]] if first.traceback else tail  # the program's error first
            record.failure = records.Failure(first.node, reason, shown,
                                             sorted(({s.node for s in failed} | set(lost)) - {first.node}),
                                             first.failed_ranks)
        return "failed"
    states = {s.state for s in statuses.values()}
    if states == {"succeeded"}:
        return "succeeded"
    if "stopped" in states and not states & {"running", "stopping"}:
        return "stopped"
    return "running"


def _remember(record: records.RunRecord, statuses: dict[str, NodeStatus]) -> None:
    """Keep each node's last status; a silent node keeps its last known log and metrics (the morning after,
    they are all that is left of a node that went away)."""
    before = record.last_status or {}
    now: dict[str, dict[str, Any]] = {}
    for n, s in statuses.items():
        d = s.to_dict()
        if s.state in SILENT_STATES and n in before:
            d = {**before[n], "state": s.state, "error": s.error}
        now[n] = d
    record.last_status = {**before, **now}  # a dropped node no longer polled keeps its last status


def _note_membership(record: records.RunRecord, statuses: dict[str, NodeStatus], now: float) -> None:
    """Every poll (inside records.update): a dropped node that answers again came back (it stays out); the
    current membership period learns where its programs resumed (their start record)."""
    for n, d in record.dropped.items():
        s = statuses.get(n)
        if s is not None and s.state not in SILENT_STATES and d.get("came_back") is None:
            d["came_back"] = now
    if not record.periods:
        return
    p = record.periods[-1]
    if p.get("from_epoch") is None:
        for s in statuses.values():
            if s.node in p["nodes"] and s.period == p["period"] and s.start_epoch is not None:
                p["from_epoch"], p["from_step"] = s.start_epoch, s.start_step
                break


def _lost(record: records.RunRecord, statuses: dict[str, NodeStatus], now: float) -> list[str] | None:
    """Where the job's min_nodes lets the run go on without a node (cluster/runs/elastic.py): the nodes silent
    past the grace, to continue without; [] to wait, when a node failed while another is silent within the
    grace (the failure may be its peers' answer to a PC going away); None: judge as usual."""
    start = record.started or record.created
    silent = [n for n, s in statuses.items() if s.state in SILENT_STATES]
    gone = [n for n in silent if now - record.last_seen.get(n, start) >= grace(record)]
    if gone:
        return gone if elastic.may_continue(record, gone) else None
    if silent and any(s.state in FAILED_STATES for s in statuses.values()) and elastic.may_continue(record, silent):
        return []
    return None


def _apply(record: records.RunRecord, statuses: dict[str, NodeStatus]) -> None:
    """The verdict, written into the newest copy of the record (inside records.update). A run that may go on
    without a lost node is moved to `restarting` instead of failing (cluster/runs/elastic.py)."""
    now = time.time()
    _note_membership(record, statuses, now)
    if not record.active or record.stopped_by_user or record.state == "restarting":
        _remember(record, statuses)
        return
    polled, statuses = statuses, {n: s for n, s in statuses.items() if n in record.members()}  # dropped: no say
    for n, s in statuses.items():
        if s.state not in SILENT_STATES:
            record.last_seen[n] = now
    lost = _lost(record, statuses, now)
    if lost is not None:
        if lost:
            start = record.started or record.created
            why = "; ".join(f"{n} {statuses[n].state} for {now - record.last_seen.get(n, start):.0f} s "
                            f"({(statuses[n].error or 'no answer').removeprefix(n + ': ')})" for n in lost)
            elastic.begin(record, sorted(lost), why, now)
        _remember(record, polled)
        return
    state = judge(record, statuses)
    _remember(record, polled)
    if not record.move(state):
        return
    if state == "succeeded":  # every member's program ended by itself, exit 0: nothing is left to stop
        record.stop_pending = [n for n in record.stop_pending if n not in record.members()]
    if state == "failed":  # to be stopped; each node leaves this list once its agent confirms
        record.stop_pending = sorted(set(record.stop_pending) | {
            n for n, s in statuses.items() if s.state in ("running", "stopping", *SILENT_STATES)} | opened(record))


def opened(record: records.RunRecord) -> set[str]:
    """The members whose host firewall launch opened for the run: a failed run's stop goes to each of them,
    since only a stop closes the rule where the node's agent leader was killed (`kill -9`, the OOM killer)
    before it could."""
    fw = record.extra.get("firewall")
    return {n for n, v in fw.items() if isinstance(v, dict) and v.get("opened") and n in record.members()} \
        if isinstance(fw, dict) else set()


def firewall_left(record: records.RunRecord) -> dict[str, str]:
    """node -> what its stop said is still open: the rules a stop could not remove."""
    out = {}
    for n, r in (record.stop_results or {}).items():
        fw = r.get("firewall") if isinstance(r, dict) else None
        if isinstance(fw, dict) and fw.get("closed") is False:
            out[n] = str(fw.get("error") or "not closed")
    return out


def settle(record: records.RunRecord, statuses: dict[str, NodeStatus]) -> records.RunRecord:
    """Apply the verdict; a failed run's other nodes are stopped and what could not be confirmed is kept
    in `stop_pending` (the next launch on those nodes tries again, and refuses while it cannot).

    A stop not yet confirmed everywhere (a failed run's or the user's) is sent again, every
    STOP_RETRY_S, to the pending nodes that answered this poll: whoever follows the run finishes it."""
    record = records.update(record.run_id, lambda r: _apply(r, statuses))
    if record.state == "restarting" and elastic.claimed(record):
        record = elastic.reform(record, stop_and_record)
    if not record.stop_pending:
        return record
    if record.state == "failed" and record.stop_tried is None:  # the verdict just came: stop them all now
        return stop_and_record(record, list(record.stop_pending))
    back = [n for n in record.stop_pending if n in statuses and statuses[n].state not in SILENT_STATES]
    if back and time.time() - (record.stop_tried or 0) >= STOP_RETRY_S:
        record = stop_and_record(record, back)
    return record


def stop_and_record(record: records.RunRecord, nodes: list[str], grace: float = 10.0) -> records.RunRecord:
    records.update(record.run_id, lambda r: setattr(r, "stop_tried", time.time()))
    results = stop_nodes(record, grace, only=nodes)
    confirmed = {n for n, r in results.items() if r.get("ok")}
    statuses = poll(record) if confirmed else {}

    def change(r: records.RunRecord) -> None:
        r.stop_results = {**(r.stop_results or {}), **results}
        r.stop_pending = sorted((set(r.stop_pending) | set(nodes)) - confirmed)
        if statuses:  # what the table shows: the confirmed nodes stopped, the others as last known
            r.last_status = {**(r.last_status or {}),
                             **{n: statuses[n].to_dict() for n in confirmed if n in statuses}}
        if r.stopped_by_user and not set(r.stop_pending) & set(r.members()):  # a dropped node does not hold it
            ended = bool(statuses) and all(n in statuses and statuses[n].state == "succeeded" for n in r.members())
            r.move("succeeded" if ended else "stopped")  # succeeded: every program had ended by itself, exit 0

    return records.update(record.run_id, change)


def _launcher_alive(record: records.RunRecord) -> bool:
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


def refresh(record: records.RunRecord) -> records.RunRecord:
    """Ask the nodes, judge, and save: what `clusterctl status` does. Also retries a stop that could not
    be confirmed on some node."""
    if record.state == "starting" and _launcher_alive(record):
        return record  # its launcher is still uploading; judging now would see no processes yet
    if record.state == "restarting" and not elastic.claimed(record):
        return record  # its watcher is restarting the survivors
    if record.active and not record.stopped_by_user:
        return settle(record, poll(record))  # a failure found now is stopped there
    if record.stop_pending:
        record = stop_and_record(record, list(record.stop_pending))
    return record


def stop_answered(record: records.RunRecord) -> bool:
    """The run has ended, or the user's stop has had its answer from every node (confirmed or not)."""
    return not record.active or (record.stopped_by_user and record.stop_results is not None
                                 and set(record.stop_results) >= set(record.node_dirs()))


def follow(record: records.RunRecord, interval: float = 2.0,
           on_update: Callable[[records.RunRecord, dict[str, NodeStatus]], None] | None = None,
           retry_for: float = 0.0) -> records.RunRecord:
    """Poll until the run ends (or the user's stop has been answered), stopping the others when a node
    fails. `retry_for` (the watcher): go on that long after that, retrying the stop on the nodes not
    confirmed stopped as they come back; then leave them to `status` and the next launch's busy check."""
    hosts = record.hosts()
    group = Group(hosts)
    settled_at: float | None = None
    try:
        while True:
            statuses = poll(record, group)
            record = settle(record, statuses)
            if on_update:
                on_update(record, statuses)
            if stop_answered(record):
                settled_at = settled_at or time.monotonic()
                waited = time.monotonic() - settled_at
                if not record.stop_pending or (waited >= retry_for and not _stop_in_flight(record, statuses, waited)):
                    return record
            if any(s.state in SILENT_STATES for s in statuses.values()):
                group.close()  # the group remembers dead nodes: a fresh one tries them again
                group = Group(hosts)
            time.sleep(interval)
    finally:
        group.close()


def _stop_in_flight(record: records.RunRecord, statuses: dict[str, NodeStatus], waited: float) -> bool:
    """A node still pending answers and has no stop result yet: another process (the run's watcher) is
    stopping it now. Its answer is waited for, up to two STOP_RETRY_S (settle retries the stop itself after
    one), so that a node being stopped is not reported "not confirmed" (exit 3) while it answers."""
    answered = set(record.stop_results or {})
    return waited < 2 * STOP_RETRY_S and any(
        n not in answered and n in statuses and statuses[n].state not in SILENT_STATES for n in record.stop_pending)


def stop_nodes(record: records.RunRecord, grace: float = 10.0, only: list[str] | None = None) -> dict[str, Any]:
    """SIGTERM, then SIGKILL after `grace`, every process of the run on every node (or `only` these).
    A node's result is ok only when its agent confirmed that nothing of the run is left."""
    dirs = record.node_dirs()
    hosts = [h for h in record.hosts() if only is None or h.name in only]
    with Group(hosts) as g:
        res = g.run(lambda h: _stop_command(h, dirs[h.name], grace, _may_start(record)), timeout=grace + 30)
    out = {}
    for n, r in res.items():
        doc = agent_reply(r.stdout)
        out[n] = doc if doc is not None else {"ok": False, "error": r.error or error_tail(r.stderr)
                                                                   or r.status, "status": r.status}
    return out


# a node with neither the run's folder nor the agent: clusterctl never started anything of the run there
NEVER_THERE = json.dumps({"ok": True, "terminated": [], "killed": [], "left": [],
                          "absent": "neither the run's folder nor clusterctl's agent is on this machine"})


def _may_start(record: records.RunRecord) -> bool:
    """A clusterctl process of this head may still start something of the run on a node: the run is active
    and not stopped by the user, or its launcher or restarter is still at work (both check for the stop
    before they start anything, but one may be past that check for some node)."""
    if not record.active:
        return False
    if not record.stopped_by_user:
        return True
    return _launcher_alive(record) or elastic.alive((record.reform or {}).get("pid"))


def _stop_command(h: Host, run_dir: str, grace: float, may_start: bool) -> str:
    """The agent's stop. Where nothing can start any more (a run that is over, or the user's stop with no
    launcher or restarter at work), a node without the run's folder and without the agent (a PC reinstalled,
    a lab rebuilt at the same addresses) answers that nothing of the run is there: the launch makes both
    before it starts anything, and their absence is all that machine can say. Never while something may
    start: a launch may be about to make them (its own stop check after staging, and the agent's STOP file,
    cover that case)."""
    cmd = render.agent_command(h, "stop", run_dir, str(grace))
    if may_start:
        return cmd
    q = shlex.quote
    agent = f"{h.workdir}/{render.AGENT}"
    return f"if [ -e {q(run_dir)} ] || [ -e {q(agent)} ]; then {cmd}; else printf '%s\\n' {q(NEVER_THERE)}; fi"


def stop(record: records.RunRecord, grace: float = 10.0) -> records.RunRecord:
    """`clusterctl stop`: end the run everywhere. The run is recorded `stopped` only once every node
    confirmed it; until then it stays `stopping`, with the nodes to retry in `stop_pending`."""

    def mark(r: records.RunRecord) -> None:
        if r.move("stopping"):  # every node pending until its agent confirms: a stop cut short is retried
            r.stopped_by_user = True
            r.stop_pending = sorted(set(r.stop_pending) | set(r.node_dirs()))

    record = records.update(record.run_id, mark)
    return stop_and_record(record, list(record.node_dirs()), grace)


class LogReads(dict[str, tuple[str, int]]):
    """node -> (text, new offset); `unreachable`: the nodes that could not be read (their text says why)."""

    unreachable: set[str]


def logs(record: records.RunRecord, node: str | None = None, offsets: dict[str, int] | None = None,
         lines: int = 50) -> LogReads:
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
    out = LogReads()
    out.unreachable = {n for n, r in res.items() if r.status == "unreachable"}
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
