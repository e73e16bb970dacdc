"""What a Slurm cluster says about itself: each fact a command (run on the login node) plus a parser of its
output (pyinfra's facts, as cluster/nodes/facts.py does for a node), tested on recorded outputs
(tests/fixtures/slurm/).

`sinfo -h -N -o '%N %P %T %c %m %G %l'`: one line per node and partition (a node in two partitions is listed
twice), the default partition's name marked with `*`. No field holds a blank: node, partition and state
names are words, GRES is `gpu:2` or `gpu:a100:4(S:0-1),mps:400` or `(null)`, memory is in megabytes. The
parser also reads the first five fields alone (`%N %P %T %c %m`, as the lab's recordings): no GPUs then, and
no time limit known.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from cluster.errors import ClusterError

T = TypeVar("T")

SINFO_FORMAT = "%N %P %T %c %m %G %l"
# The states of a node that will not start a job now (sinfo(1) NODE STATE CODES, long forms); `*` after a
# state: the node does not respond.
UNUSABLE = ("down", "drained", "draining", "drain", "fail", "failing", "future", "inval", "unknown",
            "not_responding", "maint", "reboot_issued", "reboot_requested", "powering_down", "perfctrs")


class FactError(ClusterError):
    """A command's output clusterctl cannot read (or the command failed): names the command and the line."""


@dataclass(frozen=True)
class Fact(Generic[T]):
    name: str
    command: str  # run by the login node's shell
    parse: Callable[[str, int], T]  # (stdout, exit code) -> the fact; FactError where it cannot


@dataclass(frozen=True)
class SlurmNode:
    """One node as one partition lists it."""

    name: str
    state: str  # sinfo's long form: idle, mixed, allocated, down*, drained, idle~ ...
    cpus: int
    memory_mb: int  # RealMemory; 1 where slurm.conf does not say
    gpus: int  # the GRES `gpu` count
    gres: str

    @property
    def usable(self) -> bool:
        """Would start a job now (or once its running jobs end): responding, not down, drained or failing.
        A powered-down node (`idle~`) counts: Slurm powers it up for the job."""
        state = self.state.lower()
        return not state.endswith("*") and not any(w in UNUSABLE for w in state.rstrip("~#!%$@^-").split("+"))


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    time_limit_min: float | None  # None: infinite (or not asked)
    nodes: tuple[SlurmNode, ...]


def gres_gpus(gres: str) -> int:
    """How many GPUs a node's GRES string gives: the counts of its `gpu` entries (`gpu:a100:4(S:0-1)` is 4)."""
    if gres in ("(null)", "", "N/A"):
        return 0
    total = 0
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = entry.strip().split(":")
        if parts[0] != "gpu":
            continue
        count = re.match(r"\d+", parts[-1]) if len(parts) > 1 else None
        total += int(count.group()) if count else 1
    return total


def time_limit(text: str) -> float | None:
    """sinfo's %l in minutes: `infinite` is None; `30:00`, `2:00:00`, `1-00:00:00` as sbatch reads them."""
    if text.lower() in ("infinite", "unlimited", "n/a"):
        return None
    from cluster.slurm.resources import time_minutes  # the one reader of Slurm's time forms

    return time_minutes(text, "sinfo %l")


def _leading_int(text: str) -> int:
    """`4` or `4+` (sinfo marks a group of nodes that differ with +): the number; ValueError otherwise."""
    m = re.match(r"\d+", text)
    if m is None:
        raise ValueError(text)
    return int(m.group())


def parse_sinfo(out: str, rc: int) -> dict[str, Partition]:
    """`sinfo -h -N -o SINFO_FORMAT` -> the partitions by name, their nodes in sinfo's order."""
    if rc != 0:
        tail = " ".join(out.split())[-300:]
        raise FactError(f"sinfo failed (exit {rc}){': ' + tail if tail else ''}",
                        "run `sinfo` on the login node: is the Slurm client installed and the controller up?")
    nodes: dict[str, list[SlurmNode]] = {}
    meta: dict[str, tuple[bool, float | None]] = {}
    for number, line in enumerate(out.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if not 5 <= len(fields) <= 7:
            raise FactError(f"sinfo line {number}: expected the fields {SINFO_FORMAT}, got {line!r}",
                            "this Slurm's sinfo prints another format: report it with the line")
        name, part, state, cpus, mem, gres, limit = [*fields, "(null)", "n/a"][:7] if len(fields) == 5 else \
            [*fields, "n/a"][:7]
        try:
            node = SlurmNode(name, state, _leading_int(cpus), _leading_int(mem), gres_gpus(gres), gres)
            minutes = time_limit(limit)
        except (ValueError, ClusterError):
            raise FactError(f"sinfo line {number}: cannot read {line!r}",
                            "this Slurm's sinfo prints another format: report it with the line") from None
        default = part.endswith("*")
        part = part.rstrip("*")
        nodes.setdefault(part, []).append(node)
        meta[part] = (default or meta.get(part, (False, None))[0], minutes)
    return {p: Partition(p, meta[p][0], meta[p][1], tuple(ns)) for p, ns in nodes.items()}


SINFO: Fact[dict[str, Partition]] = Fact("sinfo", f"sinfo -h -N -o '{SINFO_FORMAT}'", parse_sinfo)
