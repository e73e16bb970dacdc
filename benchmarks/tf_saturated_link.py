"""TensorFlow's control traffic on a link its gradients saturate: repeated 2-node resnet50-tf launches.

    .venv/bin/python benchmarks/tf_saturated_link.py [--tries 6] [--bandwidth 50mbit] [--timeout-s 120]

Issue 13: on a 2-node lab shaped to 50 Mbit/s, with TensorFlow's default coordination-service heartbeat
(10 s, each RPC given 5 s), the TF run failed about one launch in three at its first all-reduce
("Collective ops is aborted by: Deadline Exceeded, RPC: /tensorflow.CoordinationService/Heartbeat"): the
heartbeats queue behind ~94 MB of gradients. The job's `collective_timeout_s` (jobs.md) now sets it. Each try
here is a real `clusterctl launch resnet50-tf` (synthetic data, 32 px, batch 16, 1 thread, 2 epochs of 2
steps: ~15 s of gradients on the wire per step), one after the other; `--timeout-s 0` leaves TensorFlow's
defaults, to see the failure come back. Prints each try and the count. Contacts only the lab it starts;
removes it at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.plan import ctl  # noqa: E402
from cluster.lab import lifecycle  # noqa: E402

PY = sys.executable


def launch(env: dict[str, str], sets: list[str]) -> tuple[str, float, str]:
    """One run to its end: (state, seconds, the first error line of a failed run)."""
    t = time.monotonic()
    r = subprocess.run([PY, "-m", "cluster", "launch", "resnet50-tf", *sets, "--json"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        return f"exit {r.returncode}", wall, (r.stderr or r.stdout).strip()[-300:]
    error = ""
    if doc.get("state") != "succeeded":
        nodes = doc.get("nodes") or []
        error = next((str(n.get("error") or n.get("log_tail") or "") for n in nodes
                      if n.get("error") or n.get("log_tail")), json.dumps(doc)[-300:])
    return str(doc.get("state")), wall, " ".join(error.split())[:300]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=6)
    ap.add_argument("--bandwidth", default="50mbit")
    ap.add_argument("--timeout-s", type=int, default=120,
                    help="the job's collective_timeout_s, also the heartbeat timeout (0: TensorFlow's own, 10 s)")
    ap.add_argument("--name", default="tfsat")
    ap.add_argument("--subnet", default="10.201.0.0/24")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still removes the lab (finally)
    tmp = Path(tempfile.mkdtemp(prefix="clusterctl-tfsat-"))
    env = {**os.environ, "CLUSTERCTL_HOME": str(tmp / "home")}
    sets = [x for s in ("dataset.name=synthetic", "dataset.size=32", "batch=16", "threads=1", "epochs=2",
                        "max_steps=2", f"collective_timeout_s={args.timeout_s}") for x in ("--set", s)]
    outcomes = []
    state = lifecycle.up(2, name=args.name, subnet=args.subnet, directory=tmp / "lab", bandwidth=args.bandwidth)
    try:
        ctl(env, "provision", state.inventory, "--set", f"python={PY}", "--set", "vars.python_env=existing")
        for i in range(args.tries):
            outcomes.append(launch(env, sets))
            st, wall, err = outcomes[-1]
            print(f"  try {i + 1}: {st} in {wall:.0f} s" + (f": {err}" if err else ""), file=sys.stderr)
    finally:
        lifecycle.down(state.name, tmp / "lab", purge=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nresnet50-tf on 2 nodes at {args.bandwidth}, collective_timeout_s {args.timeout_s}\n")
    print("| try | state | seconds | error |\n|---:|---|---:|---|")
    for i, (st, wall, err) in enumerate(outcomes, 1):
        print(f"| {i} | {st} | {wall:.0f} | {err.replace('|', '/') or '-'} |")
    ok = sum(st == "succeeded" for st, _, _ in outcomes)
    print(f"\n{ok} of {len(outcomes)} launches succeeded")
    return 0 if ok == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
