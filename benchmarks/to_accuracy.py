"""Does the room beat its fastest PC end to end? The plan's pick against 1 node, to the same accuracy.

    .venv/bin/python benchmarks/to_accuracy.py --save DIR [--seeds 3] [--dataset digits] [--epochs 4]
        [--balance 57 | --bandwidth RATE] [--model resnet18 | --job resnet50-tf] [--rank 4]

Issue 26's acceptance benchmark (also `benchmarks/slow_network.py --to-accuracy`). A 4-node lab, every node at
half a core, its links shaped so that the model's plain all-reduce takes --balance times a node's step
(docs/planning.md: 57x is a GTX 1050 Ti room on 1 GbE for ResNet18 at 32 px): the rate follows from the
first `bench` on this machine, the links are reshaped to it and bench runs again; `--bandwidth` fixes the
rate instead. As a user would: provision, `bench`, then per seed:
1. **1 node**: `launch JOB --set nodes=[node1]` for --epochs; its final validation accuracy minus 1 point is
   the seed's target;
2. **the plan's pick**: `plan JOB` (ranked by its predicted time over the job's epochs; PowerSGD at --rank
   from the first step, `powersgd_start_step: 1`), then `launch --plan` with the job's epochs, trained on to
   the target by itself where it ends them short (`target_acc`, `max_epochs` 3x the epochs: docs/jobs.md
   "Train until an accuracy").
Every run is collected; its time to the target is read from its collected records: from the training start to
the first epoch at the target, as `clusterctl report --target-acc` reads it. Also measured: images/s end to end
(every sample trained / the time from the start to the last epoch), the launch-to-target time the user waits
(the command's start to that epoch's record), and the plan's predicted wall time of the epochs each run trained
(its epoch_s) with its error. A run is followed as a user who waits for it has it followed, by its own watcher:
this reads rank 0's records from the lab's files and the run's record on the head every 2 s, and asks
`clusterctl status` only every 30 s. Saves after every run (DIR/runs.json, the head's home with the collected
runs in DIR/home) and, run again with the same DIR, resumes after the last run done. DIR keeps the settings its
runs were measured with (dataset, model, job, epochs, batch, bn_recompute, cpu quota, lr_scaling): a pass or
--table without them reads them there, and one given otherwise is refused.
Contacts only the lab it starts; removes it at the end.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.plan import ctl  # noqa: E402  (clusterctl as a user runs it, its JSON answer)
from cluster.lab import lifecycle  # noqa: E402

PY = sys.executable
POLL_S = 2.0


def rank0(state: lifecycle.LabState, run_id: str) -> list[dict[str, Any]]:
    """Rank 0's records as the lab's node holds them (the run's first node: node2 where the plan picks it alone)."""
    found = [f for n in state.nodes if (f := Path(n.dir) / "srv" / "runs" / run_id / "out" / "metrics-rank0.jsonl").exists()]
    out = []
    for line in (found[0].read_text().splitlines() if found else []):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def figures(recs: list[dict[str, Any]], target: float | None, t_launch: float) -> dict[str, Any]:
    """Time to the target from the training start and from the launch, end-to-end images/s, accuracy."""
    start = next(r for r in recs if r["type"] == "start")
    epochs = [r for r in recs if r["type"] == "epoch"]
    per_epoch = start["steps_per_epoch"] * start["global_batch"]
    hit = next((e for e in epochs if target is not None and e["val_acc"] >= target), None)
    last = epochs[-1]
    return {"epochs": len(epochs), "val_acc": [e["val_acc"] for e in epochs], "final_acc": last["val_acc"],
            "global_batch": start["global_batch"], "to_target_s": hit["time"] - start["time"] if hit else None,
            "launch_to_target_s": hit["time"] - t_launch if hit else None,
            "e2e_images_per_s": len(epochs) * per_epoch / (last["time"] - start["time"]),
            "steady_images_per_s": statistics.median([e["images_per_s"] for e in epochs[1:]] or [last["images_per_s"]]),
            "trained_s": last["time"] - start["time"], "t_start": start["time"], "t_last": last["time"],
            "t_hit": hit["time"] if hit else None}


ASK_EVERY = 15  # polls: `clusterctl status` every 30 s, the run's record on the head in between


def status(env: dict[str, str], rid: str, poll: int) -> str:
    """The run's state at the `poll`-th look: every ASK_EVERY-th, as `status --json` judges it (it asks every
    node: an SSH session and a Python process on each, inside the node's half core, which slowed a 1-node
    run's epochs by 5-25% when asked every 2 s, measured with this script; its exit code tells the state too: not an
    error here), else as the run's record on the head says, which the run's watcher keeps (no node is asked,
    so nothing is taken from the nodes but what a user's own run has: its watcher)."""
    if poll % ASK_EVERY == ASK_EVERY - 1:
        r = subprocess.run([PY, "-m", "cluster", "status", rid, "--json"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
        text = r.stdout
    else:
        path = Path(env["CLUSTERCTL_HOME"]) / "runs" / rid / "run.json"
        text = path.read_text() if path.exists() else ""
    try:
        return str(json.loads(text).get("state"))
    except ValueError:
        return "unknown"


ACTIVE = ("starting", "running", "restarting", "stopping", "unknown")


def run(env: dict[str, str], state: lifecycle.LabState, args: list[str], target: float | None,
        max_epochs: int, stop: bool = True) -> dict[str, Any]:
    """`launch` detached; stopped once an epoch reaches the target (if any; `stop` False: a run that ends there
    by itself, target_acc, is left to), else left to finish; collected."""
    t0 = time.time()
    rid = ctl(env, "launch", *args, "--detach", timeout=1800)["run_id"]
    load: list[float] = []
    for i in itertools.count():
        load.append(os.getloadavg()[0])
        recs = rank0(state, rid)
        ep = [r for r in recs if r["type"] == "epoch"]
        if stop and target is not None and any(e["val_acc"] >= target for e in ep):
            subprocess.run([PY, "-m", "cluster", "stop", rid], cwd=ROOT, env=env, capture_output=True, timeout=600)
            break
        if status(env, rid, i) not in ACTIVE or len(ep) >= max_epochs:
            break
        time.sleep(POLL_S)
    for i in range(300):  # the record settles (stopped / succeeded) before collect
        st = status(env, rid, i)
        if st not in ACTIVE:
            break
        time.sleep(POLL_S)
    subprocess.run([PY, "-m", "cluster", "collect", rid, "--json"], cwd=ROOT, env=env, capture_output=True,
                   text=True, timeout=1800)
    # the head's 1-minute load while it trained: the lab's nodes share this machine, so anything else running
    # here slows them: the table shows it per run
    return {"run_id": rid, "state": st, "t_launch": t0, "host_load": round(statistics.fmean(load), 2),
            **figures(rank0(state, rid), target, t0)}


def until(target: float, a: argparse.Namespace) -> list[str]:
    """The job settings that make a run end at the target, or train on to it up to 3x the epochs
    (docs/jobs.md "Train until an accuracy")."""
    return ["--set", f"target_acc={target}", "--set", f"max_epochs={3 * a.epochs}"]


def predicted(plan: dict[str, Any], nodes: int, compression: str, accumulate: int = 1, wire: str = "float32",
              key: str = "epoch_s") -> float | None:
    """The plan's figure `key` for the candidate with this node count, scheme, accumulation and (PowerSGD)
    wire (the recommended one where it is that, else the fastest such)."""
    c = [x for x in [plan["recommended"], *plan["candidates"]] if len(x["nodes"]) == nodes and x.get(key)
         and x["grad_compression"] == compression and x.get("accumulate", 1) == accumulate
         and (compression != "powersgd" or x.get("powersgd_wire", "float32") == wire)]
    return c[0][key] if c and c[0] is plan["recommended"] else (min(x[key] for x in c) if c else None)


def balanced_rate(bench: dict[str, Any], rate: str, balance: float) -> tuple[str, float]:
    """(the link rate at which the model's plain all-reduce takes `balance` x the nodes' mean step, the
    balance measured at `rate`): all-reduce time scales as 1 / rate (the bench's latency is milliseconds)."""
    steps = [n["step_s"] for c in bench["compute"].values() for n in c["nodes"].values()]
    step, allreduce = statistics.fmean(steps), float(bench["network"]["model_allreduce_s"])
    mbit = float(rate.removesuffix("mbit"))
    return f"{mbit * allreduce / (balance * step):.1f}mbit", allreduce / step


def reshape(state: lifecycle.LabState, rate: str) -> None:
    """Every node's link, both directions, to `rate` (the lab's own devices only)."""
    from cluster.lab import shaping

    for n in state.nodes:
        shaping.unshape_link(n.netns, n.veth)
        shaping.shape_link(n.netns, n.veth, rate)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", type=Path, required=True, help="measurements and the head's home; resumes from it")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--dataset", help="digits (default) | digits-aug (11,496 images an epoch)")
    ap.add_argument("--model", help="default resnet18")
    ap.add_argument("--job", help="the built-in job (default resnet18-ddp or resnet50-ddp from --model); "
                    "resnet50-tf is TensorFlow's (ResNet50)")
    ap.add_argument("--epochs", type=int, help="of the 1-node run and the pick's schedule, default 4")
    ap.add_argument("--batch", type=int, help="per node, default 32")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD's rank, for the plan to weigh")
    ap.add_argument("--bandwidth", help="the links' rate, fixed (e.g. 26mbit); default: from --balance")
    ap.add_argument("--balance", type=float, default=57.0,
                    help="the model's plain all-reduce over a node's step time that the links are set to give")
    ap.add_argument("--cpu-quota", type=float, help="of a core, each node's, default 0.5")
    ap.add_argument("--bn-recompute", type=int,
                    help="every run's bn_recompute (docs/jobs.md), default 512: accuracy at an epoch's end measured "
                    "with precise BatchNorm statistics, not the running averages that lag at 11 steps an epoch; 0: off")
    ap.add_argument("--lr-scaling", choices=["linear", "sqrt"],
                    help="every run's optimizer.lr_scaling (docs/jobs.md; kept in DIR): default linear. One node "
                    "trains at the same rate by either; sqrt gives 4 nodes 2x one node's rate, not 4x")
    ap.add_argument("--table", action="store_true", help="print the tables of DIR/runs.json and stop (no lab)")
    ap.add_argument("--name", default="toacc")
    ap.add_argument("--subnet", default="10.233.0.0/24")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still removes the lab (finally)
    a.save.mkdir(parents=True, exist_ok=True)
    done_path = a.save / "runs.json"
    done: dict[str, Any] = json.loads(done_path.read_text()) if done_path.exists() else {}
    env = {**os.environ, "CLUSTERCTL_HOME": str((a.save / "home").resolve())}

    def kept(key: str, default: Any, before: Any = None) -> Any:
        """The DIR's setting (runs.json), so that every pass and --table run what its runs measured: given
        otherwise, it is refused. A DIR made without the setting kept took `before` (None: as given)."""
        given, value = getattr(a, key), done.get(key)
        if value is None and before is not None and "bench" in done:
            value = before
        if value is None:
            value = default if given is None else given
        if given is not None and given != value:
            ap.error(f"--{key.replace('_', '-')} {given}: {a.save} was measured with {value}; use another DIR")
        done[key] = value
        return value

    for key, default in (("dataset", "digits"), ("epochs", 4), ("batch", 32), ("bn_recompute", 512),
                         ("cpu_quota", 0.5)):
        setattr(a, key, kept(key, default))
    a.model = kept("model", "resnet50" if a.job in ("resnet50-ddp", "resnet50-tf") else "resnet18")
    a.job = kept("job", "resnet18-ddp" if a.model == "resnet18" else "resnet50-ddp")
    job = a.job
    if job == "resnet50-tf" and a.model != "resnet50":
        ap.error(f"--job resnet50-tf trains ResNet50, not --model {a.model}: leave --model out")
    a.lr_scaling = kept("lr_scaling", "linear", "linear")
    scheme_sets = ["--set", f"powersgd_rank={a.rank}", "--set", "powersgd_start_step=1"]
    common = [f"batch={a.batch}", "threads=1", f"dataset.name={a.dataset}", "log_every=1000",
              "collective_timeout_s=600", f"model={a.model}", f"bn_recompute={a.bn_recompute}",
              f"optimizer.lr_scaling={a.lr_scaling}"]
    sets = [x for s in common for x in ("--set", s)]
    rate = a.bandwidth or (done.get("link") or {}).get("rate") or "26mbit"
    if a.table:
        print("\n".join(table(done, a, rate)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="clusterctl-toacc-"))
    if not rate.endswith("mbit"):
        ap.error("--bandwidth: give it in mbit, e.g. 26mbit")
    state = lifecycle.up(4, name=a.name, subnet=a.subnet, directory=tmp / "lab", bandwidth=rate,
                         cpu_quotas=[a.cpu_quota] * 4)

    def save() -> None:
        done_path.write_text(json.dumps(done, indent=1))

    try:
        ctl(env, "provision", state.inventory, "--set", f"python={PY}", "--set", "vars.python_env=existing")
        def bench() -> dict[str, Any]:
            return ctl(env, "bench", "--jobs", job, "--steps", "12", "--parallel", *sets, "--set", "seed=0",
                       timeout=3600)

        done["bench"] = bench()
        if a.bandwidth and "link" not in done:  # the table, and a resume without --bandwidth, read it here
            done["link"] = {"rate": rate}
        if not a.bandwidth and "link" not in done:
            new, measured = balanced_rate(done["bench"], rate, a.balance)
            print(f"links: {rate} gave a balance of {measured:.0f}x, {a.balance:g}x wants {new}", file=sys.stderr)
            reshape(state, new)
            done["bench"], rate = bench(), new
            done["link"] = {"rate": new, "balance": balanced_rate(done["bench"], new, a.balance)[1]}
        save()
        for seed in range(a.seeds):
            mine = done.setdefault(f"seed{seed}", {})
            seeded = [*sets, "--set", f"seed={seed}", "--set", f"epochs={a.epochs}"]
            if "one" not in mine:
                print(f"seed {seed}: 1 node, {a.epochs} epochs", file=sys.stderr)
                mine["one"] = run(env, state, [job, *seeded, "--set", "nodes=[node1]"], None, a.epochs)
                save()
            target = round(mine["one"]["final_acc"] - 0.01, 4)
            # the 1-node run's own time to its final accuracy minus 1 point
            if mine.get("target") != target or mine["one"].get("to_target_s") is None:
                one = mine["one"]
                one.update(figures(rank0(state, one["run_id"]), target, one["t_launch"]))
                mine["target"] = target
                save()
            if "pick" not in mine:
                plan = ctl(env, "plan", job, *seeded, *scheme_sets, timeout=600)
                mine["plan"] = plan
                rec = plan["recommended"]
                print(f"seed {seed}: the plan's pick: {rec['nodes']} {rec['grad_compression']}, predicted "
                      f"{rec.get('run_s')} s for {a.epochs} epochs", file=sys.stderr)
                mine["pick"] = run(env, state, [job, "--plan", *scheme_sets, *seeded, *until(target, a)], target,
                                   3 * a.epochs, stop=False)
                mine["pick"].update(nodes=rec["nodes"], scheme=rec["grad_compression"],
                                    accumulate=rec.get("accumulate", 1), wire=rec.get("powersgd_wire", "float32"))
                save()
    finally:
        lifecycle.down(state.name, tmp / "lab", purge=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(table(done, a, rate)))
    return 0


def bf16(wire: str) -> str:
    return " bf16" if wire == "bfloat16" else ""


def table(done: dict[str, Any], a: argparse.Namespace, rate: str) -> list[str]:
    """One row per seed: 1 node and the pick, to the same target; then the means, and the plan's predicted
    wall time of each run's epochs against the measured."""
    balance = (done.get("link") or {}).get("balance")
    lines = [f"{a.model} ({a.job}) on {a.dataset}, batch {a.batch}/node, bn_recompute {a.bn_recompute}, "
             f"lr_scaling {a.lr_scaling}, 4 nodes at {a.cpu_quota} core, links {rate}"
             + (f" (plain all-reduce {balance:.0f}x a step)" if balance else ""),
             "", "| seed | target | 1 node: s to target | pick | pick: s to target | ratio | e2e img/s 1 node | "
             "e2e img/s pick | e2e ratio | pick's epochs |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    ratios, e2e, launched = [], [], []
    for seed in range(a.seeds):
        m = done.get(f"seed{seed}") or {}
        one, pick = m.get("one"), m.get("pick")
        if not one or not pick:
            continue
        t1, tp = one["to_target_s"], pick["to_target_s"]
        r = tp / t1 if t1 and tp else None
        er = pick["e2e_images_per_s"] / one["e2e_images_per_s"]
        ratios += [r] if r else []
        e2e.append(er)
        l1, lp = one.get("launch_to_target_s"), pick.get("launch_to_target_s")
        launched += [lp / l1] if l1 and lp else []
        wire = pick.get("wire", "float32") if pick["scheme"] == "powersgd" else "float32"
        acc = "" if pick.get("accumulate", 1) == 1 else f" acc {pick['accumulate']}"
        lines.append(f"| {seed} | {m['target']:.3f} | {t1:.0f} | {len(pick['nodes'])} x {pick['scheme']}"
                     f"{bf16(wire)}{acc} | {'not reached' if tp is None else f'{tp:.0f}'} | "
                     f"{'-' if r is None else f'{r:.2f}x'} | {one['e2e_images_per_s']:.1f} | "
                     f"{pick['e2e_images_per_s']:.1f} | {er:.2f}x | {pick['epochs']} |")
    if ratios:
        lines.append(f"\nmean time-to-target ratio pick / 1 node: {statistics.fmean(ratios):.3f}x (target <= 0.5x); "
                     f"mean end-to-end images/s ratio: {statistics.fmean(e2e):.2f}x (target >= 2x)")
        if launched:  # what the user waits from the command: staging, start, rendezvous and the training
            lines.append(f"mean launch-to-target ratio (from the `launch` command): {statistics.fmean(launched):.3f}x")
    lines += ["", "The plan's predicted wall time of the epochs each run trained (its epoch_s x the epochs, from "
              "the training start) against the measured:", "",
              "| seed | run | predicted s | measured s | error | host load |", "|---|---|---:|---:|---:|---:|"]
    for seed in range(a.seeds):
        m = done.get(f"seed{seed}") or {}
        for name in ("one", "pick"):
            r, plan = m.get(name), m.get("plan")
            if not r or not plan:
                continue
            nodes = 1 if name == "one" else len(r.get("nodes") or [0] * 4)
            scheme = "none" if name == "one" else r.get("scheme", "none")
            k = 1 if name == "one" else int(r.get("accumulate", 1))
            wire = r.get("wire", "float32") if scheme == "powersgd" else "float32"
            epoch = predicted(plan, nodes, scheme, k, wire)
            wall, trained = (epoch * r["epochs"] if epoch else None), r.get("trained_s")
            err = f"{wall / trained - 1:+.0%}" if wall and trained else "-"
            lines.append(f"| {seed} | {name} ({nodes} x {scheme}{bf16(wire)}{'' if k == 1 else f' acc {k}'}) | "
                         f"{'-' if wall is None else f'{wall:.0f}'} | {'-' if trained is None else f'{trained:.0f}'} | "
                         f"{err} | {r.get('host_load', '-')} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
