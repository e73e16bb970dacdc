"""PowerSGD's wire, float32 against bfloat16, and one node, in turns on the same lab in the same minutes.

    .venv/bin/python benchmarks/wire_ab.py [--rounds 3] [--steps 40] [--bandwidth 34.8mbit]

to_accuracy.py compares runs made minutes apart; on a shared machine whose speed drifts (its 1-node runs
measured 30-44% below bench in one night) that moves the ratios. Here each round runs the three back to
back: one node plain, 4 nodes with PowerSGD r4 from the first step on a float32 wire, the same on a
bfloat16 wire (`powersgd_wire`), each one epoch of --steps steps of 32 per node (digits-aug, ResNet18,
threads 1, as to_accuracy's runs), on the emulated room (4 nodes at half a core, links at --bandwidth).
The figure is the epoch record's images/s (the steps only, no epoch end, no start-up); the table gives each
round's figures and ratios (to one node, between the wires, within the round), then the medians of both. Not a
test; contacts only the lab it starts and removes it at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.plan import ctl  # noqa: E402
from benchmarks.to_accuracy import rank0, run  # noqa: E402
from cluster.lab import lifecycle  # noqa: E402

PY = sys.executable
PSGD = ["--set", "grad_compression=powersgd", "--set", "powersgd_rank=4", "--set", "powersgd_start_step=1"]
CONFIGS = {"1 node": ["--set", "nodes=[node1]"],
           "4 x psgd f32": PSGD,
           "4 x psgd bf16": [*PSGD, "--set", "powersgd_wire=bfloat16"]}


def ratios(row: dict[str, float]) -> list[float]:
    """Within one round: each wire to one node, then bfloat16 to float32."""
    one, f32, b16 = (row[n] for n in CONFIGS)
    return [f32 / one, b16 / one, b16 / f32]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="steps of the one epoch each run trains")
    ap.add_argument("--bandwidth", default="34.8mbit")
    ap.add_argument("--cpu-quota", type=float, default=0.5)
    ap.add_argument("--save", type=Path, help="write the figures (runs.json) here")
    ap.add_argument("--name", default="wireab")
    ap.add_argument("--subnet", default="10.234.0.0/24")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="clusterctl-wireab-"))
    env = {**os.environ, "CLUSTERCTL_HOME": str(tmp / "home")}
    common = ["batch=32", "threads=1", "dataset.name=digits-aug", "log_every=1000", "collective_timeout_s=600",
              "model=resnet18", "bn_recompute=512", "epochs=1", f"max_steps={a.steps}", "seed=0"]
    sets = [x for s in common for x in ("--set", s)]
    state = lifecycle.up(4, name=a.name, subnet=a.subnet, directory=tmp / "lab", bandwidth=a.bandwidth,
                         cpu_quotas=[a.cpu_quota] * 4)
    rows: list[dict[str, float]] = []
    try:
        ctl(env, "provision", state.inventory, "--set", f"python={PY}", "--set", "vars.python_env=existing")
        for r in range(a.rounds):
            row = {}
            for name, extra in CONFIGS.items():
                got = run(env, state, ["resnet18-ddp", *sets, *extra], None, 1)
                epoch = next(x for x in rank0(state, got["run_id"]) if x["type"] == "epoch")
                row[name] = float(epoch["images_per_s"])
                row[name + " load"] = got["host_load"]
                print(f"round {r}: {name}: {row[name]:.1f} images/s (host load {got['host_load']})",
                      file=sys.stderr)
            rows.append(row)
            if a.save:
                a.save.mkdir(parents=True, exist_ok=True)
                (a.save / "runs.json").write_text(json.dumps(rows, indent=1))
    finally:
        lifecycle.down(state.name, tmp / "lab", purge=True)
        shutil.rmtree(tmp, ignore_errors=True)
    names = list(CONFIGS)
    print(f"ResNet18 on digits-aug, {a.steps} steps of 32 a node, 4 nodes at {a.cpu_quota} core, links {a.bandwidth}; "
          "images/s of the steps, each round's three runs back to back\n")
    print("| round | " + " | ".join(names) + " | f32 / 1 node | bf16 / 1 node | bf16 / f32 |")
    print("|---:|" + "---:|" * (len(names) + 3))
    for i, row in enumerate(rows):
        print(f"| {i} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " | "
              + " | ".join(f"{x:.2f}x" for x in ratios(row)) + " |")
    med = [statistics.median(r[n] for r in rows) for n in names]  # the ratios: each round's, their median
    print("| median | " + " | ".join(f"{x:.1f}" for x in med) + " | "
          + " | ".join(f"{statistics.median(c):.2f}x" for c in zip(*(ratios(r) for r in rows))) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
