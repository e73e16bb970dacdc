"""First provision of a room: head push vs peer relay over one shared uplink, and what makes training start soonest.

    .venv/bin/python benchmarks/provision_first.py [--parts distribution,first-import,install]
        [--sizes 1,4,8] [--rates 1gbit:1024,200mbit:256]

Run it under the lab lock (`flock /tmp/team/lab.lock ...`) on a shared machine. Every figure is printed with
the load average of the machine while it was measured, and each distribution with the machine's CPU use
(/proc/stat, all cores, sampled every 0.5 s), so a figure limited by this machine's CPU shows it, and with
the CPU seconds it cost: divided by the cores, the shortest wall time this machine allows it, whatever the
design (in a real room each node brings its own CPU; here 8 nodes share the head's).

distribution: for each RATE:MIB of --rates, one lab of max(--sizes) nodes, every link `--bandwidth RATE`
and the head's side `--uplink RATE` shared by all nodes. For each size N the first N nodes get a stand-in
wheel set of MIB MiB from scratch, once by head push (`distribute: push`), once by relay. The stand-in set:
the largest wheels of the real framework wheelhouse that fit in MIB, then every smaller one that still fits
(big and small files, like the real thing; 1 GiB keeps 8 copies on this machine's disk).

first-import: one node, the full framework wheelhouse (hard links to the head's cache, no transfer), three
fresh venvs one after the other: uv with `--compile-bytecode`, uv without (Python compiles each module at its
first import), pip (compiles everything, its default). For each: the install's wall and CPU time, then the
first and the second `import torch, torchvision` in a new interpreter, then the environment fingerprint
(envcheck.py, which must be the same for all three) and whether the verification stamp stays put after a
training-like import.

install: the full wheelhouse on 2 nodes with `clusterctl provision` (relay, uv, verification), then the
same wheels into a fresh venv on both nodes with pip, both nodes at once, and a copy of the installed tree
(pure disk writes, for the CPU/disk split).

Contacts only the labs it starts (their own names and subnets); removes them, and their files, at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jinja2  # noqa: E402

from cluster.provision import wheelhouse  # noqa: E402
from cluster.provision import apply, compat
from cluster.relay import distribute as relay
from cluster.lab import lifecycle
from cluster.inventory import loader
from cluster.nodes.fanout import Group  # noqa: E402

FP_KEYS = ("python", "torch", "torchvision", "tensorflow", "numpy", "gloo")
FIRST_IMPORT = "import torch, torchvision"
TRAINING_IMPORT = "import torch, torchvision, torch.distributed, torch.nn.parallel; torchvision.models.resnet50()"


def load() -> str:
    return "load %.1f" % os.getloadavg()[0]


class CpuSampler:
    """The whole machine's CPU use from /proc/stat while a block runs: busy share of all cores."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.loads: list[float] = []
        self.busy_s = 0.0  # CPU seconds, all cores: the work the block cost, whatever the wall time
        self._stop = threading.Event()

    @staticmethod
    def _read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + v[4]  # idle + iowait
        return sum(v[:8]) - idle, sum(v[:8])

    def _run(self) -> None:
        prev = self._read()
        while not self._stop.wait(0.5):
            cur = self._read()
            busy, total = cur[0] - prev[0], cur[1] - prev[1]
            self.samples.append(busy / total if total else 0.0)
            self.busy_s += busy / os.sysconf("SC_CLK_TCK")
            self.loads.append(os.getloadavg()[0])
            prev = cur

    @contextmanager
    def measure(self) -> Iterator[CpuSampler]:
        self.samples, self.loads, self.busy_s = [], [], 0.0
        self._stop.clear()
        th = threading.Thread(target=self._run, daemon=True)
        th.start()
        try:
            yield self
        finally:
            self._stop.set()
            th.join(timeout=5)

    def summary(self) -> dict[str, float]:
        s = sorted(self.samples) or [0.0]
        return {"cpu_mean": round(sum(s) / len(s), 3), "cpu_p90": round(s[int(0.9 * (len(s) - 1))], 3),
                "saturated": round(sum(x > 0.95 for x in s) / len(s), 3), "cpu_s": round(self.busy_s, 1),
                "load": round(sum(self.loads) / len(self.loads), 1) if self.loads else os.getloadavg()[0]}


def standin(wh: wheelhouse.Wheelhouse, mib: int) -> dict[str, dict[str, Any]]:
    budget, chosen = mib << 20, {}
    for name, meta in sorted(wh.files.items(), key=lambda kv: -int(kv[1]["size"])):
        if int(meta["size"]) <= budget:
            chosen[name] = meta
            budget -= int(meta["size"])
    return chosen


def distribution(state: lifecycle.LabState, wh: wheelhouse.Wheelhouse, files: dict[str, Any], sizes: list[int],
                 rate: str) -> list[dict[str, Any]]:
    hosts = list(loader.load(state.inventory).hosts.values())
    items = relay.items(wh.dir, files)
    rows, sampler = [], CpuSampler()
    for n in sizes:
        for mode in ("push", "relay"):
            for node in state.nodes:
                shutil.rmtree(Path(node.dir) / "srv" / "standin", ignore_errors=True)
            subprocess.run(["sync"], timeout=600)
            hs = hosts[:n]
            got: dict[str, int] = {}
            # the CLI's progress callback, so the head's polling is part of the figure
            with Group(hs) as g, sampler.measure():
                t = time.monotonic()
                plan, res = relay.distribute(g, hs, items, {h.name: "/srv/cluster/standin" for h in hs}, mode=mode,
                                             progress=lambda node, k: got.__setitem__(node, got.get(node, 0) + k))
                wall = time.monotonic() - t
            bad = {k: r.error for k, r in res.items() if not r.ok}
            if bad:
                raise SystemExit(f"{mode} to {n} nodes failed: {bad}")
            head = sum(r.value.from_head for r in res.values())
            rows.append({"rate": rate, "nodes": n, "mode": mode, "seconds": round(wall, 1), "head_bytes": head,
                         "bytes_per_node": plan.nbytes(hs[0].name), "progress_bytes": got, **sampler.summary()})
            print(f"  {rate} {mode:5} to {n} nodes: {wall:6.1f} s, the head sent {head / 2**30:.2f} GiB, "
                  f"{json.dumps(sampler.summary())}", file=sys.stderr)
    return rows


def node_sh(state: lifecycle.LabState, node: str, cmd: str, timeout: float = 3600) -> str:
    """A command in the node's namespaces (its /srv/cluster): through its sshd, as clusterctl would."""
    inv = loader.load(state.inventory)
    with Group([inv.hosts[node]]) as g:
        r = g.run(cmd, timeout=timeout)[node]
    if not r.ok:
        raise SystemExit(f"{node}: {cmd[:80]}... failed: {r.error or r.stderr[-2000:]}")
    return r.stdout


def fingerprint(state: lifecycle.LabState, node: str) -> dict[str, Any]:
    out = node_sh(state, node, "/srv/cluster/venv/bin/python /srv/cluster/clusterctl/envcheck.py", 900)
    fp = json.loads(out.strip().splitlines()[-1])
    return {k: fp.get(k) for k in FP_KEYS}


TIMED = ("import json,resource,subprocess,sys,time; t=time.monotonic(); rc=subprocess.call(sys.argv[1:]); "
         "ru=resource.getrusage(resource.RUSAGE_CHILDREN); print(json.dumps({'exit': rc, "
         "'wall_s': round(time.monotonic()-t, 2), 'cpu_s': round(ru.ru_utime+ru.ru_stime, 2)}))")


def timed_python(state: lifecycle.LabState, node: str, *argv: str) -> dict[str, Any]:
    """A new interpreter of the node's venv with `argv`: wall and CPU time measured on the node, and the
    last line it printed (`out`)."""
    cmd = f"python3 -c {shlex.quote(TIMED)} /srv/cluster/venv/bin/python {' '.join(shlex.quote(a) for a in argv)}"
    lines = node_sh(state, node, cmd, 1800).strip().splitlines()
    doc: dict[str, Any] = json.loads(lines[-1])
    if doc["exit"] != 0:
        raise SystemExit(f"{node}: {argv} exited {doc['exit']}")
    doc["out"] = lines[-2] if len(lines) > 1 else ""
    return doc


def install_script(wheel_dir: str) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["q"] = shlex.quote
    src = (ROOT / "templates" / "install_wheels.sh.j2").read_text()
    return env.from_string(src).render(venv="/srv/cluster/venv", wheel_dir=wheel_dir,
                                       host={"workdir": "/srv/cluster"})


def first_import_variant(state: lifecycle.LabState, node: str, env: str) -> dict[str, Any]:
    """A fresh venv, the install (install.json), two imports, the fingerprint and the stamp's stability."""
    node_sh(state, node, "rm -rf /srv/cluster/venv && python3 -m venv /srv/cluster/venv && "
            f"{env} sh /srv/cluster/clusterctl/install_wheels.sh install", 7200)
    doc: dict[str, Any] = {"install": json.loads(node_sh(state, node, "cat /srv/cluster/clusterctl/install.json")),
                           "load_install": load()}
    doc["first_import"] = timed_python(state, node, "-c", FIRST_IMPORT)
    doc["second_import"] = timed_python(state, node, "-c", FIRST_IMPORT)
    # provision's verification: envcheck imports torch, torchvision and tensorflow (the first import of TF)
    check = timed_python(state, node, "/srv/cluster/clusterctl/envcheck.py")
    doc["envcheck"] = {k: check[k] for k in ("wall_s", "cpu_s")}
    doc["load_import"] = load()
    doc["fingerprint"] = {k: json.loads(check["out"]).get(k) for k in FP_KEYS}
    purelib = "$(ls -d /srv/cluster/venv/lib/python3*/site-packages)"
    stamp = apply.stamp_command("PURELIB").replace("PURELIB", purelib)
    before = node_sh(state, node, stamp).split()[0]
    timed_python(state, node, "-c", TRAINING_IMPORT)
    doc["stamp_stable"] = node_sh(state, node, stamp).split()[0] == before
    doc["pyc_files"] = int(node_sh(state, node, "find /srv/cluster/venv -name '*.pyc' | wc -l").strip())
    return doc


VARIANTS = (("uv, --compile-bytecode", "CLUSTERCTL_BYTECODE=compile"),
            ("uv, compiled at first import", "CLUSTERCTL_BYTECODE=lazy"),
            ("pip (compiles everything)", "CLUSTERCTL_INSTALLER=pip"))


def first_import(wh: wheelhouse.Wheelhouse, tmp: Path, subnet: str) -> dict[str, Any]:
    """One node, the full wheelhouse hard-linked into its /srv/cluster/wheels: the three ways, in turn."""
    state = lifecycle.up(1, name="pfimp", subnet=subnet, directory=tmp / "lab-imp")
    try:
        node = state.nodes[0]
        srv = Path(node.dir) / "srv"
        (srv / "wheels").mkdir(parents=True)
        for name in wh.files:
            try:
                os.link(wh.dir / name, srv / "wheels" / name)
            except OSError:  # another filesystem
                shutil.copy(wh.dir / name, srv / "wheels" / name)
        (srv / "wheels" / "requirements.lock").write_text(wh.lock_text)
        (srv / "clusterctl").mkdir(exist_ok=True)
        (srv / "clusterctl" / "install_wheels.sh").write_text(install_script("/srv/cluster/wheels"))
        shutil.copy(ROOT / "cluster" / "agent" / "envcheck.py", srv / "clusterctl" / "envcheck.py")
        node_sh(state, node.name, "cat /srv/cluster/wheels/* > /dev/null")  # every variant starts warm
        out = {}
        for label, env in VARIANTS:
            out[label] = first_import_variant(state, node.name, env)
            print(f"  {label}: {json.dumps(out[label])}", file=sys.stderr)
        return out
    finally:
        lifecycle.down(state.name, tmp / "lab-imp")


def install(state: lifecycle.LabState, env: dict[str, str]) -> dict[str, Any]:
    """`clusterctl provision` (uv) on 2 nodes, then pip into fresh venvs, then a copy of the tree (disk)."""
    nodes = [n.name for n in state.nodes[:2]]
    inv = str(state.inventory)
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "cluster", "provision", inv, "--limit", ",".join(nodes), "--json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=7200)
    first = time.monotonic() - t
    rep = json.loads(r.stdout)
    if r.returncode != 0:
        raise SystemExit(f"provision failed ({r.returncode}): {json.dumps(rep)[-3000:]}")
    steps = {n["host"]: {s["name"]: s["duration"] for s in n["steps"]} for n in rep["nodes"]}
    record = "cat /srv/cluster/clusterctl/install.json"
    uv = {n: json.loads(node_sh(state, n, record)) for n in nodes}
    fp_uv = {n: fingerprint(state, n) for n in nodes}
    hosts = [loader.load(inv).hosts[n] for n in nodes]
    with Group(hosts) as g:  # the same wheels with pip, both nodes at once, into a fresh venv each
        res = g.run("rm -rf /srv/cluster/venv && python3 -m venv /srv/cluster/venv && "
                    "CLUSTERCTL_INSTALLER=pip sh /srv/cluster/clusterctl/install_wheels.sh install", timeout=7200)
    if not all(x.ok for x in res.values()):
        raise SystemExit(f"pip install failed: {[x.stderr[-1000:] for x in res.values()]}")
    pip = {n: json.loads(node_sh(state, n, record)) for n in nodes}
    fp_pip = {n: fingerprint(state, n) for n in nodes}
    with Group(hosts) as g:  # the installed tree copied: same files and bytes, no unpacking, no compiling
        t = time.monotonic()
        cp = g.run("sp=$(ls -d /srv/cluster/venv/lib/python3*/site-packages) && rm -rf /srv/cluster/cpcheck && "
                   "cp -a \"$sp\" /srv/cluster/cpcheck && sync && du -sb /srv/cluster/cpcheck | cut -f1 && "
                   "rm -rf /srv/cluster/cpcheck", timeout=3600)
        copy_s = time.monotonic() - t
    return {"first_provision_s": round(first, 1), "steps": steps, "uv": uv, "pip": pip, "fingerprint_uv": fp_uv,
            "fingerprint_pip": fp_pip, "copy_s": round(copy_s, 1), "tree_bytes": int(cp[nodes[0]].stdout.split()[0]),
            "load": load()}


def print_distribution(rows: list[dict[str, Any]], sets: dict[str, tuple[int, int]], sizes: list[int]) -> None:
    for rate, (count, total) in sets.items():
        print(f"\nDistribution of a stand-in wheel set ({count} wheels, {total / 2**20:.0f} MiB) over a {rate} "
              f"uplink, {rate} links, {os.cpu_count()} cores shared by head and nodes (and other users)\n")
        print("| nodes | head push | peer relay | push vs 1 node | relay vs 1 node | head sent (relay) "
              "| CPU busy, push (mean, p90, time at >95%) | CPU busy, relay | load avg (push, relay) "
              "| relay's CPU s (all cores) | its floor on this machine: CPU s / cores, vs 1 node |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        pick = {(r["nodes"], r["mode"]): r for r in rows if r["rate"] == rate}
        base = {m: pick[(sizes[0], m)]["seconds"] for m in ("push", "relay")}
        for n in sizes:
            p, q = pick[(n, "push")], pick[(n, "relay")]
            cpu = ["%.0f%%, %.0f%%, %.0f%%" % (100 * x["cpu_mean"], 100 * x["cpu_p90"], 100 * x["saturated"])
                   for x in (p, q)]
            print(f"| {n} | {p['seconds']:.1f} s | {q['seconds']:.1f} s | {p['seconds'] / base['push']:.2f}x | "
                  f"{q['seconds'] / base['relay']:.2f}x | {q['head_bytes'] / 2**20:.0f} MiB | {cpu[0]} | {cpu[1]} | "
                  f"{p['load']}, {q['load']} | {q['cpu_s']:.1f} | "
                  f"{q['cpu_s'] / (os.cpu_count() or 1) / base['relay']:.2f}x |")


def print_first_import(res: dict[str, Any]) -> None:
    print("\nFull wheelhouse on one node, three fresh venvs in turn: install, then `import torch, torchvision`\n")
    print("| installer | install wall | install CPU | 1st import wall | 1st import CPU | install + 1st import "
          "| 2nd import | envcheck (1st TF import) | install + 1st import + envcheck | .pyc files "
          "| stamp stable after a training import | load avg (install, import) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, d in res.items():
        i, f, s, e = d["install"], d["first_import"], d["second_import"], d["envcheck"]
        print(f"| {label} ({i['installer']}) | {i['wall_s']:.1f} s | {i['user_s'] + i['sys_s']:.1f} s | "
              f"{f['wall_s']:.1f} s | {f['cpu_s']:.1f} s | {i['wall_s'] + f['wall_s']:.1f} s | {s['wall_s']:.1f} s | "
              f"{e['wall_s']:.1f} s | {i['wall_s'] + f['wall_s'] + e['wall_s']:.1f} s | {d['pyc_files']} | "
              f"{d['stamp_stable']} | {d['load_install']}, {d['load_import']} |")
    fps = [json.dumps(d["fingerprint"], sort_keys=True) for d in res.values()]
    print(f"\nfingerprints equal ({', '.join(FP_KEYS)}): {len(set(fps)) == 1}")
    if len(set(fps)) != 1:
        print("\n".join(fps))


def print_install(inst: dict[str, Any], wh: wheelhouse.Wheelhouse) -> None:
    print(f"\nInstall of the full wheelhouse ({len(wh.files)} wheels, {wh.total_bytes / 2**30:.2f} GiB) on 2 nodes "
          f"at once; installed tree {inst['tree_bytes'] / 2**30:.2f} GiB per node; {inst['load']}\n")
    print("| node | installer | wall | CPU (user+sys) | CPU / wall | written |")
    print("|---|---|---|---|---|---|")
    for n in sorted(inst["uv"]):
        for k in ("uv", "pip"):
            d = inst[k][n]
            cpu = d["user_s"] + d["sys_s"]
            print(f"| {n} | {d['installer']} | {d['wall_s']:.1f} s | {cpu:.1f} s | {cpu / d['wall_s']:.2f} | "
                  f"{d['written_bytes'] / 2**30:.2f} GiB |")
    print(f"copying the installed tree (pure disk writes, both nodes at once): {inst['copy_s']:.1f} s")
    print(f"fingerprints equal: {inst['fingerprint_uv'] == inst['fingerprint_pip']}; first provision of 2 nodes: "
          f"{inst['first_provision_s']:.1f} s; steps: {json.dumps(inst['steps'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--parts", default="distribution,first-import", help="of distribution,first-import,install")
    ap.add_argument("--sizes", default="1,4,8")
    ap.add_argument("--rates", default="1gbit:1024,200mbit:256", help="RATE:MIB,...: a lab per rate, its stand-in set")
    ap.add_argument("--name", default="pfirst")
    ap.add_argument("--subnet", default="10.74.0.0/24")
    args = ap.parse_args()
    parts, sizes = args.parts.split(","), [int(x) for x in args.sizes.split(",")]
    build = compat.build_plan([compat.node_options("x", [])], torch_index=None).builds["x"]
    print("the framework wheelhouse (downloaded once into the head's cache)", file=sys.stderr)
    wh = wheelhouse.build(build.requirements() + list(apply.EXTRA_PACKAGES), "3.11",
                          log=lambda s: print(s, file=sys.stderr))
    tmp = Path(tempfile.mkdtemp(prefix="clusterctl-pfirst-"))
    rows: list[dict[str, Any]] = []
    sets: dict[str, tuple[int, int]] = {}
    imports = inst = None
    try:
        if "first-import" in parts:
            imports = first_import(wh, tmp, args.subnet.replace(".0.0/", ".1.0/"))
        for k, spec in enumerate(args.rates.split(",") if "distribution" in parts else []):
            rate, mib = spec.split(":")
            files = standin(wh, int(mib))
            sets[rate] = (len(files), sum(int(m["size"]) for m in files.values()))
            print(f"{rate}: stand-in set of {sets[rate][0]} wheels, {sets[rate][1] / 2**20:.0f} MiB: "
                  f"{', '.join(sorted(files))}", file=sys.stderr)
            # a lab of its own per rate (name, subnet, keys): nothing of the previous one is reused
            state = lifecycle.up(max(sizes), name=f"{args.name[:6]}{k}", subnet=args.subnet.replace(".0.0/", f".{10 + k}.0/"),
                           directory=tmp / f"lab{k}", bandwidth=rate, uplink=rate)
            try:
                rows += distribution(state, wh, files, sizes, rate)
            finally:
                lifecycle.down(state.name, tmp / f"lab{k}")
                shutil.rmtree(tmp / f"lab{k}", ignore_errors=True)
        if "install" in parts:
            env = {**os.environ, "CLUSTERCTL_HOME": str(tmp / "home"),
                   "CLUSTERCTL_WHEELHOUSE": str(wheelhouse.cache_dir())}
            state = lifecycle.up(2, name=args.name, subnet=args.subnet, directory=tmp / "lab", bandwidth="1gbit",
                           uplink="1gbit")
            try:
                inst = install(state, env)
            finally:
                lifecycle.down(state.name, tmp / "lab")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"distribution": rows, "first_import": imports, "install": inst}), file=sys.stderr)
    if rows:
        print_distribution(rows, sets, sizes)
    if imports:
        print_first_import(imports)
    if inst:
        print_install(inst, wh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
