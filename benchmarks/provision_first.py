"""First provision of a room: head push vs peer relay over one 1 GbE uplink, and uv vs pip installs.

    .venv/bin/python benchmarks/provision_first.py [--sizes 1,4,8] [--standin-mib 1024] [--skip-install]

Part 1, distribution: one lab of max(--sizes) nodes, every link 1 Gbit/s (`--bandwidth 1gbit`) and the
head's side shaped to 1 Gbit/s shared by all nodes (`--uplink 1gbit`). For each size N the first N nodes
get the stand-in wheel set from scratch, once by head push (`distribute: push`), once by relay. The
stand-in set: the largest wheels of the real framework wheelhouse that fit in --standin-mib MiB, then every
smaller one that still fits (big and small files, like the real thing; 1 GiB keeps 8 copies on this
machine's disk). Part 2, install: the full framework wheelhouse (~3.8 GB) on 2 nodes, both installing at
once as provision does: `clusterctl provision` (uv), then the same wheels into a fresh venv with pip;
wall time, CPU time (user + system of the installer and its children), bytes written, the environment
fingerprint of both (must be equal), and a copy of the installed tree (pure disk writes, for the split).

Contacts only the lab it starts (its own name and subnet); removes it, and its files, at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster import compat, inventory, lab, provision, relay, wheelhouse  # noqa: E402
from cluster.fanout import Group  # noqa: E402

FP_KEYS = ("python", "torch", "torchvision", "tensorflow", "numpy", "gloo")


def standin(wh: wheelhouse.Wheelhouse, mib: int) -> dict[str, dict]:
    budget, chosen = mib << 20, {}
    for name, meta in sorted(wh.files.items(), key=lambda kv: -int(kv[1]["size"])):
        if int(meta["size"]) <= budget:
            chosen[name] = meta
            budget -= int(meta["size"])
    return chosen


def distribution(state: lab.LabState, wh: wheelhouse.Wheelhouse, files: dict, sizes: list[int]) -> list[dict]:
    hosts = list(inventory.load(state.inventory).hosts.values())
    items = relay.items(wh.dir, files)
    rows = []
    for n in sizes:
        for mode in ("push", "relay"):
            for node in state.nodes:
                shutil.rmtree(Path(node.dir) / "srv" / "standin", ignore_errors=True)
            subprocess.run(["sync"], timeout=600)
            hs = hosts[:n]
            with Group(hs) as g:
                t = time.monotonic()
                plan, res = relay.distribute(g, hs, items, {h.name: "/srv/cluster/standin" for h in hs}, mode=mode)
                wall = time.monotonic() - t
            bad = {k: r.error for k, r in res.items() if not r.ok}
            if bad:
                raise SystemExit(f"{mode} to {n} nodes failed: {bad}")
            head = sum(r.value.from_head for r in res.values())
            rows.append({"nodes": n, "mode": mode, "seconds": round(wall, 1), "head_bytes": head,
                         "bytes_per_node": plan.nbytes(hs[0].name)})
            print(f"  {mode:5} to {n} nodes: {wall:6.1f} s, the head sent {head / 2**30:.2f} GiB", file=sys.stderr)
    return rows


def node_sh(state: lab.LabState, node: str, cmd: str, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    """A command in the node's namespaces (its /srv/cluster): through its sshd, as clusterctl would."""
    inv = inventory.load(state.inventory)
    with Group([inv.hosts[node]]) as g:
        r = g.run(cmd, timeout=timeout)[node]
    if not r.ok:
        raise SystemExit(f"{node}: {cmd[:80]}... failed: {r.error or r.stderr[-2000:]}")
    return subprocess.CompletedProcess(cmd, 0, r.stdout, r.stderr)


def fingerprint(state: lab.LabState, node: str) -> dict:
    out = node_sh(state, node, "/srv/cluster/venv/bin/python /srv/cluster/clusterctl/envcheck.py", 900).stdout
    fp = json.loads(out.strip().splitlines()[-1])
    return {k: fp.get(k) for k in FP_KEYS}


def install(state: lab.LabState, env: dict[str, str], home: Path) -> dict:
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
    uv = {n: json.loads(node_sh(state, n, "cat /srv/cluster/clusterctl/install.json").stdout) for n in nodes}
    fp_uv = {n: fingerprint(state, n) for n in nodes}

    # the same wheels with pip, both nodes at once, into a fresh venv each
    script = ("rm -rf /srv/cluster/venv && python3 -m venv /srv/cluster/venv && "
              "CLUSTERCTL_INSTALLER=pip sh /srv/cluster/clusterctl/install_wheels.sh install")
    hosts = [inventory.load(inv).hosts[n] for n in nodes]
    with Group(hosts) as g:
        res = g.run(script, timeout=7200)
    if not all(x.ok for x in res.values()):
        raise SystemExit(f"pip install failed: {[x.stderr[-1000:] for x in res.values()]}")
    pip = {n: json.loads(node_sh(state, n, "cat /srv/cluster/clusterctl/install.json").stdout) for n in nodes}
    fp_pip = {n: fingerprint(state, n) for n in nodes}

    # the disk part: the installed tree copied (same files, same bytes, no unpacking, no compiling), 2 at once
    with Group(hosts) as g:
        t = time.monotonic()
        cp = g.run("sp=$(ls -d /srv/cluster/venv/lib/python3*/site-packages) && rm -rf /srv/cluster/cpcheck && "
                   "cp -a \"$sp\" /srv/cluster/cpcheck && sync && du -sb /srv/cluster/cpcheck | cut -f1 && "
                   "rm -rf /srv/cluster/cpcheck", timeout=3600)
        copy_s = time.monotonic() - t
    tree = int(cp[nodes[0]].stdout.split()[0])
    return {"first_provision_s": round(first, 1), "steps": steps, "uv": uv, "pip": pip,
            "fingerprint_uv": fp_uv, "fingerprint_pip": fp_pip, "copy_s": round(copy_s, 1), "tree_bytes": tree}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,8")
    ap.add_argument("--standin-mib", type=int, default=1024)
    ap.add_argument("--skip-install", action="store_true", help="only the distribution part")
    ap.add_argument("--name", default="pfirst")
    ap.add_argument("--subnet", default="10.74.0.0/24")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]

    build = compat.build_plan([compat.node_options("x", [])], torch_index=None).builds["x"]
    reqs = build.requirements() + list(provision.EXTRA_PACKAGES)
    print("the framework wheelhouse (downloaded once into the head's cache)", file=sys.stderr)
    wh = wheelhouse.build(reqs, "3.11", log=lambda s: print(s, file=sys.stderr))
    files = standin(wh, args.standin_mib)
    total = sum(int(m["size"]) for m in files.values())
    print(f"stand-in set: {len(files)} of {len(wh.files)} wheels, {total / 2**20:.0f} MiB", file=sys.stderr)

    tmp = Path(tempfile.mkdtemp(prefix="clusterctl-pfirst-"))
    env = {**os.environ, "CLUSTERCTL_HOME": str(tmp / "home"), "CLUSTERCTL_WHEELHOUSE": str(wheelhouse.cache_dir())}
    state = lab.up(max(sizes), name=args.name, subnet=args.subnet, directory=tmp / "lab", bandwidth="1gbit",
                   uplink="1gbit")
    try:
        rows = distribution(state, wh, files, sizes)
        for node in state.nodes:
            shutil.rmtree(Path(node.dir) / "srv" / "standin", ignore_errors=True)
        inst = None if args.skip_install else install(state, env, tmp / "home")
    finally:
        lab.down(state.name, tmp / "lab")
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nDistribution of the stand-in wheel set ({len(files)} wheels, {total / 2**20:.0f} MiB) over a "
          f"1 Gbit/s uplink, 1 Gbit/s links, {os.cpu_count()} cores shared by head and nodes\n")
    print("| nodes | head push | peer relay | relay / push | push vs 1 node | relay vs 1 node | head sent (relay) |")
    print("|---|---|---|---|---|---|---|")
    base = {m: next(r["seconds"] for r in rows if r["nodes"] == sizes[0] and r["mode"] == m) for m in ("push", "relay")}
    for n in sizes:
        p = next(r for r in rows if r["nodes"] == n and r["mode"] == "push")
        q = next(r for r in rows if r["nodes"] == n and r["mode"] == "relay")
        print(f"| {n} | {p['seconds']:.1f} s | {q['seconds']:.1f} s | {q['seconds'] / p['seconds']:.2f} | "
              f"{p['seconds'] / base['push']:.2f}x | {q['seconds'] / base['relay']:.2f}x | "
              f"{q['head_bytes'] / 2**20:.0f} MiB |")
    if inst:
        print(f"\nInstall of the full wheelhouse ({len(wh.files)} wheels, {wh.total_bytes / 2**30:.2f} GiB) on 2 nodes "
              f"at once; installed tree {inst['tree_bytes'] / 2**30:.2f} GiB per node\n")
        print("| node | installer | wall | CPU (user+sys) | CPU / wall | written |")
        print("|---|---|---|---|---|---|")
        for n in sorted(inst["uv"]):
            for k in ("uv", "pip"):
                d = inst[k][n]
                cpu = d["user_s"] + d["sys_s"]
                print(f"| {n} | {d['installer']} | {d['wall_s']:.1f} s | {cpu:.1f} s | {cpu / d['wall_s']:.2f} | "
                      f"{d['written_bytes'] / 2**30:.2f} GiB |")
        uv_w = max(inst["uv"][n]["wall_s"] for n in inst["uv"])
        pip_w = max(inst["pip"][n]["wall_s"] for n in inst["pip"])
        print(f"\nuv / pip (slowest node): {uv_w:.1f} s / {pip_w:.1f} s = {uv_w / pip_w:.2f}")
        print(f"copying the installed tree (pure disk writes, both nodes at once): {inst['copy_s']:.1f} s")
        same = inst["fingerprint_uv"] == inst["fingerprint_pip"]
        print(f"fingerprints equal (uv vs pip, {', '.join(FP_KEYS)}): {same}")
        print(f"first provision of 2 nodes (clusterctl provision, relay + uv + verification): "
              f"{inst['first_provision_s']:.1f} s; steps: {json.dumps(inst['steps'])}")
        if not same:
            print(json.dumps({"uv": inst["fingerprint_uv"], "pip": inst["fingerprint_pip"]}, indent=1))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
