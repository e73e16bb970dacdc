"""What a job asks Slurm for: its nodes, one task per node, GPUs, CPUs, time and memory, and where it is charged.

The command line (`launch JOB --on NAME --partition P ...`, SlurmOverrides) wins over the inventory's cluster
entry (partition, account, qos), which wins over Slurm's own defaults (nothing said). Values are checked here,
before they reach an #SBATCH line, so a typo is exit 2 on the head, not a job Slurm refuses or misreads.

The node count of a job (the built-in ones say `nodes: all`, meant for the room's PCs): `--nodes N` when given;
else as many nodes as the same job's SSH launch would use on this inventory: the length of a `nodes:` list,
or how many hosts `nodes: all` or a group selects. An inventory without such hosts needs `--nodes N`.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from cluster.errors import InventoryError, UsageError
from cluster.inventory.clusters import SLURM_NAME, SLURM_TIME
from cluster.inventory.model import Inventory, SlurmCluster
from cluster.runs.jobs import JobSpec
from cluster.runs.schema import JobError

_TIME = SLURM_TIME
_MEM = re.compile(r"(?P<n>\d{1,12})(?P<unit>[KMGT]?)\Z", re.I)  # sbatch --mem: default unit megabytes
_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
MAX_NODES = 100000
MAX_GPUS = 64
MAX_CPUS = 4096


@dataclass(frozen=True)
class SlurmOverrides:
    """`launch --on NAME` options: None where the command line said nothing."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    nodes: int | None = None
    time: str | None = None
    mem: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None


@dataclass(frozen=True)
class Resources:
    """The request's resources, resolved: what the #SBATCH lines say and the sinfo check compares."""

    nodes: int
    nproc_per_node: int  # processes per task (torchrun's --nproc-per-node); 1 for tensorflow and plain
    partition: str | None  # None: Slurm's default partition
    account: str | None
    qos: str | None
    time: str | None  # Slurm's form, as given; None: the partition's default
    time_minutes: float | None
    mem: str | None  # per node, as given; None: Slurm's default
    mem_mb: float | None
    gpus_per_node: int  # 0: none asked
    cpus_per_task: int | None
    requeue: bool

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def sbatch_options(self) -> list[str]:
        """The resource options, each `--name=value` as it goes on an #SBATCH line (plain words only)."""
        opts = [f"--nodes={self.nodes}", "--ntasks-per-node=1"]
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.cpus_per_task is not None:
            opts.append(f"--cpus-per-task={self.cpus_per_task}")
        opts += [f"--{k}={v}" for k, v in (("mem", self.mem), ("time", self.time), ("partition", self.partition),
                                             ("account", self.account), ("qos", self.qos)) if v is not None]
        return opts

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "world_size": self.world_size}


def time_minutes(text: str, option: str = "--time") -> float:
    """A Slurm time limit in minutes; UsageError for anything sbatch would read otherwise (or refuse)."""
    m = _TIME.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise UsageError(f"{option}: expected a Slurm time limit, got {text!r}",
                         "e.g. --time 30 (minutes), --time 2:00:00 or --time 1-12:00:00 (days-hours:minutes:seconds)")
    if m["d"] is not None:
        d, h, mi, s = int(m["d"]), int(m["dh"]), int(m["dm"] or 0), int(m["ds"] or 0)
    elif m["c"] is not None:
        d, h, mi, s = 0, int(m["a"]), int(m["b"]), int(m["c"])
    else:
        d, h, mi, s = 0, 0, int(m["a"]), int(m["b"] or 0)
    minutes = d * 1440 + h * 60 + mi + s / 60
    if minutes <= 0:
        raise UsageError(f"{option}: {text!r} is no time at all", "give the job's time limit, e.g. --time 30")
    return minutes


def mem_mb(text: str, option: str = "--mem") -> float:
    """sbatch's --mem (per node; K, M, G or T, default M) in megabytes; UsageError otherwise."""
    m = _MEM.match(text.strip()) if isinstance(text, str) else None
    if m is None or int(m["n"]) == 0:
        raise UsageError(f"{option}: expected a memory size per node, got {text!r}",
                         "e.g. --mem 16G or --mem 4000 (megabytes); leave it out for the partition's default")
    return int(m["n"]) * _MB[m["unit"].upper() or "M"]


def _name(value: str | None, option: str) -> str | None:
    if value is not None and not SLURM_NAME.match(value):
        raise UsageError(f"{option}: expected a Slurm name (letters, digits, _ . + -), got {value!r}",
                         "`sinfo -s` lists the partitions; `sacctmgr show assoc user=$USER` accounts and QoS")
    return value


def _count(value: int | None, option: str, low: int, high: int) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
        raise UsageError(f"{option}: expected a whole number from {low} to {high}, got {value!r}",
                         f"e.g. {option} {max(low, 1)}")
    return value


def node_count(inv: Inventory, spec: JobSpec, given: int | None) -> int:
    """How many nodes the job asks for: `--nodes`, else the nodes its SSH launch would use (module docstring)."""
    if given is not None:
        return int(_count(given, "--nodes", 1, MAX_NODES) or 1)
    nodes = spec["nodes"]
    if isinstance(nodes, list):
        return len(nodes)
    try:
        chosen = inv.select(None if nodes == "all" else nodes, "the job's nodes:")
    except (UsageError, InventoryError):  # a group this inventory does not have: the count cannot come from it
        chosen = []
    if not chosen:
        raise UsageError(f"job {spec.name}: nodes={nodes!r} names no host of the inventory, so the node count for "
                         "Slurm is not known", f"give it: clusterctl launch {spec.name} --on NAME --nodes 2")
    return len(chosen)


def procs_per_node(spec: JobSpec, gpus_per_node: int) -> int:
    """torchrun's processes per node: one per GPU asked (`procs_per_node: auto`), one without GPUs; one worker
    per node for tensorflow and plain (as on SSH launches)."""
    want = spec["procs_per_node"]
    if spec.launcher in ("tensorflow", "plain"):
        if want not in ("auto", 1):
            raise JobError(str(spec.path), None, "procs_per_node", f"a {spec.launcher} job runs one process per "
                           f"node, got {want}", f"leave procs_per_node at 1 for {spec.launcher} jobs")
        return 1
    if want == "auto":
        return max(1, gpus_per_node)
    if gpus_per_node and want > gpus_per_node:
        raise JobError(str(spec.path), None, "procs_per_node", f"{want} processes per node on {gpus_per_node} "
                       "GPU(s) per node", f"--gpus-per-node {want}, or procs_per_node: auto (one per GPU)")
    return int(want)


def resolve(inv: Inventory, spec: JobSpec, cluster: SlurmCluster, o: SlurmOverrides) -> Resources:
    """The job's resources on `cluster`, every value checked (UsageError / JobError: exit 2)."""
    gpus = _count(o.gpus_per_node, "--gpus-per-node", 0, MAX_GPUS) or 0
    time = o.time.strip() if o.time is not None else None
    mem = o.mem.strip().upper() if o.mem is not None else None
    return Resources(
        nodes=node_count(inv, spec, o.nodes), nproc_per_node=procs_per_node(spec, gpus),
        partition=_name(o.partition, "--partition") or cluster.partition,
        account=_name(o.account, "--account") or cluster.account, qos=_name(o.qos, "--qos") or cluster.qos,
        time=time, time_minutes=time_minutes(time) if time is not None else None,
        mem=mem, mem_mb=mem_mb(mem) if mem is not None else None, gpus_per_node=gpus,
        cpus_per_task=_count(o.cpus_per_task, "--cpus-per-task", 1, MAX_CPUS), requeue=bool(spec["requeue"]))
