"""Does a run that went on without a node end where an uninterrupted one does? Final validation accuracy
of a 3-node `resnet50-ddp` run whose node3 is cut in epoch 2 of 4, against the range of 3 seeds of the
same job uninterrupted on the 3 nodes (the same global batch), in the same sitting.

    .venv/bin/python benchmarks/elastic_accuracy.py [--seeds 0,1,2] [--steps 24] [--out FILE]

A simulated 3-node lab (its own name and subnet, removed at the end), provisioned with `python_env:
existing`. ResNet18 on digits at 32 px, batch 8 per node (global 24), 4 epochs of --steps steps, 1 thread
per process, `min_nodes: 2`. The interrupted run is detached and nobody runs a command until it has ended:
its watcher restarts node1 and node2 from the checkpoint of epoch 1 (each with batch 12). Results are saved
after every run to --out (JSON) and a rerun resumes where it stopped. Prints a Markdown table
(docs/reliability.md). Contacts only the lab it starts.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.lab import lifecycle  # noqa: E402

PY = sys.executable


def ctl(env: dict[str, str], *args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "cluster", *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout)


def job(seed: int, steps: int) -> list[str]:
    return ["--set", "model=resnet18", "--set", "epochs=4", "--set", f"max_steps={steps}", "--set", "threads=1",
            "--set", "batch=8", "--set", "min_nodes=2", "--set", f"seed={seed}", "--set", "log_every=4"]


def rank0(state: lifecycle.LabState, run_id: str) -> list[dict[str, Any]]:
    """Rank 0's records, from every node (a restart may move rank 0), in time order."""
    out = []
    for n in state.nodes:
        f = Path(n.dir) / "srv" / "runs" / run_id / "out" / "metrics-rank0.jsonl"
        if f.exists():
            out += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return sorted(out, key=lambda r: r["time"])


def final_acc(state: lifecycle.LabState, run_id: str) -> tuple[float, float]:
    recs = rank0(state, run_id)
    last = {r["epoch"]: r for r in recs if r["type"] == "epoch"}
    t0 = min(r["time"] for r in recs if r["type"] == "start")
    return last[max(last)]["val_acc"], max(r["time"] for r in recs) - t0


def record(env: dict[str, str], run_id: str) -> dict[str, Any]:
    return json.loads((Path(env["CLUSTERCTL_HOME"]) / "runs" / run_id / "run.json").read_text())


def uninterrupted(env: dict[str, str], state: lifecycle.LabState, seed: int, steps: int) -> dict[str, Any]:
    r = ctl(env, "launch", "resnet50-ddp", *job(seed, steps), "--json")
    rec = json.loads(r.stdout)
    assert rec["state"] == "succeeded", r.stdout[-2000:] + r.stderr[-2000:]
    acc, wall = final_acc(state, rec["run_id"])
    return {"run": f"3 nodes, seed {seed}", "val_acc": acc, "wall_s": wall, "periods": 1}


def interrupted(env: dict[str, str], state: lifecycle.LabState, seed: int, steps: int) -> dict[str, Any]:
    r = ctl(env, "launch", "resnet50-ddp", *job(seed, steps), "--detach", "--json")
    run_id = json.loads(r.stdout)["run_id"]
    deadline = time.time() + 1800
    while not any(x["type"] == "step" and x["epoch"] == 1 for x in rank0(state, run_id)):
        assert time.time() < deadline, "no step in epoch 2"
        time.sleep(0.5)
    subprocess.run(["ip", "link", "set", state.nodes[2].veth, "down"], check=True)
    try:
        while record(env, run_id)["state"] not in ("succeeded", "failed", "stopped"):
            assert time.time() < deadline, "the run did not end"
            time.sleep(2)
    finally:
        subprocess.run(["ip", "link", "set", state.nodes[2].veth, "up"], check=True)
    rec = record(env, run_id)
    assert rec["state"] == "succeeded", rec.get("failure")
    acc, wall = final_acc(state, run_id)
    p2 = rec["periods"][1]
    return {"run": f"node3 cut in epoch 2, seed {seed}", "val_acc": acc, "wall_s": wall, "periods": len(rec["periods"]),
            "restart_s": p2["started"] - rec["dropped"]["node3"]["at"], "from_epoch": p2["from_epoch"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "elastic_accuracy.json"))
    ap.add_argument("--name", default="belastic")
    ap.add_argument("--subnet", default="10.231.7.0/24")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    out = Path(a.out)
    done: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    with tempfile.TemporaryDirectory() as d:
        state = lifecycle.up(3, name=a.name, subnet=a.subnet, directory=Path(d) / "lab")
        try:
            env = {"CLUSTERCTL_HOME": str(Path(d) / "home")}
            r = ctl(env, "provision", state.inventory, "--set", f"python={PY}", "--set", "vars.python_env=existing",
                    "--json")
            assert r.returncode == 0, r.stdout[-2000:]
            for key, fn in [*((f"seed{s}", lambda s=s: uninterrupted(env, state, s, a.steps)) for s in seeds),
                            ("cut", lambda: interrupted(env, state, seeds[0], a.steps))]:
                if key in done:
                    continue
                done[key] = fn()
                out.write_text(json.dumps(done, indent=1))
                print(f"{key}: {done[key]}", flush=True)
        finally:
            lifecycle.down(state.name, Path(d) / "lab")
    accs = [done[f"seed{s}"]["val_acc"] for s in seeds]
    print("\n| run | final val acc | wall s | periods |\n|---|---|---|---|")
    for v in done.values():
        print(f"| {v['run']} | {v['val_acc']:.4f} | {v['wall_s']:.0f} | {v['periods']} |")
    cut = done["cut"]["val_acc"]
    print(f"\nrange of {len(seeds)} seeds: {min(accs):.4f}-{max(accs):.4f}; interrupted {cut:.4f}: "
          f"{'within' if min(accs) <= cut <= max(accs) else 'OUTSIDE'} the range")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
