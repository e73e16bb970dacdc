"""The room as a Slurm cluster: what setting it up costs, and what its queue adds to a launch, against the
plain SSH launch on the same PCs in the same run.

    .venv/bin/python benchmarks/room.py [--repeats 3]

One simulated gateway lab of 3 PCs (`lab up 3 --gateway --user student`: the gateway is the controller),
provisioned with `python_env: existing` (the head's .venv). Measured, end to end as the user waits:
  provision --slurm      first time (packages already on the lab's PCs: files, key, daemons, sinfo/srun check)
                         and a rerun on the set-up room (nothing changes)
  launch over SSH        `clusterctl launch resnet50-ddp --limit node1,node2` to the run's end (the baseline)
  launch --on room       `clusterctl launch resnet50-ddp --on room --nodes 2` to the run's end: sbatch, the
                         waiter's squeue poll, then the same SSH launch on the 2 PCs Slurm gave
ResNet50 at 8x8 px, 3 steps, 1 thread: mostly interpreter and framework start-up. Median of --repeats, the
two launches alternating. Contacts only the lab it starts; removes it at the end.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import lab_parser, median_time, print_timing_table  # noqa: E402
from cluster.lab import lifecycle  # noqa: E402

PY = sys.executable
JOB = ["--set", "dataset.size=8", "--set", "batch=4", "--set", "threads=1", "--set", "epochs=1",
       "--set", "max_steps=3", "--set", "log_every=1"]


def ctl(env: dict[str, str], *args: str, timeout: float = 600) -> None:
    r = subprocess.run([PY, "-m", "cluster", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"clusterctl {' '.join(args)}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def main() -> None:
    ap = lab_parser(__doc__, "broom", "10.79.41.0/24", 3)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="bench-room-"))
    env = {**os.environ, "CLUSTERCTL_HOME": str(d / "home")}
    state = lifecycle.up(3, name=args.name, subnet=args.subnet, directory=d / "lab", gateway=True, user="student")
    inv = ["-i", state.inventory]
    try:
        ctl(env, "provision", state.inventory, "--set", f"python={PY}", "--set", "vars.python_env=existing")
        t = time.perf_counter()
        ctl(env, "provision", "--slurm", state.inventory)
        first = time.perf_counter() - t
        rerun = median_time(lambda: ctl(env, "provision", "--slurm", state.inventory), args.repeats)
        print(f"provision --slurm, 3 PCs and a controller: first {first:.1f} s; rerun (nothing changes) "
              f"median {rerun[0]:.1f} s\n")
        ssh_times: list[float] = []
        room_times: list[float] = []
        for _ in range(args.repeats + 1):  # the first pair warms the caches (code, dataset)
            for out, argv in ((ssh_times, ["--limit", "node1,node2"]), (room_times, ["--on", "room", "--nodes", "2"])):
                t = time.perf_counter()
                ctl(env, "launch", "resnet50-ddp", *inv, *argv, *JOB)
                out.append(time.perf_counter() - t)
        results = {"launch over SSH (baseline)": (sorted(ssh_times[1:])[len(ssh_times[1:]) // 2], ssh_times[1:]),
                   "launch --on room": (sorted(room_times[1:])[len(room_times[1:]) // 2], room_times[1:])}
        base = results["launch over SSH (baseline)"][0]
        print("launch to the run's end, 2 PCs (seconds):\n")
        print_timing_table(results, "vs SSH", lambda m: m / base, digits=1)
    finally:
        lifecycle.down(state.name, d / "lab", purge=True)


if __name__ == "__main__":
    main()
