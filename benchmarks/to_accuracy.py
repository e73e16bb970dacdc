"""Does the room beat its fastest PC end to end? The plan's pick on 4 nodes against 1 node, to the same accuracy.

    .venv/bin/python benchmarks/to_accuracy.py --save DIR [--seeds 3] [--dataset digits] [--epochs 4]
        [--balance 57 | --bandwidth RATE] [--model resnet18 | --job resnet50-tf] [--rank 4]

Issue 26's acceptance benchmark (also `benchmarks/slow_network.py --to-accuracy`). A 4-node lab, every node at
half a core, its links shaped so that the model's plain all-reduce takes --balance times a node's step
(docs/planning.md: 57x is a GTX 1050 Ti room on 1 GbE for ResNet18 at 32 px): the rate follows from the
first `bench` on this machine (a half core was 0.41 s a step when 26 Mbit/s was derived, 0.16 s on a
quieter machine, where 26 Mbit/s makes a room 2.5x slower than the one it stands for), the links are
reshaped to it and bench runs again; `--bandwidth` fixes the rate instead. As a user would:
provision, `bench` (the job's speeds and the gradient noise probe), then per seed:
1. **1 node**: `launch JOB --set nodes=[node1]` for --epochs; its final validation accuracy minus 1 point is
   the seed's target;
2. **calibration** (every seed, or seed 0 only with --calibrate first): the slow-link scheme on 4 nodes
   (--calibration-nodes: the first 2 or 3) from
   the first step (PowerSGD rank --rank, `powersgd_start_step: 1`, for both frameworks since 2026-12-06;
   `--scheme localsgd`: local SGD every --period steps, `localsgd_start_step: 1`), so that `plan --target-acc` has a run of it; with
   the job's epochs, trained on to the target as the pick is (`--calibration-epochs 3x`: 3x the epochs from
   the start, as until 2026-12-05);
3. **the plan's pick**: `plan --target-acc TARGET` for the job's epochs (its references are then the lab's
   runs planned for them where it has any: docs/planning.md; `--plan-epochs 3x`: planned for 3x, as until
   pass 4 of 2026-12-04), then `launch --plan` with the job's epochs, as a user runs it; where several nodes
   end them short of the target, the run trains on to it by itself, one epoch at a time up to 3x the epochs
   (`target_acc`, `max_epochs`: docs/jobs.md "Train until an accuracy"; the plan is asked with them, so it
   prices no restart; since 2026-12-04 evening), or (`--pick-epochs continue`) it is taken further by
   `launch --continue RUN --set epochs=E+1`, the time of every run counted (`relaunch`: started again with
   3x; `3x`: 3x the epochs from the start, as before 2026-12-04).
The calibration may go on for 3x the 1-node epochs; a run not set to end at the target is stopped (`clusterctl
stop`) once an epoch reaches it; every run is collected. A run is followed as a user who waits for it has it
followed, by its own watcher: this reads rank 0's records from the lab's files and the run's record on the
head every 2 s, and asks `clusterctl status` (an SSH session and a Python process on every node) only every
30 s (every 2 s until 2026-12-05 evening, which took from the nodes' half cores). Measured per run from rank
0's records: time from the training start to the target, images/s end to end (every sample trained / the
time from the start to the last epoch), the launch-to-target time the user waits (the command's start to that
epoch's record), and the plan's prediction of the time to the target with its error. Saves after every run
(DIR/runs.json, the head's home with the collected runs in DIR/home) and, run again with the same DIR, resumes
after the last run done. DIR keeps the settings its runs were measured with (dataset, model, job, epochs,
batch, bn_recompute, cpu quota, wire, lr_scaling, calibration nodes; since 2026-12-06): a pass or --table
without them reads them there, and one given otherwise is refused.
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
    run's epochs by 5-25% when asked every 2 s, docs/performance.md; its exit code tells the state too: not an
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


def pick(env: dict[str, str], state: lifecycle.LabState, launch: list[str], seeded: list[str], longer: list[str],
         target: float, a: argparse.Namespace, alone: bool) -> dict[str, Any]:
    """The plan's pick, as a user runs it: with the job's own epochs (a cosine schedule over more epochs
    decays later: one node took 114 s to the target with 12 planned against 88 with 4); where several nodes
    end those short of the target, `--pick-epochs continue` takes the run further one epoch at a time
    (`launch --continue RUN --set epochs=E+1`, until the target or 3x the epochs), `relaunch` starts it again
    with 3x the epochs; every run's time is counted, what the user waited in between included.
    `3x`: several nodes run 3x the epochs from the start, as before 2026-12-04."""
    if a.pick_epochs == "on":  # the run trains on to the target by itself (target_acc, max_epochs: no restart)
        return run(env, state, [*launch, *seeded, *until(target, a)], target, 3 * a.epochs, stop=False)
    if a.pick_epochs == "3x" and not alone:
        return run(env, state, [*launch, *longer], target, 3 * a.epochs)
    parts = [run(env, state, [*launch, *seeded], target, a.epochs)]
    if parts[0]["to_target_s"] is not None or alone:
        return parts[0]
    if a.pick_epochs == "relaunch":
        parts.append(run(env, state, [*launch, *longer], target, 3 * a.epochs))
    else:
        epochs = a.epochs
        while parts[-1]["to_target_s"] is None and parts[-1]["state"] == "succeeded" and epochs < 3 * a.epochs:
            epochs += 1
            print(f"  {parts[-1]['final_acc']:.3f} after {epochs - 1} epochs: continued to {epochs}", file=sys.stderr)
            parts.append(run(env, state, ["--continue", parts[-1]["run_id"], "--set", f"epochs={epochs}"], target, 1))
    return joined(parts)


def until(target: float, a: argparse.Namespace) -> list[str]:
    """The job settings that make a run end at the target, or train on to it up to 3x the epochs
    (docs/jobs.md "Train until an accuracy")."""
    return ["--set", f"target_acc={target}", "--set", f"max_epochs={3 * a.epochs}"]


def joined(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs one after the other as one, timed as a single run is: from the first one's training start (its
    start record; its launch is not counted, as no run's is) to the target; in between, the ends, collects,
    launches and starts of the later ones, what the user waited."""
    last, first = parts[-1], parts[0]
    images = sum(p["e2e_images_per_s"] * p["trained_s"] for p in parts)
    trained = last["t_last"] - first["t_start"]
    return {**last, "runs": parts, "epochs": sum(p["epochs"] for p in parts),
            "val_acc": [x for p in parts for x in p["val_acc"]],
            "to_target_s": None if last["t_hit"] is None else last["t_hit"] - first["t_start"],
            "launch_to_target_s": None if last["t_hit"] is None else last["t_hit"] - first["t_launch"],
            "e2e_images_per_s": images / trained, "trained_s": trained}


def predicted(plan: dict[str, Any], nodes: int, compression: str, accumulate: int = 1,
              key: str = "to_target_s", wire: str = "float32") -> float | None:
    """The plan's figure `key` (to_target_s, run_s, epoch_s, restart_s) for the candidate with this node count,
    scheme, accumulation and (PowerSGD) wire (the recommended one where it is that, else the fastest such)."""
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
    ap.add_argument("--scheme", choices=["powersgd", "localsgd"],
                    help="the calibration run's scheme, from the first step (default powersgd; TensorFlow's was "
                    "localsgd until it had PowerSGD, 2026-12-06)")
    ap.add_argument("--epochs", type=int, help="of the 1-node run, default 4; 4-node runs may go to 3x")
    ap.add_argument("--batch", type=int, help="per node, default 32")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank of the calibration run")
    ap.add_argument("--period", type=int, default=8, help="local SGD's steps between averagings")
    ap.add_argument("--wire", choices=["float32", "bfloat16"],
                    help="PowerSGD's all-reduces in the calibration run (its powersgd_wire; kept in DIR): default "
                         "float32. The plan weighs both wires for the pick (until 2026-12-05: this wire too)")
    ap.add_argument("--calibration-nodes", type=int, choices=[2, 3, 4],
                    help="how many of the 4 nodes the calibration run trains on (kept in DIR): default 4. A plan "
                    "without a noise scale (TensorFlow's) prices only the global batches of the lab's runs, and "
                    "says which other node count could still be sooner and what run calibrates it (plans.unpriced)")
    ap.add_argument("--bandwidth", help="the links' rate, fixed (e.g. 26mbit); default: from --balance")
    ap.add_argument("--balance", type=float, default=57.0,
                    help="the model's plain all-reduce over a node's step time that the links are set to give")
    ap.add_argument("--cpu-quota", type=float, help="of a core, each node's, default 0.5")
    ap.add_argument("--calibration-epochs", choices=["job", "3x"], default="job",
                    help="the calibration run's schedule: the job's epochs, trained on to the target up to 3x (as "
                    "the pick runs, and as a user calibrating the plan for the job would: the plan's references "
                    "are then of the job's own schedule), or 3x the epochs from the start (until 2026-12-05, "
                    "when a 6-epoch schedule, which decays later, made the plan price the picks an epoch late)")
    ap.add_argument("--calibrate", choices=["every", "first"], default="every",
                    help="which seeds get a 4-node calibration run: the plan's references match a run's settings, "
                    "the seed included, so a seed without one has its compressed schemes priced as plain and "
                    "warned, and the plan keeps to the unwarned (one node)")
    ap.add_argument("--bn-recompute", type=int,
                    help="every run's bn_recompute (docs/jobs.md), default 512: accuracy at an epoch's end measured "
                    "with precise BatchNorm statistics, not the running averages that lag at 11 steps an epoch; 0: off")
    ap.add_argument("--lr-scaling", choices=["linear", "sqrt"],
                    help="every run's optimizer.lr_scaling (docs/jobs.md; kept in DIR): default linear. One node "
                    "trains at the same rate by either; sqrt gives 4 nodes 2x one node's rate, not 4x")
    ap.add_argument("--pick-epochs", choices=["on", "continue", "relaunch", "3x"], default="on",
                    help="the pick's schedule: the job's epochs, and where it misses the target in them, (on) "
                    "trained on in the same run to the target (target_acc, max_epochs 3x; the plan asked with "
                    "them), continued one epoch at a time (`launch --continue`) up to 3x, or (relaunch) started "
                    "again with 3x, every run's time counted; 3x: 3x the epochs from the start")
    ap.add_argument("--plan-epochs", choices=["job", "3x"], default="job",
                    help="the epochs `plan` is asked for: the job's (the pick's own schedule) or 3x")
    ap.add_argument("--again", metavar="NAME",
                    help="another pass: each seed's pick and plan are kept as pick_NAME and plan_NAME, and made anew")
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
        otherwise, it is refused. A DIR from before the setting was kept took `before` (None: as given)."""
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
    a.scheme = a.scheme or "powersgd"
    # the scheme's settings on every 4-node run and the plan: from the first step, no warm phase. DIRs from
    # before these settings were kept sent float32, scaled linearly and calibrated on 4 nodes.
    a.wire = kept("wire", "float32", "float32")
    a.lr_scaling = kept("lr_scaling", "linear", "linear")
    a.calibration_nodes = kept("calibration_nodes", 4, 4)
    calibrated = [f"node{i + 1}" for i in range(a.calibration_nodes)]
    wire = ["--set", f"powersgd_wire={a.wire}"] if a.scheme == "powersgd" and a.wire != "float32" else []
    if a.scheme == "powersgd":
        scheme_sets = ["--set", f"powersgd_rank={a.rank}", "--set", "powersgd_start_step=1"]
    else:
        scheme_sets = ["--set", f"localsgd_period={a.period}", "--set", "localsgd_start_step=1"]
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
            key = f"seed{seed}"
            mine = done.setdefault(key, {})
            seeded = [*sets, "--set", f"seed={seed}", "--set", f"epochs={a.epochs}"]
            if "one" not in mine:
                print(f"seed {seed}: 1 node, {a.epochs} epochs", file=sys.stderr)
                mine["one"] = run(env, state, [job, *seeded, "--set", "nodes=[node1]"], None, a.epochs)
                save()
            target = round(mine["one"]["final_acc"] - 0.01, 4)
            # the 1-node run's own time to its final accuracy minus 1 point (also where it was run again)
            if mine.get("target") != target or mine["one"].get("to_target_s") is None:
                one = mine["one"]
                one.update(figures(rank0(state, one["run_id"]), target, one["t_launch"]))
                mine["target"] = target
                save()
            longer = [*sets, "--set", f"seed={seed}", "--set", f"epochs={3 * a.epochs}"]
            if (seed == 0 or a.calibrate == "every") and "calibration" not in mine:
                print(f"seed {seed}: calibration, {a.scheme} from the first step, to {target}", file=sys.stderr)
                scheme = [job, "--set", f"grad_compression={a.scheme}", *scheme_sets, *wire,
                          "--set", f"nodes=[{', '.join(calibrated)}]"]
                if a.calibration_epochs == "job":  # as the pick runs: the job's schedule, trained on to the target
                    mine["calibration"] = run(env, state, [*scheme, *seeded, *until(target, a)], target, 3 * a.epochs,
                                              stop=False)
                else:
                    mine["calibration"] = run(env, state, [*scheme, *longer], target, 3 * a.epochs)
                mine["calibration"].update(schedule=a.calibration_epochs, nodes=calibrated)
                save()
            made = mine.get("pick") and mine["pick"].get("schedule", "job" if len(mine["pick"]["nodes"]) == 1 else "3x")
            made = "relaunch" if made == "job" else made  # (what `job` did until `continue` came)
            if made and made != a.pick_epochs:  # a pick made the other way is kept beside the new one
                mine[f"pick_{made}"] = mine.pop("pick")
            if a.again and "pick" in mine and f"pick_{a.again}" not in mine:
                mine[f"pick_{a.again}"], mine[f"plan_{a.again}"] = mine.pop("pick"), mine.pop("plan", None)
            if "pick" not in mine:
                planned = seeded if a.plan_epochs == "job" else longer
                if planned is seeded and (mine.get("calibration") or {}).get("schedule", "3x") == "3x":
                    # the calibration's row is priced for its own schedule (3x); first, as `launch --plan` takes
                    # the plan saved last
                    mine["plan_long"] = ctl(env, "plan", job, *longer, *scheme_sets, "--target-acc", str(target),
                                            timeout=600)
                ends = until(target, a) if a.pick_epochs == "on" else []
                plan = ctl(env, "plan", job, *planned, *scheme_sets, *ends, "--target-acc", str(target), timeout=600)
                mine["plan"] = plan
                rec = plan["recommended"]
                print(f"seed {seed}: the plan's pick: {rec['nodes']} {rec['grad_compression']}, predicted "
                      f"{rec.get('to_target_s')} s to {target}", file=sys.stderr)
                mine["pick"] = pick(env, state, [job, "--plan", *scheme_sets], seeded, longer, target, a,
                                    alone=len(rec["nodes"]) == 1)
                mine["pick"].update(nodes=rec["nodes"], scheme=rec["grad_compression"],
                                    accumulate=rec.get("accumulate", 1), wire=rec.get("powersgd_wire", "float32"),
                                    schedule=a.pick_epochs,
                                    planned_for=a.plan_epochs)
                save()
    finally:
        lifecycle.down(state.name, tmp / "lab", purge=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(table(done, a, rate)))
    return 0


def wire_of(r: dict[str, Any], done: dict[str, Any], scheme: str) -> str:
    """What a run's PowerSGD all-reduces sent: the pick's own wire (the plan's), else the DIR's (the
    calibration's, and every pick's until the plan weighed the wire); float32 for any other scheme."""
    return (r.get("wire") or done.get("wire", "float32")) if scheme == "powersgd" else "float32"


def bf16(wire: str) -> str:
    return " bf16" if wire == "bfloat16" else ""


def table(done: dict[str, Any], a: argparse.Namespace, rate: str) -> list[str]:
    """One row per seed: 1 node and the pick, to the same target; then the means."""
    balance = (done.get("link") or {}).get("balance")
    lines = [f"{a.model} ({a.job}) on {a.dataset}, batch {a.batch}/node, bn_recompute {a.bn_recompute}, "
             f"lr_scaling {a.lr_scaling}, 4 nodes at {a.cpu_quota} core, links {rate}"
             + (f", the calibration's PowerSGD wire {done['wire']}" if done.get("wire", "float32") != "float32"
                else "")
             + (f" (plain all-reduce {balance:.0f}x a step)" if balance else ""),
             "", "| seed | target | 1 node: s to target | pick | pick: s to target | ratio | e2e img/s 1 node | "
             "e2e img/s pick | e2e ratio | plan's predicted s (error) | pick's epochs |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
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
        pred = (m.get("plan") or {}).get("recommended", {}).get("to_target_s")
        perr = f"{pred:.0f} ({pred / tp - 1:+.0%})" if pred and tp else "-"
        lines.append(f"| {seed} | {m['target']:.3f} | {t1:.0f} | {len(pick['nodes'])} x {pick['scheme']}"
                     f"{bf16(wire_of(pick, done, pick['scheme']))}{'' if pick.get('accumulate', 1) == 1 else ' acc ' + str(pick['accumulate'])} | "
                     f"{'not reached' if tp is None else f'{tp:.0f}'} | {'-' if r is None else f'{r:.2f}x'} | "
                     f"{one['e2e_images_per_s']:.1f} | {pick['e2e_images_per_s']:.1f} | {er:.2f}x | {perr} | "
                     f"{pick['epochs']} |")
    if ratios:
        lines.append(f"\nmean time-to-target ratio pick / 1 node: {statistics.fmean(ratios):.3f}x (target <= 0.5x); "
                     f"mean end-to-end images/s ratio: {statistics.fmean(e2e):.2f}x (target >= 2x)")
        if launched:  # what the user waits from the command: staging, start, rendezvous and the training
            lines.append(f"mean launch-to-target ratio (from the `launch` command): {statistics.fmean(launched):.3f}x")
    lines += ["", "The plan's predictions against the runs (seconds from the training start; the plan of each seed, "
              "for the calibration's row the one for its 3x epochs where the pick's was for the job's):",
              "", "| seed | run | to target: predicted | measured | error | wall of its epochs: predicted | "
              "measured | error | host load |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    pairs: dict[str, list[tuple[float, float, float, float]]] = {}

    def cell(pred: float | None, meas: float | None) -> str:
        return (f"{'-' if pred is None else f'{pred:.0f}'} | {'-' if meas is None else f'{meas:.0f}'} | "
                + (f"{pred / meas - 1:+.0%}" if pred and meas else "-"))

    for seed in range(a.seeds):
        m = done.get(f"seed{seed}") or {}
        for name in ("one", "calibration", "pick"):
            r, plan = m.get(name), m.get("plan_long" if name == "calibration" and "plan_long" in m else "plan")
            if not r or not plan:
                continue
            nodes = 1 if name == "one" else len(r.get("nodes") or [0] * 4)
            scheme = "none" if name == "one" else r.get("scheme", a.scheme)
            acc = r.get("accumulate") or (r.get("global_batch", 0) // (a.batch * nodes) if name == "pick" else 1) or 1
            # wall time: the plan's epoch (training, evaluation, checkpoint) x the epochs the run trained
            wire = wire_of(r, done, scheme)
            epoch = predicted(plan, nodes, scheme, acc, key="epoch_s", wire=wire)
            pred, meas = predicted(plan, nodes, scheme, acc, wire=wire), r.get("to_target_s")
            # ... and each `launch --continue` at the plan's restart (its end, launch and start)
            restart = predicted(plan, nodes, scheme, acc, key="restart_s", wire=wire) or 0.0
            again = (len(r.get("runs") or [r]) - 1) * float(restart)
            wall, trained = (epoch * r["epochs"] + again if epoch else None), r.get("trained_s")
            if pred and meas and wall and trained:
                pairs.setdefault(name, []).append((pred, meas, wall, trained))
            lines.append(f"| {seed} | {name} ({nodes} x {scheme}{bf16(wire)}"
                         f"{'' if acc == 1 else f' acc {acc}'}) | "
                         f"{cell(pred, meas)} | {cell(wall, trained)} | {r.get('host_load', '-')} |")
    for name, got in pairs.items():  # the measure: the mean of the seeds, per run
        mean = [statistics.fmean(x[i] for x in got) for i in range(4)]
        lines.append(f"| mean of {len(got)} | {name} | {cell(mean[0], mean[1])} | {cell(mean[2], mean[3])} | |")
    for seed in range(a.seeds):
        cal = (done.get(f"seed{seed}") or {}).get("calibration")
        if not cal:
            continue
        tp = cal["to_target_s"]
        lines.append(f"seed {seed}: calibration run ({a.scheme} from the first step, "
                     f"{len(cal.get('nodes') or [0] * 4)} nodes): "
                     f"{'not reached' if tp is None else f'{tp:.0f} s'} to the target, "
                     f"{cal['e2e_images_per_s']:.1f} images/s end to end, accuracy by epoch "
                     + " ".join(f"{x:.3f}" for x in cal["val_acc"]))
    return lines


if __name__ == "__main__":
    sys.exit(main())
