"""The room over SSH: the inventory's PCs, reached one by one (cluster/runs: launch stages each run's files on
every PC and starts them through its node agent; state polls and judges; watch keeps judging while nobody
looks; elastic goes on without a PC it loses)."""
from __future__ import annotations

from typing import Any, Callable, Iterator

from cluster.errors import UsageError
from cluster.inventory.model import Host
from cluster.room import held
from cluster.runs import collect as run_collect, elastic, launch, logstream, preflight, records, state, watch
from cluster.runs.render import LaunchRequest
from cluster.schedulers.interface import Log, Logs, OnUpdate, Option, Submission


class Room:
    name = "ssh"
    title = "on the inventory's PCs"
    options: tuple[Option, ...] = ()
    refuses: dict[str, str] = {}
    continues_runs = True  # its checkpoints stay on the PCs that wrote them

    def pcs(self, sub: Submission) -> list[Host] | None:
        return preflight.select_hosts(sub.inventory, sub.spec, sub.limit)

    def dryrun(self, sub: Submission, log: Log = lambda s: None) -> LaunchRequest:
        """Preflight (read-only, over SSH) and every PC's rendered files; `nodes`: the first N of the job's PCs.
        PCs a room's Slurm holds are refused before any is contacted (the room's own waiter launches on the PCs
        Slurm gave it through runs.launch, not here)."""
        limit = sub.limit
        hosts = preflight.select_hosts(sub.inventory, sub.spec, sub.limit)
        if sub.nodes is not None:
            if sub.nodes > len(hosts):
                raise UsageError(f"{sub.nodes} nodes: job {sub.spec.name} has only {len(hosts)} in "
                                 f"{sub.inventory.path}", f"use counts up to {len(hosts)}")
            hosts = hosts[:sub.nodes]
            limit = ",".join(h.name for h in hosts)
        job = "JOB" if sub.spec.own else sub.spec.name
        held.guard(sub.inventory, [h.name for h in hosts], "clusterctl's own SSH launch leaves {them} to Slurm",
                   f"clusterctl launch {job} --on {{room}} (Slurm queues it and gives it PCs)", sub.outside_slurm, log)
        return launch.prepare(sub.inventory, sub.spec, limit=limit, forks=sub.forks, log=log)

    def submit(self, request: Any, log: Log = lambda s: None, prediction: dict[str, Any] | None = None,
               watch: bool = True, forks: int = 32) -> records.RunRecord:
        assert isinstance(request, LaunchRequest)
        return launch.execute(request, log, prediction, watch, forks)

    def describe(self, record: records.RunRecord) -> records.RunRecord:
        record = state.refresh(record)
        _watched(record)
        return record

    def follow(self, record: records.RunRecord, on_update: OnUpdate | None = None) -> records.RunRecord:
        return state.follow(record, on_update=on_update)

    def logs(self, record: records.RunRecord, node: str | None = None, lines: int = 50) -> Logs:
        got = state.logs(record, node, lines=lines)
        return Logs({n: text for n, (text, _) in got.items()}, got.unreachable)

    def log_iter(self, record: records.RunRecord, node: str | None = None,
                 unreachable: set[str] | None = None) -> Iterator[tuple[str, str]]:
        return logstream.follow(record, node, unreachable=unreachable)

    def stop(self, record: records.RunRecord, grace: float = 10.0) -> records.RunRecord:
        record = state.stop(record, grace=grace)
        _watched(record)
        return record

    def collect(self, record: records.RunRecord, checkpoints: bool = False, forks: int = 32,
                on_bytes: Callable[[str, int], None] | None = None,
                inventory_hosts: dict[str, Host] | None = None) -> dict[str, run_collect.NodeCollect]:
        return run_collect.collect(record, checkpoints=checkpoints, forks=forks, on_bytes=on_bytes,
                                   inventory_hosts=inventory_hosts)

    def where(self, record: records.RunRecord) -> str:
        return ""  # the per-PC table says it all

    def details(self, record: records.RunRecord) -> list[str]:
        """The run it continues, its membership periods, the PCs not confirmed stopped, firewall rules left."""
        lines = []
        cont = record.extra.get("continues")
        if cont:
            lines.append(f"continues run {cont['run']} (from what it left on {', '.join(cont['copied'])})")
        lines += elastic.describe(record)  # the membership periods of a run that lost a node and went on
        if record.stop_pending:
            lines.append(f"not confirmed stopped (unreachable): {', '.join(record.stop_pending)}; run `clusterctl "
                         f"stop {record.run_id}` when they are back"
                         + (" (the watcher stops what a dropped node left running when it answers again)"
                            if set(record.stop_pending) <= set(record.dropped) else ""))
        elif record.failure is not None and record.stop_results:
            lines.append("the other nodes were stopped")
        for n, why in state.firewall_left(record).items():
            lines.append(f"firewall rule left open on {n} ({why}): run `clusterctl stop {record.run_id}` again, or "
                         f"remove the rules whose comment is \"clusterctl {record.run_id}\" (`sudo nft -a list "
                         "ruleset`, then `sudo nft delete rule FAMILY TABLE CHAIN handle N`)")
        if record.failure is not None:
            lines.append(f"logs and metrics stay on the nodes (`clusterctl logs {record.run_id}`)")
        return lines


def _watched(record: records.RunRecord) -> None:
    """A run still going, or with PCs whose stop is not confirmed (a dropped PC, one switched off), whose
    watcher died (killed, the head rebooted) gets a new one: nobody else would judge it, go on without a PC it
    loses, or stop what a PC left running (and close its firewall rule) when it answers again."""
    if (record.active or record.stop_pending) and record.watcher and not elastic.alive(record.watcher.get("pid")):
        watch.spawn(record.run_id)


SCHEDULER = Room()
