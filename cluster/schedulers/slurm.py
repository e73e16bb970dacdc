"""A Slurm cluster of the inventory (`slurm:`, docs/slurm.md): the run's files staged on its login node's
shared folder, sbatch, Slurm's verdict read over SSH (cluster/slurm). A job Slurm has accepted but not
started is `queued`, with Slurm's reason."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from cluster.errors import TransportError
from cluster.inventory.model import Host
from cluster.runs import collect as run_collect, records
from cluster.schedulers.interface import Log, Logs, OnUpdate, Option, Submission
from cluster.slurm import run, submit as slurm_submit
from cluster.slurm.resources import SlurmOverrides

FOLLOW_S = 2.0  # between two questions to the login node while following


class Slurm:
    name = "slurm"
    title = "on a Slurm cluster (docs/slurm.md)"
    options: tuple[Option, ...] = (
        Option("partition", "with --on: the partition (default: the inventory's, else Slurm's)", "P"),
        Option("account", "with --on: the account charged (default: the inventory's)", "A"),
        Option("qos", "with --on: the quality of service (default: the inventory's)", "Q"),
        Option("nodes", "with --on: how many nodes (default: as many as the job uses on the inventory's hosts)", "N",
               "positive"),
        Option("time", "with --on: the time limit, e.g. 30, 2:00:00, 1-12:00:00", "T"),
        Option("mem", "with --on: memory per node, e.g. 16G (default: Slurm's)", "M"),
        Option("gpus_per_node", "with --on: GPUs per node", "G", "count"),
        Option("cpus_per_task", "with --on: CPUs of each node's task", "C", "positive"),
    )
    # launch options that pick or power the inventory's PCs: a Slurm job's nodes come from the scheduler
    refuses: dict[str, str] = {"limit": "--limit picks the inventory's PCs; Slurm chooses a job's nodes (--nodes N says how many)",
               "plan": "--plan places the job on the inventory's PCs; on Slurm give --nodes N",
               "wake": "--wake wakes the inventory's PCs, not a cluster's nodes",
               "poweroff_after": "--poweroff-after powers the inventory's PCs off, not a cluster's nodes",
               "continue_run": "--continue takes a run further on the PCs that hold its checkpoints; a Slurm job "
                               "requeued by Slurm resumes there on its own (docs/slurm.md)"}
    continues_runs = False  # its checkpoints are in the job's folder on the cluster, not on the PCs

    def pcs(self, sub: Submission) -> list[Host] | None:
        return None  # Slurm picks the job's nodes; sinfo says at submission whether the partition has them

    def dryrun(self, sub: Submission, log: Log = lambda s: None) -> slurm_submit.SlurmRequest:
        assert sub.on is not None
        given: dict[str, Any] = {o.name: sub.options.get(o.name) for o in self.options}
        overrides = SlurmOverrides(**{**given, "nodes": sub.nodes or given["nodes"]})
        return slurm_submit.prepare(sub.inventory, sub.spec, sub.on, overrides)

    def submit(self, request: Any, log: Log = lambda s: None, prediction: dict[str, Any] | None = None,
               watch: bool = True, forks: int = 32) -> records.RunRecord:
        assert isinstance(request, slurm_submit.SlurmRequest)
        return run.submit(request, log)

    def describe(self, record: records.RunRecord) -> records.RunRecord:
        return run.refresh(record)

    def follow(self, record: records.RunRecord, on_update: OnUpdate | None = None) -> records.RunRecord:
        return run.follow(record, interval=FOLLOW_S,
                          on_update=(lambda r: on_update(r, r.last_status or {})) if on_update else (lambda r: None))

    def logs(self, record: records.RunRecord, node: str | None = None, lines: int = 50) -> Logs:
        got = run.logs(record, lines=lines)
        return Logs({n: t for n, t in got.items() if node is None or n == node})

    def log_iter(self, record: records.RunRecord, node: str | None = None,
                 unreachable: set[str] | None = None) -> Iterator[tuple[str, str]]:
        """Each task's new lines (its output on the shared folder), until Slurm ends the job; bounded by the
        job's own time limit, which every Slurm job has. A login node that does not answer is asked again."""
        shown: dict[str, int] = {}
        while True:
            try:
                got = run.logs(record, lines=100000)
            except TransportError:
                got = {}
            for name, text in got.items():
                if node is not None and name != node:
                    continue
                lines = text.splitlines()
                for line in lines[shown.get(name, 0):]:
                    yield name, line
                shown[name] = len(lines)
            if not record.active:
                return
            try:
                record = run.refresh(record)
            except TransportError:
                pass
            time.sleep(FOLLOW_S)

    def stop(self, record: records.RunRecord, grace: float = 10.0) -> records.RunRecord:
        return run.stop(record)

    def collect(self, record: records.RunRecord, checkpoints: bool = False, forks: int = 32,
                on_bytes: Callable[[str, int], None] | None = None,
                inventory_hosts: dict[str, Host] | None = None) -> dict[str, run_collect.NodeCollect]:
        return run.collect(record, checkpoints=checkpoints, on_bytes=on_bytes)

    def where(self, record: records.RunRecord) -> str:
        """e.g. `Slurm job 12 on lab: PENDING, Resources`."""
        tg = record.target or {}
        reason = tg.get("reason")
        return (f"Slurm job {tg.get('job_id') or '?'} on {tg.get('cluster', '?')}: {tg.get('state', '?')}"
                + (f", {reason}" if reason else ""))


    def details(self, record: records.RunRecord) -> list[str]:
        rq = (record.target or {}).get("requeued")
        lines = [f"requeued by Slurm after it lost {', '.join(rq['lost'])} {rq.get('reason') or ''}: it starts over "
                 "when Slurm lets it (requeue: true)"] if rq and record.active else []
        if not record.active:
            lines.append(f"its folder stays on the cluster: `clusterctl collect {record.run_id}` brings it")
        return lines


SCHEDULER = Slurm()
