"""Fan-out benchmark: one command on a simulated lab of N nodes, clusterctl vs fabric vs pdsh vs an ssh loop.

    .venv/bin/python benchmarks/fanout.py [--nodes 16] [--repeats 7]     (root: it starts a lab; fabric:
                                                                         pip install -e '.[bench]')
    .venv/bin/python benchmarks/fanout.py --cold-start [--before REV] [--repeats 15]

Prints a table (median wall time of several runs, ratios against fabric's ThreadingGroup measured in
the same run) and the numbers for docs/performance.md. Contacts only the lab it starts itself (its own
name and subnet), and removes it at the end. The rows run in turns, one run of each per round after a
warm-up round (which also fills clusterctl's `ssh -G` cache, as a user's first command does), so the
machine's load falls on all of them alike. clusterctl's package is byte-compiled first, as an installed
one is (pip compiles on install; fabric's already is), so no row pays for compiling its sources.

Rows (each command is `true`, on every node, with the lab's key and the known_hosts the lab writes):
  clusterctl exec (cold)   `clusterctl exec INV -- true` as a new process: start, connect, run, exit
  fabric ThreadingGroup    a new process: `fabric.ThreadingGroup(*nodes).run("true", hide=True)`, host keys
                           from that known_hosts and an unknown key refused (paramiko's RejectPolicy)
  pdsh -R ssh              pdsh (Debian package), fan-out 32, same key and known_hosts
  serial ssh loop          OpenSSH `ssh node true`, one node after the other
  library: 1 command       cluster.nodes.fanout.Group in one process: connect all + `true` once
  library: 8 commands      the same, then 7 more `true` on the reused connections (provision's path)

--cold-start (no lab, no root): `python -m cluster --help` and `python -m cluster exec --help` as new
processes, this tree against the package as it was at REV (default: the commit before cluster/cli.py
became the cluster/cli/ package, issue 14), run in turns so that the machine's load falls on both alike.
"""
from __future__ import annotations

import argparse
import compileall
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

from benchmarks.common import lab_parser, print_timing_table  # noqa: E402
from cluster.inventory import loader  # noqa: E402
from cluster.lab import lifecycle  # noqa: E402
from cluster.nodes.fanout import Group  # noqa: E402

FABRIC = "fabric ThreadingGroup (baseline)"
CLI = "clusterctl exec (cold process)"
PDSH = "pdsh -R ssh"
# One fabric command in a process of its own, as `clusterctl exec` is: argv = key known_hosts user node...
FABRIC_RUN = """\
import sys
import fabric
import paramiko

key, known_hosts, user, *nodes = sys.argv[1:]
group = fabric.ThreadingGroup(*nodes, user=user, connect_timeout=5,
                              connect_kwargs={"key_filename": key, "allow_agent": False, "look_for_keys": False})
for c in group:  # fabric's Connection accepts any unknown host key (AutoAddPolicy): refuse it instead
    c.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    c.client.load_host_keys(known_hosts)
results = group.run("true", hide=True)
group.close()
sys.exit(0 if len(results) == len(nodes) and all(r.ok for r in results.values()) else 1)
"""


def check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


LOCAL = str(ROOT / "inventory" / "local.yaml")  # two nodes on this machine, no SSH: the CLI's own cost shows
COLD_COMMANDS = (("clusterctl --help", ["--help"]), ("clusterctl exec --help", ["exec", "--help"]),
                 ("exec -- true (2 local nodes)", ["exec", LOCAL, "--json", "--", "true"]))


def _before_rev() -> str:
    """The parent of the commit that removed cluster/cli.py; HEAD while it is not removed in a commit."""
    gone = subprocess.run(["git", "log", "-1", "--format=%H", "--diff-filter=D", "--", "cluster/cli.py"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
    return f"{gone}^" if gone else "HEAD"


def _export(rev: str, dest: Path) -> None:
    """The package as it was at `rev`, in dest/cluster (what `python -m cluster` imports from cwd=dest)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "cluster"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def _timed(argv: list[str], cwd: Path, env: dict[str, str], what: str) -> float:
    t = time.perf_counter()
    check(subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True), what)
    return time.perf_counter() - t


def cold_start(repeats: int, before: str) -> int:
    """Median and fastest wall time of a fresh `python -m cluster ...`, before and after, as a table."""
    old = Path(tempfile.mkdtemp(prefix="clusterctl-before-"))
    env = {**os.environ, "CLUSTERCTL_HOME": str(old / "home")}  # no current context: nothing but LOCAL
    trees = {"before": old, "after": ROOT}
    times: dict[tuple[str, str], list[float]] = {(t, c): [] for t in trees for c, _ in COLD_COMMANDS}
    floor: list[float] = []  # the interpreter alone, in the same turns
    try:
        _export(before, old)
        for i in range(repeats + 1):  # the first round warms the page cache and is not counted
            took = _timed(["-c", "pass"], ROOT, env, "python -c pass")
            floor += [took] if i else []
            for tree, where in trees.items():
                for label, argv in COLD_COMMANDS:
                    took = _timed(["-m", "cluster", *argv], where, env, f"{label} ({tree})")
                    times[(tree, label)] += [took] if i else []
    finally:
        shutil.rmtree(old, ignore_errors=True)
    _print_cold(times, floor, repeats, before)
    return 0


def _print_cold(times: dict[tuple[str, str], list[float]], floor: list[float], repeats: int, before: str) -> None:
    print(f"\ncold start of a fresh process, {repeats} runs each in turns ({os.cpu_count()} cores; "
          f"before = {before})\n")
    print(f"| {'command':<28} | {'before median s':>15} | {'after median s':>14} | {'after/before':>12} | "
          f"{'before min s':>12} | {'after min s':>11} |")
    print(f"|{'-' * 30}|{'-' * 17}|{'-' * 16}|{'-' * 14}|{'-' * 14}|{'-' * 13}|")
    for label, _ in COLD_COMMANDS:
        b, a = times[("before", label)], times[("after", label)]
        print(f"| {label:<28} | {statistics.median(b):>15.3f} | {statistics.median(a):>14.3f} | "
              f"{statistics.median(a) / statistics.median(b):>12.2f} | {min(b):>12.3f} | {min(a):>11.3f} |")
    print(f"\nthe interpreter alone (python -c pass): median {statistics.median(floor):.3f} s, min {min(floor):.3f} s")


def main() -> int:
    ap = lab_parser(__doc__, "fbench", "10.76.0.0/24", repeats=7)
    ap.add_argument("--cold-start", action="store_true", help="only the CLI's start-up time, before and after")
    ap.add_argument("--before", help="the revision to compare with (default: before cluster/cli/ was split)")
    args = ap.parse_args()
    if args.cold_start:
        return cold_start(args.repeats if args.repeats != 7 else 15, args.before or _before_rev())
    if not shutil.which("pdsh"):
        raise SystemExit("pdsh is not installed: apt-get install pdsh (scripts/setup.sh does)")
    if subprocess.run([sys.executable, "-c", "import fabric"], capture_output=True).returncode != 0:
        raise SystemExit("fabric is not installed: .venv/bin/pip install -e '.[bench]' (the benchmark's extra)")
    _print_fanout(args.nodes, args.repeats, fanout(args))
    return 0


Timings = dict[str, tuple[float, list[float]]]


def in_turns(rows: list[tuple[str, Callable[[], None]]], repeats: int) -> Timings:
    """Each row's median and times: `repeats` rounds of one run per row, the order rotated each round, after
    one warm-up round that is not counted (page cache, sshd's first fork, clusterctl's `ssh -G` cache)."""
    times: dict[str, list[float]] = {name: [] for name, _ in rows}
    for i in range(repeats + 1):
        for name, fn in rows[i % len(rows):] + rows[:i % len(rows)]:
            t = time.perf_counter()
            fn()
            took = time.perf_counter() - t
            times[name] += [took] if i else []
    return {name: (statistics.median(ts), ts) for name, ts in times.items()}


def fanout(args: argparse.Namespace) -> Timings:
    """Each method's median and times on a lab of its own, removed afterwards."""
    home = Path(tempfile.mkdtemp(prefix="clusterctl-bench-"))
    os.environ["CLUSTERCTL_HOME"] = str(home)  # the library rows' inventory load too: no cache outside it
    env = {**os.environ}
    compileall.compile_dir(ROOT / "cluster", quiet=1)
    state = lifecycle.up(args.nodes, name=args.name, subnet=args.subnet, directory=home / "lab")
    try:
        inv = loader.load(state.inventory)
        hosts = list(inv.hosts.values())
        d = Path(state.dir)
        ssh_opts = ["-i", str(d / "id_ed25519"), "-o", f"UserKnownHostsFile={d / 'known_hosts'}",
                    "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
        addrs = [h.address for h in hosts]

        def cli() -> None:
            check(subprocess.run([sys.executable, "-m", "cluster", "exec", state.inventory, "--json", "--", "true"],
                                 capture_output=True, text=True, env=env, cwd=ROOT), "clusterctl exec")

        def ssh_loop() -> None:
            for a in addrs:
                check(subprocess.run(["ssh", *ssh_opts, f"root@{a}", "true"], capture_output=True, text=True),
                      "ssh")

        def fabric() -> None:
            check(subprocess.run([sys.executable, "-c", FABRIC_RUN, str(d / "id_ed25519"), str(d / "known_hosts"),
                                  hosts[0].user, *addrs], capture_output=True, text=True, cwd=d), "fabric")

        def pdsh() -> None:
            penv = {**os.environ, "PDSH_SSH_ARGS": " ".join(ssh_opts) + " -l %u %h", "PDSH_RCMD_TYPE": "ssh"}
            check(subprocess.run(["pdsh", "-R", "ssh", "-f", "32", "-l", "root", "-w", ",".join(addrs), "true"],
                                 capture_output=True, text=True, env=penv), "pdsh")

        def library(n: int) -> Callable[[], None]:
            def run() -> None:
                with Group(hosts) as g:
                    for _ in range(n):
                        r = g.run("true")
                        if not r.ok:
                            raise SystemExit(f"library fan-out failed: {r}")
            return run

        rows = [
            (FABRIC, fabric),
            (CLI, cli),
            (PDSH, pdsh),
            ("serial ssh loop", ssh_loop),
            ("library: connect + 1 command", library(1)),
            ("library: connect + 8 commands", library(8)),
        ]
        return in_turns(rows, args.repeats)
    finally:
        lifecycle.down(args.name, home / "lab")
        shutil.rmtree(home, ignore_errors=True)


def _print_fanout(nodes: int, repeats: int, results: Timings) -> None:
    base = results[FABRIC][0]
    one = results["library: connect + 1 command"][0]
    print(f"\nfan-out of `true` on {nodes} simulated nodes, median of {repeats} runs in turns "
          f"({os.cpu_count()} cores on the head)\n")
    print_timing_table(results, "vs fabric", lambda med: med / base)
    eight = results["library: connect + 8 commands"][0]
    cold = results[CLI][0]
    print(f"\ntarget 1: cold clusterctl exec / fabric = {cold / base:.2f} (target <= 1.00 at 16 nodes, "
          f"<= 1.10 at 64); / pdsh = {cold / results[PDSH][0]:.2f}")
    print(f"target 2: 8 commands in one invocation / one cold clusterctl exec = {eight / cold:.2f} "
          "(target < 1.50 at 16 nodes)")
    print(f"          (stricter: / the library's own connect + 1 command = {eight / one:.2f})")


if __name__ == "__main__":
    raise SystemExit(main())
