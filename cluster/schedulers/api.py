"""The schedulers by name: the one a run record names (`of`), the one a launch goes to (`for_launch`), and the
check of a launch's options against the scheduler's declarations (cluster/schedulers/interface.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from cluster.errors import UsageError
from cluster.schedulers.interface import Logs, Option, Scheduler, Submission

if TYPE_CHECKING:
    from cluster.inventory.model import Host, Inventory
    from cluster.runs.collect import CollectSummary
    from cluster.runs.records import RunRecord
    from cluster.schedulers.room import OthersJob

__all__ = ["Logs", "Option", "Scheduler", "Submission", "check_options", "collect_runs", "for_launch", "of",
           "registry", "stop_unrecorded"]


def registry() -> dict[str, Scheduler]:
    """Every scheduler, by the name a run record gives (imported here, not at module level: `--help` stays
    light)."""
    from cluster.schedulers import room, slurm, ssh

    return {s.name: s for s in (ssh.SCHEDULER, slurm.SCHEDULER, room.SCHEDULER)}


def of(record: RunRecord) -> Scheduler:
    """The scheduler a run record names."""
    found = registry().get(record.scheduler)
    if found is None:
        raise UsageError(f"run {record.run_id} ran on scheduler {record.scheduler!r}, which this clusterctl does "
                         "not know", "use the clusterctl version that started it (see its run.json)")
    return found


def for_launch(on: str | None, inv: Inventory | None = None) -> Scheduler:
    """The scheduler a launch goes to: the inventory's PCs over SSH, `--on NAME`'s cluster (Slurm), or the room's
    own Slurm where NAME is a room of `inv` (provision --slurm)."""
    if on is None:
        return registry()["ssh"]
    return registry()["room" if inv is not None and on in inv.rooms else "slurm"]


def stop_unrecorded(inv: Inventory, run_id: str) -> OthersJob | None:
    """`stop` of a run this head has no record of (another student's): only a room's Slurm knows it, by name."""
    from cluster.schedulers import room

    return room.stop_by_name(list(inv.rooms.values()), run_id)


def check_options(sched: Scheduler, options: dict[str, Any], on: str | None) -> None:
    """Refuse an option of another scheduler, and a common one this scheduler cannot honour (exit 2)."""
    for other in registry().values():
        if other.name == sched.name:
            continue
        for o in other.options:
            if options.get(o.name) is not None and o.name not in {x.name for x in sched.options}:
                raise UsageError(f"{o.flag} goes with --on NAME (a cluster of the inventory)",
                                 f"clusterctl launch JOB --on NAME {o.flag} ... (docs/slurm.md)")
    for name, why in sched.refuses.items():
        if options.get(name):
            raise UsageError(f"--{name.replace('_', '-')} does not go with --on {on}", why)


def collect_runs(records: list[RunRecord], checkpoints: bool = False, forks: int = 32,
                 on_bytes: Callable[[str, str, int], None] | None = None,
                 inventory_hosts: dict[str, Host] | None = None) -> CollectSummary:
    """Each run's files through its own scheduler, in turn; `on_bytes(run_id, node, n)` as bytes arrive. One
    run's failed or unreachable node does not stop the next run's collect: the summary's verdict says it."""
    from cluster.runs.collect import CollectSummary, RunCollect
    from cluster.runs.records import run_path

    done = []
    for record in records:
        def arrived(node: str, n: int, rid: str = record.run_id) -> None:
            if on_bytes is not None:
                on_bytes(rid, node, n)

        nodes = of(record).collect(record, checkpoints=checkpoints, forks=forks, on_bytes=arrived,
                                   inventory_hosts=inventory_hosts)
        done.append(RunCollect(record.run_id, run_path(record.run_id), nodes))
    return CollectSummary(done)
