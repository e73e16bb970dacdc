"""The plan's time to a target, priced again from what each recorded plan knew, against what its pick measured.

    .venv/bin/python benchmarks/plan_backtest.py DIR [DIR ...]

Each DIR is one that benchmarks/to_accuracy.py saved (runs.json, and the head's home with the collected runs
in DIR/home). For every plan in it that was followed by a pick (`plan` with `pick`, `plan_NAME` with
`pick_NAME`), this takes the plan's own inputs as it saved them (the nodes' speeds and the network from
its bench, the references it was calibrated by: the collected runs it names, read again from DIR/home) and
prices the candidate the pick ran with this checkout's model (placement.to_target), then prints the
recorded prediction, the new one and the pick's measured time to the target, with the error of each and,
per pass, on the mean of the seeds (issue 26's measure); beside them the fewest validation images the
references had to spare at the epoch that reached the target (Placement.spare: under a point, `plan` says so),
and the epochs each reference priced against those the pick took. Then the step model alone: each run's epoch (the
one node's, the calibration's, the pick's) priced again from its plan's bench, against the run's training
time an epoch. A change to the convergence or the step model is read here against every recorded run at
once, no lab needed. Reads only DIR; contacts nothing.
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
from cluster.study import convergence, placement, plans  # noqa: E402


def _priced_again(plan: dict[str, Any], run_id: str) -> tuple[placement.PlacementChoice, jobs.JobSpec,
                                                                placement.Workload, list[placement.Placement]]:
    """The plan as saved, the run's job, and every candidate priced by this checkout's step model from the
    plan's own bench (its nodes' speeds and network)."""
    choice = placement.PlacementChoice.from_dict(plan)
    run = records.load(run_id)
    spec = jobs.from_run(run.spec_file, run.settings or {})
    work = plans.workload(spec, choice.network)
    return choice, spec, work, placement.candidates(choice.speeds, spec["batch"], choice.network, work=work)


def _matching(cands: list[placement.Placement], nodes: int, scheme: str, accumulate: int,
              wire: str) -> list[placement.Placement]:
    return [c for c in cands if len(c.nodes) == nodes and c.grad_compression == scheme and c.accumulate == accumulate
            and (scheme != "powersgd" or c.powersgd_wire == wire)]


def repriced(plan: dict[str, Any], pick: dict[str, Any]) -> tuple[float | None, int, str]:
    """This checkout's seconds to the plan's target for the pick's candidate, from the plan's own inputs;
    how many references it had; and the fewest validation images they had to spare (plans.spare), as
    "N/V" ("-" where none says)."""
    choice, spec, work, cands = _priced_again(plan, pick["run_id"])
    conv = plan["convergence"]
    known = {r["run_id"] for r in conv["references"]}
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
    same = [c for c in _matching(cands, len(rec["nodes"]), rec["grad_compression"], rec.get("accumulate", 1),
                                 rec.get("powersgd_wire") or "float32") if sorted(c.nodes) == sorted(rec["nodes"])]
    if not same:
        return None, len(model.references), "-"
    left = same[0].spare
    return same[0].to_target_s, len(model.references), f"{left[0]}/{left[1]}" if left else "-"


def walls(d: Path, done: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """Per run of DIR (one node, calibration, pick): (row name, the recorded plan's epoch, this checkout's
    step model's from the same bench, the run's training time an epoch), each from the plan of its seed that
    priced it: the step model alone, no convergence."""
    out = []
    for seed in sorted(k for k in done if k.startswith("seed")):
        m = done[seed]
        for name in ("one", "calibration", "pick"):
            r, plan = m.get(name), m.get("plan_long" if name == "calibration" and "plan_long" in m else "plan")
            if not r or not plan or not r.get("trained_s") or len(r.get("runs") or [r]) > 1:
                continue  # a continued run's time has restarts in it: the step model alone is not it
            nodes = 1 if name == "one" else len(r.get("nodes") or [0] * 4)
            scheme = "none" if name == "one" else r.get("scheme", "powersgd")
            wire, acc = r.get("wire") or done.get("wire") or "float32", r.get("accumulate") or 1
            choice, _, _, cands = _priced_again(plan, r["run_id"])
            was, now = (min((c.epoch_s for c in _matching(x, nodes, scheme, acc, wire) if c.epoch_s), default=None)
                        for x in (choice.candidates, cands))
            if now and was:
                bf16 = " bf16" if wire == "bfloat16" and scheme == "powersgd" else ""
                out.append((f"{seed[4:]} | {name} ({nodes} x {scheme}{bf16})", was, now,
                            r["trained_s"] / r["epochs"]))
    return out


def err(pred: float | None, meas: float | None) -> str:
    return "-" if pred is None or not meas else f"{pred / meas - 1:+.0%}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    a = ap.parse_args()
    epochs: dict[str, list[tuple[str, float, float, float]]] = {}
    print("| DIR | pass | seed | pick | refs | spare | epochs priced, taken | measured s | recorded s (error) | "
          "now s (error) |")
    print("|---|---|---:|---|---:|---:|---|---:|---:|---:|")
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
                now, refs, left = repriced(plan, pick)
                was, meas = plan["recommended"].get("to_target_s"), pick["to_target_s"]
                label = f"{len(pick['nodes'])} x {pick.get('scheme', 'none')} acc {pick.get('accumulate', 1)}"
                priced = " ".join(map(str, plan["recommended"].get("epochs_to_target") or [])) or "-"
                print(f"| {d.name} | {name} | {seed[4:]} | {label} | {refs} | {left} | {priced}; "
                      f"{len(pick.get('val_acc') or []) or '-'} | {meas:.0f} | "
                      f"{was:.0f} ({err(was, meas)}) | {now or 0:.0f} ({err(now, meas)}) |")
                if was and now:
                    passes.setdefault(name, []).append((meas, was, now))
        for name, rows in passes.items():
            meas, was, now = (statistics.fmean(r[i] for r in rows) for i in range(3))
            print(f"| {d.name} | {name}: mean of {len(rows)} | | | | | | {meas:.0f} | {was:.0f} ({err(was, meas)}) | "
                  f"{now:.0f} ({err(now, meas)}) |")
        epochs[d.name] = walls(d, done)
    print("\nAn epoch's wall time (the step model alone: the plan's epoch against the run's training time over its "
          "epochs; the last pass's plan of each seed; continued runs left out):\n")
    print("| DIR | seed | run | measured s | recorded plan s (error) | now s (error) |")
    print("|---|---:|---|---:|---:|---:|")
    for dir_name, got in epochs.items():
        for label, e_was, e_now, e_meas in got:
            print(f"| {dir_name} | {label} | {e_meas:.1f} | {e_was:.1f} ({err(e_was, e_meas)}) | "
                  f"{e_now:.1f} ({err(e_now, e_meas)}) |")
        for kind in ("one", "calibration", "pick"):
            of = [x for x in got if f"| {kind} (" in x[0]]
            if of:
                e_was, e_now, e_meas = (statistics.fmean(x[1] for x in of), statistics.fmean(x[2] for x in of),
                                        statistics.fmean(x[3] for x in of))
                print(f"| {dir_name} | mean of {len(of)} | {kind} | {e_meas:.1f} | "
                      f"{e_was:.1f} ({err(e_was, e_meas)}) | {e_now:.1f} ({err(e_now, e_meas)}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
