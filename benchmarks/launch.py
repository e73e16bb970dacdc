"""Launch overhead: `clusterctl launch` vs starting the same torchrun scripts by hand over ssh.

    .venv/bin/python benchmarks/launch.py [--sizes 2,4,8] [--repeats 3] [--own]

One simulated lab of max(sizes) nodes, provisioned with `python_env: existing`
(the head's .venv). For each size N (the first N nodes, `--limit`):
  clusterctl launch   `clusterctl launch resnet50-ddp --detach` from a fresh process:
                      preflight, dataset check, render, upload, detached start
  by hand over ssh    the same rendered launch.sh files, already on the nodes,
                      started with one `ssh node sh launch.sh` per node in parallel
Measured: seconds from the start of the command to the first completed training
step on every node (the `time` of each rank's first step record; one clock, as all
nodes are on this machine). Median of --repeats, the two ways alternating.
ResNet50 at 8x8 px, batch 4, 1 thread per process: the first step is mostly
interpreter and framework start-up, the part both ways share. Contacts only
the lab it starts; removes it at the end.

--own adds a user's own program (tests/fixtures/own/train.py: torch.distributed from torchrun's
environment, no clusterctl import), launched ad hoc (`clusterctl launch --code DIR -- python train.py`,
its folder shipped through the nodes' code cache) and by hand (its rendered launch.sh, over ssh): seconds
until every rank printed its first line (`[rankN]:rank N of W`, seen in each node's log, polled every
50 ms), beside the built-in job's launch to its first step in the same run.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import lab_parser  # noqa: E402
from cluster.lab import lifecycle  # noqa: E402
from cluster.inventory import loader, model

PY = sys.executable
AGENT = ROOT / "cluster" / "agent" / "nodeagent.py"
JOB = ["--set", "dataset.size=8", "--set", "batch=4", "--set", "threads=1", "--set", "epochs=1",
       "--set", "log_every=1000"]


def ctl(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "cluster", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def first_steps(dirs: list[Path], timeout: float = 600) -> list[float]:
    """Wall time of the first step record of every rank, waiting until each node has one."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = []
        for d in dirs:
            for f in (d / "out").glob("metrics-rank*.jsonl"):
                for line in f.read_text().splitlines():
                    rec = json.loads(line) if line.endswith("}") else {}
                    if rec.get("type") == "step":
                        found.append(rec["time"])
                        break
        if len(found) >= len(dirs):
            return found
        time.sleep(0.05)
    raise RuntimeError(f"no first step on every node within {timeout} s: {dirs}")


OWN = ROOT / "tests" / "fixtures" / "own"


def first_lines(dirs: list[Path], ranks: int, timeout: float = 600) -> float:
    """When every rank of the run has printed its first line in its node's log (seen by polling)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        seen = set()
        for d in dirs:
            try:
                text = (d / "node.log").read_text(errors="replace")
            except OSError:
                continue
            seen |= {int(m.split("]")[0].removeprefix("[rank")) for m in text.split("\n")
                     if m.startswith("[rank") and "]:rank " in m}
        if len(seen) >= ranks:
            return time.time()
        time.sleep(0.05)
    raise RuntimeError(f"not every rank printed within {timeout} s: {dirs}")


def _ssh(inv: model.Inventory, node: str, command: str) -> subprocess.Popen[bytes]:
    h = inv.hosts[node]
    return subprocess.Popen(
        ["ssh", "-i", str(h.key_path), "-o", f"UserKnownHostsFile={h.known_hosts_path}",
         "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"{h.user}@{h.address}", command],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_dir(d: Path) -> None:
    """The node agent on the head: the lab shares its process table, and job.json names the run."""
    subprocess.run([PY, str(AGENT), "stop", str(d), "5"], capture_output=True, timeout=60)


OWN_LAUNCH = ["--code", str(OWN), "--", "python", "train.py", "--seconds", "20"]


def by_launch(env: dict[str, str], state: lifecycle.LabState, n: int, what: list[str] | None = None,
              ready: Callable[[list[Path], int], float] = lambda dirs, n: max(first_steps(dirs))) -> tuple[float, str]:
    """`clusterctl launch WHAT --detach` on the first n nodes, timed until `ready` says the run is up
    (default: the built-in job, to its first step on every node)."""
    what = what or ["resnet50-ddp", *JOB]
    limit = ",".join(x.name for x in state.nodes[:n])
    i = what.index("--") if "--" in what else len(what)  # `launch [OPTIONS] -- COMMAND`: options first
    t0 = time.time()
    r = ctl(env, "launch", *what[:i], "--detach", "--json", "--limit", limit, *what[i:])
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    run_id = json.loads(r.stdout)["run_id"]
    dirs = [Path(x.dir) / "srv" / "runs" / run_id for x in state.nodes[:n]]
    took = ready(dirs, n) - t0
    ctl(env, "stop", run_id, "--grace", "5")
    return took, run_id


def by_hand(state: lifecycle.LabState, inv: model.Inventory, n: int, template_run: str, k: int,
            ready: Callable[[list[Path]], float] = lambda dirs: max(first_steps(dirs))) -> float:
    """Copy a launched run's folder to a new one on each node (files in place, as a user who prepared
    them by hand), then time one ssh per node running its launch.sh until `ready` says the run is up."""
    new_id = f"{template_run}-hand{k}"
    dirs = []
    for x in state.nodes[:n]:
        src, dst = Path(x.dir) / "srv" / "runs" / template_run, Path(x.dir) / "srv" / "runs" / new_id
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src / "program", dst / "program", ignore=shutil.ignore_patterns("results", "logs"))
        (dst / "out").mkdir()
        for name in ("launch.sh", "job.json"):
            (dst / name).write_text((src / name).read_text().replace(template_run, new_id))
        dirs.append(dst)
    t0 = time.time()
    procs = [_ssh(inv, x.name, f"cd {inv.hosts[x.name].workdir}/runs/{new_id} && sh launch.sh > node.log 2>&1")
             for x in state.nodes[:n]]
    took = ready(dirs) - t0
    for d in dirs:
        stop_dir(d)
    for p in procs:
        p.wait(timeout=60)
    return took


def main() -> int:
    ap = lab_parser(__doc__, "benchlc", "10.231.0.0/24", 3)
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--own", action="store_true", help="also a user's own program, ad hoc and by hand")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    env = {**os.environ, "CLUSTERCTL_HOME": str(tmp / "home")}
    state = lifecycle.up(max(sizes), name=args.name, subnet=args.subnet, directory=tmp / "lab")
    try:
        r = ctl(env, "provision", state.inventory, "--set", f"python={PY}", "--set", "vars.python_env=existing",
                timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"provision failed:\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
        inv = loader.load(state.inventory)
        rows, own_rows = [], []
        for n in sizes:
            launch_times, hand_times, own_times, own_hand = [], [], [], []
            _, template = by_launch(env, state, n)  # warm-up: page cache, dataset prepared and staged
            own_template = by_launch(env, state, n, OWN_LAUNCH, first_lines)[1] if args.own else ""  # warm-up
            for k in range(args.repeats):
                hand_times.append(by_hand(state, inv, n, template, k))
                launch_times.append(by_launch(env, state, n)[0])
                if args.own:
                    own_hand.append(by_hand(state, inv, n, own_template, k, lambda dirs: first_lines(dirs, n)))
                    own_times.append(by_launch(env, state, n, OWN_LAUNCH, first_lines)[0])
            rows.append((n, statistics.median(hand_times), statistics.median(launch_times), hand_times,
                         launch_times))
            if args.own:
                own_rows.append((n, statistics.median(own_hand), statistics.median(own_times)))
            print(f"{n} nodes: by hand {hand_times}, clusterctl launch {launch_times}, own program by hand "
                  f"{own_hand}, ad hoc {own_times}", file=sys.stderr)
        print(f"\nlaunch to first completed step on every node, median of {args.repeats} "
              f"(ResNet50 8 px, batch 4, 1 thread/process, {os.cpu_count()} cores shared by the nodes)\n")
        print(f"{'nodes':>5}  {'by hand over ssh (s)':>21}  {'clusterctl launch (s)':>22}  {'ratio':>6}")
        for n, hand, lc, _, _ in rows:
            print(f"{n:>5}  {hand:>21.2f}  {lc:>22.2f}  {lc / hand:>5.2f}x")
        print("\nratio = clusterctl launch / by hand (target <= 1.2x)")
        if own_rows:
            print("\na user's own program: launch until every rank printed its first line, median of "
                  f"{args.repeats}, beside the built-in job's launch to its first step (same run)\n")
            print(f"{'nodes':>5}  {'own, by hand (s)':>17}  {'own, ad hoc launch (s)':>23}  "
                  f"{'built-in launch (s)':>20}  {'own / built-in':>14}")
            for (n, hand, lc), row in zip(own_rows, rows):
                print(f"{n:>5}  {hand:>17.2f}  {lc:>23.2f}  {row[2]:>20.2f}  {lc / row[2]:>13.2f}x")
            print("\ntarget: own / built-in <= 1.10x")
    finally:
        lifecycle.down(state.name, tmp / "lab", purge=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
