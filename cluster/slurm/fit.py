"""The refusal of a job the partition cannot give (pure: the partitions as facts.SINFO parsed them).

Slurm itself would take such a job and leave it pending for ever (more nodes than the partition has, more
memory or GPUs than any node of it, a time beyond its limit) or refuse it with a terse message; clusterctl
says which resource does not fit, what the partition has and what to change, before anything is submitted.
"""
from __future__ import annotations

from typing import Callable

from cluster.errors import UsageError
from cluster.slurm.facts import Partition, SlurmNode
from cluster.slurm.resources import Resources


class Refused(UsageError):
    """The request asks for what the cluster's partition cannot give (exit 2, before submitting)."""


def partition_for(partitions: dict[str, Partition], res: Resources) -> Partition:
    """The partition the job goes to: the one asked for, else the cluster's default."""
    names = ", ".join(sorted(partitions)) or "none"
    if res.partition is None:
        default = next((p for p in partitions.values() if p.default), None)
        if default is None:
            raise Refused("no partition was asked for and the cluster has no default partition",
                          f"--partition P, or `partition:` in the inventory's slurm entry (sinfo lists: {names})")
        return default
    if res.partition not in partitions:
        raise Refused(f"the cluster has no partition {res.partition!r} that you can use (sinfo lists: {names})",
                      "--partition with one of them, or fix `partition:` in the inventory's slurm entry")
    return partitions[res.partition]


def check(partitions: dict[str, Partition], res: Resources) -> list[str]:
    """Refuse (Refused, exit 2) what the partition cannot give: more nodes than it has, more CPUs per task,
    memory or GPUs per node than `res.nodes` of its nodes have, a time beyond its limit. Returns notes on
    what fits but may wait (nodes down or drained now)."""
    part = partition_for(partitions, res)
    have = part.nodes
    if res.nodes > len(have):
        raise Refused(f"partition {part.name} has {len(have)} node(s); the job asks for {res.nodes}",
                      f"--nodes {len(have)} (or fewer), or a larger partition (`sinfo -s` lists them)")
    wants: list[tuple[str, str, Callable[[SlurmNode], bool], Callable[[SlurmNode], float], float]] = [
        ("CPUs per task", "--cpus-per-task", lambda n: n.cpus >= (res.cpus_per_task or 1), lambda n: n.cpus,
         res.cpus_per_task or 1),
        ("memory (MB) per node", "--mem", lambda n: res.mem_mb is None or n.memory_mb >= res.mem_mb,
         lambda n: n.memory_mb, res.mem_mb or 0),
        ("GPUs per node", "--gpus-per-node", lambda n: n.gpus >= res.gpus_per_node, lambda n: n.gpus,
         res.gpus_per_node),
    ]
    for what, option, ok, amount, wanted in wants:
        fitting = [n for n in have if ok(n)]
        if len(fitting) < res.nodes:
            best = sorted((amount(n) for n in have), reverse=True)[res.nodes - 1]
            raise Refused(f"partition {part.name}: the job asks for {wanted:g} {what} on {res.nodes} node(s), "
                          f"{len(fitting)} of its {len(have)} nodes have that much",
                          f"{option} {best:g} (what {res.nodes} of its nodes have), fewer --nodes, or another "
                          "partition (`sinfo -N -l` shows each node)")
    if res.time_minutes is not None and part.time_limit_min is not None and res.time_minutes > part.time_limit_min:
        raise Refused(f"partition {part.name} runs jobs for at most {part.time_limit_min:g} minutes; the job asks "
                      f"for --time {res.time} ({res.time_minutes:g} minutes)",
                      "a shorter --time, or a partition with a longer limit (`sinfo -s` shows TIMELIMIT)")
    fit = [n for n in have if all(ok(n) for _, _, ok, _, _ in wants)]
    up = [n for n in fit if n.usable]
    if len(fit) < res.nodes:  # each resource fits enough nodes, but not all on the same ones
        raise Refused(f"partition {part.name}: no {res.nodes} of its nodes have all the job asks for at once",
                      "ask for less per node (--cpus-per-task, --mem, --gpus-per-node) or fewer --nodes")
    if len(up) < res.nodes:
        down = sorted(f"{n.name} ({n.state})" for n in fit if not n.usable)
        return [f"partition {part.name}: {len(up)} of the {len(fit)} nodes that fit can start a job now "
                f"({', '.join(down)}): the job waits until {res.nodes} can"]
    return []
