"""Runs on a Slurm compute node (standard library only, Python 3.8+): a task's resource samples.

    slurm_sampler.py TASK_PID OUT_FILE

No node agent runs on a cluster's compute nodes, so each task (templates/slurm_task.sh.j2) starts this beside
its program: every CLUSTERCTL_SAMPLE_S seconds (default usage.SAMPLE_S) it appends one line to OUT_FILE with
the node agent's own sampler (usage.py, staged beside this file), so a Slurm task's out/usage.jsonl has the
same keys as an SSH node's and `clusterctl report` reads both alike. The processes sampled are the task
script's descendants (its program, torchrun's workers), not this sampler. It ends with the task.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING or __package__:  # in the package (tests, type checks)
    from cluster.agent import usage
else:  # on the node: usage.py staged beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import usage


def children() -> dict[int, list[int]]:
    """ppid -> its live children, for every process visible in /proc."""
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            out.setdefault(int(fields[1]), []).append(int(d))
    return out


def descendants(root: int, skip: int) -> list[int]:
    """Every live descendant of `root`, leaving out `skip` and its own descendants (this sampler, nvidia-smi)."""
    kids, out, todo = children(), [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c != skip:
                out.append(c)
                todo.append(c)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].isdigit():
        sys.stderr.write("usage: slurm_sampler.py TASK_PID OUT_FILE\n")
        return 2
    root, out = int(argv[0]), Path(argv[1])
    every = float(os.environ.get("CLUSTERCTL_SAMPLE_S", usage.SAMPLE_S))
    me = os.getpid()
    sampler = usage.Sampler(out, lambda: descendants(root, me))
    while os.path.exists(f"/proc/{root}"):
        try:
            sampler.sample()
        except Exception as e:  # noqa: BLE001 - measuring must never end the task it measures
            sys.stderr.write(f"clusterctl: usage sampling stopped: {e}\n")
            return 0
        time.sleep(every)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
