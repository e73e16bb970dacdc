"""The plan's time to a target, priced again from what each recorded plan knew, against what its pick measured.

    .venv/bin/python benchmarks/plan_backtest.py DIR [DIR ...]

Each DIR is one that benchmarks/to_accuracy.py saved (runs.json, and the head's home with the collected runs
in DIR/home). For every plan in it that was followed by a pick (`plan` with `pick`, `plan_NAME` with
`pick_NAME`), this takes the plan's own inputs as it saved them (the nodes' speeds and the network from
its bench, the references it was calibrated by: the collected runs it names, read again from DIR/home) and
prices the candidate the pick ran with this checkout's model (placement.to_target), then prints the
recorded prediction, the new one and the pick's measured time to the target, with the error of each and,
per pass, on the mean of the seeds (issue 26's measure). A change to the convergence model is read here
against every recorded run at once, no lab needed. Reads only DIR; contacts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.runs import jobs, records  # noqa: E402
from cluster.study import convergence, placement  # noqa: E402


def repriced(plan: dict[str, Any], pick: dict[str, Any]) -> tuple[float | None, int]:
    """This checkout's seconds to the plan's target for the pick's candidate, from the plan's own inputs;
    and how many references it had."""
    choice = placement.PlacementChoice.from_dict(plan)
    conv = plan["convergence"]
    known = {r["run_id"] for r in conv["references"]}
    run = records.load(pick["run_id"])
    spec = jobs.from_run(run.spec_file, run.settings or {})
    work = placement.workload(spec, choice.network)
    cands = placement.candidates(choice.speeds, spec["batch"], choice.network, work=work)
    every = convergence.references

    def as_known(spec: jobs.JobSpec, target: float) -> list[convergence.Reference]:
        return [r for r in every(spec, target) if r.run_id in known]  # the runs the plan was calibrated by

    convergence.references = as_known
    try:
        model = convergence.calibrate(spec, float(conv["target"]), conv.get("noise_scale"))
    finally:
        convergence.references = every
    placement.to_target(cands, choice.speeds, choice.network, work, model)
    rec = plan["recommended"]
    same = [c for c in cands if sorted(c.nodes) == sorted(rec["nodes"]) and c.grad_compression == rec["grad_compression"]
            and c.accumulate == rec.get("accumulate", 1) and c.powersgd_wire == rec.get("powersgd_wire", "float32")]
    return (same[0].to_target_s if same else None), len(model.references)


def err(pred: float | None, meas: float | None) -> str:
    return "-" if pred is None or not meas else f"{pred / meas - 1:+.0%}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    a = ap.parse_args()
    print("| DIR | pass | seed | pick | refs | measured s | recorded s (error) | now s (error) |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for d in a.dirs:
        done = json.loads((d / "runs.json").read_text())
        os.environ["CLUSTERCTL_HOME"] = str((d / "home").resolve())
        passes: dict[str, list[tuple[float, float, float]]] = {}
        for seed in sorted(k for k in done if k.startswith("seed")):
            mine = done[seed]
            for key in sorted(k for k in mine if k == "pick" or k.startswith("pick_")):
                name = key[len("pick"):].lstrip("_") or "last"
                plan, pick = mine.get("plan" + key[len("pick"):]), mine[key]
                if not plan or not (plan.get("convergence") or {}).get("references") or not pick.get("to_target_s"):
                    continue
                now, refs = repriced(plan, pick)
                was, meas = plan["recommended"].get("to_target_s"), pick["to_target_s"]
                label = f"{len(pick['nodes'])} x {pick.get('scheme', 'none')} acc {pick.get('accumulate', 1)}"
                print(f"| {d.name} | {name} | {seed[4:]} | {label} | {refs} | {meas:.0f} | "
                      f"{was:.0f} ({err(was, meas)}) | {now or 0:.0f} ({err(now, meas)}) |")
                if was and now:
                    passes.setdefault(name, []).append((meas, was, now))
        for name, rows in passes.items():
            meas, was, now = (statistics.fmean(r[i] for r in rows) for i in range(3))
            print(f"| {d.name} | {name}: mean of {len(rows)} | | | | {meas:.0f} | {was:.0f} ({err(was, meas)}) | "
                  f"{now:.0f} ({err(now, meas)}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
