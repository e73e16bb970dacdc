"""Uneven batches on a heterogeneous lab: the planned split vs the even split, and the plan's error.

    .venv/bin/python benchmarks/plan.py [--quota 1,0.35] [--repeats 2] [--job resnet50-ddp]

A 2-node lab made heterogeneous for real: each node pinned to its own core, the
second allowed only --quota of it (cgroup CPU bandwidth, `lab up --cpu-quota`).
Then, as a user would: `clusterctl bench` (each node alone), `clusterctl plan`,
and in the same run, alternating, the job with the same global batch split
evenly (batch 16 + 16) and as planned (`--set shares...` from the plan's 2-node
candidate). Measured: images/s of each run's second epoch (rank 0's epoch
record). Contacts only the lab it starts; removes it at the end.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import lab_parser  # noqa: E402
from cluster.lab import lifecycle  # noqa: E402

PY = sys.executable


def ctl(env: dict[str, str], *args: str, timeout: float = 1800) -> dict[str, Any]:
    r = subprocess.run([PY, "-m", "cluster", *args, "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"clusterctl {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def measured(state: lifecycle.LabState, run_id: str) -> float:
    f = Path(state.nodes[0].dir) / "srv" / "runs" / run_id / "out"
    recs = [json.loads(x) for p in f.glob("metrics-rank*.jsonl") for x in p.read_text().splitlines()]
    epochs = [r for r in recs if r["type"] == "epoch" and r["epoch"] == 1]
    return float(epochs[0]["images_per_s"])


def main() -> int:
    ap = lab_parser(__doc__, "benchpl", "10.232.0.0/24", 2)
    ap.add_argument("--quota", default="1,0.35", help="CPU quota per node (fractions of one core)")
    ap.add_argument("--job", default="resnet50-ddp")
    ap.add_argument("--steps", type=int, default=10, help="steps per epoch of the measured runs")
    args = ap.parse_args()
    quotas = [float(x) for x in args.quota.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-plan-"))
    env = {**os.environ, "CLUSTERCTL_HOME": str(tmp / "home")}
    state = lifecycle.up(len(quotas), name=args.name, subnet=args.subnet, directory=tmp / "lab", cpu_quotas=quotas)
    job_set = ["--set", "batch=16", "--set", "threads=1"]
    run_set = [*job_set, "--set", "epochs=2", "--set", f"max_steps={args.steps}", "--set", "log_every=1000"]
    try:
        ctl(env, "provision", state.inventory, "--set", f"python={PY}", "--set", "vars.python_env=existing")
        b = ctl(env, "bench", "--jobs", args.job, "--steps", "8", *job_set)
        p = ctl(env, "plan", args.job, *job_set)
        full = next(c for c in p["candidates"] if len(c["nodes"]) == len(quotas))
        # as a user would: `launch --plan` when the plan recommends all nodes, else the all-node shares by hand
        how = ["--plan"] if p["recommended"]["nodes"] == full["nodes"] else \
            [x for n, v in full["shares"].items() for x in ("--set", f"shares.{n}={v}")]
        even, planned = [], []
        for _ in range(args.repeats):
            even.append(measured(state, ctl(env, "launch", args.job, *run_set)["run_id"]))
            last = ctl(env, "launch", args.job, *run_set, *how)["run_id"]
            planned.append(measured(state, last))
            print(f"even {even[-1]:.1f}  planned {planned[-1]:.1f} images/s", file=sys.stderr)
        ctl(env, "collect", last)
        reported = ctl(env, "report", last)["runs"][0]
    finally:
        lifecycle.down(state.name, tmp / "lab", purge=True)
        shutil.rmtree(tmp, ignore_errors=True)
    fw = next(iter(b["compute"].values()))
    e, pl = statistics.median(even), statistics.median(planned)
    print(f"\n{args.job} on {len(quotas)} nodes pinned to one core each, CPU quotas {args.quota}; "
          f"batch 16/node even, global batch {full['global_batch']}; median of {args.repeats}\n")
    print("bench (each node alone): " + ", ".join(f"{n} {r['images_per_s']:.1f} images/s"
                                                  for n, r in fw["nodes"].items())
          + f"; all-reduce {p['network']['busbw_MBps']:.0f} MB/s, latency {p['network']['latency_s'] * 1e3:.2f} ms")
    print(f"plan's recommendation: {', '.join(p['recommended']['nodes'])} with shares {p['recommended']['shares']}\n")
    print("| split | shares | predicted images/s | measured images/s | prediction error |")
    print("|---|---|---:|---:|---:|")
    print(f"| even | {', '.join(f'{n}=16' for n in full['shares'])} | {full['even_images_per_s']:.1f} | {e:.1f} "
          f"| {full['even_images_per_s'] / e - 1:+.1%} |")
    print(f"| planned | {', '.join(f'{n}={v}' for n, v in full['shares'].items())} | "
          f"{full['planned_images_per_s']:.1f} | {pl:.1f} | {full['planned_images_per_s'] / pl - 1:+.1%} |")
    print(f"\nplanned / even (measured, same global batch): {pl / e:.2f}x (target >= 1.3x); "
          f"prediction error target: within 20%")
    print(f"the last planned run ({' '.join(how)}) in `clusterctl report`: predicted "
          f"{reported['predicted_images_per_s'] or 0:.1f}, measured {reported['images_per_s']:.1f} images/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
