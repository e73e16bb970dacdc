"""A job's plan on an inventory: `clusterctl plan JOB` prices every candidate (placement.py) from the
inventory's bench, saves the document `launch --plan` reads, and says what it found: the verdict against
one node alone, the table, and the notes on what the time to the target rests on (docs/planning.md)."""
from __future__ import annotations

import json
import shlex
import statistics
import time
from pathlib import Path
from typing import Callable

from cluster import paths
from cluster.bounds import read_regular
from cluster.errors import ClusterError, UsageError
from cluster.inventory.model import Inventory
from cluster.runs import jobs, launch
from cluster.study import bench, commmodel, convergence
from cluster.study.bench import NetworkBench
from cluster.study.placement import (NEAR_BEST_TO_TARGET, SHARES_GAIN, NodeSpeed, Placement, PlacementChoice,
                                     Workload, bound_unpriced, candidates, changes, recommend, speed, to_target)


def verdict(choice: PlacementChoice) -> str | None:
    """The plan's answer in a sentence, end to end: the recommended node set against one node alone (or, where
    one node is recommended, against the fastest set of several). None without the job's length."""
    if choice.recommended.to_target_s and choice.convergence:
        acc = f"validation accuracy {float(choice.convergence['target']):g}"
        return _versus(choice, lambda c: c.to_target_s, f"fastest to {acc}", "", f" reach {acc} in")
    return _versus(choice, lambda c: c.run_s, "fastest end to end", " for the job's epochs", ":")


def _versus(choice: PlacementChoice, seconds: Callable[[Placement], float | None], fastest: str, per: str,
            lead: str) -> str | None:
    """The recommended set against one node alone (or one node against the best of several), by `seconds`."""
    rec, t = choice.recommended, seconds(choice.recommended)
    one = [c for c in choice.candidates if len(c.nodes) == 1 and seconds(c)]
    many = [c for c in choice.candidates if len(c.nodes) > 1 and seconds(c)]
    if not t or not one or not many:
        return None
    alone = min(one, key=lambda c: seconds(c) or 0.0)
    best = min(many, key=lambda c: seconds(c) or 0.0)
    if len(rec.nodes) == 1:
        b = seconds(best) or 0.0
        several = f"the best of several ({len(best.nodes)} nodes, {best.scheme.label()}) {b:.0f} s"
        if b >= t:
            return f"one node is {fastest}: {rec.nodes[0]} alone {t:.0f} s{per}, {several}"
        why = ("with a warning (marked ! in the table)" if best.warnings else
               "within the plan's margin, and it changes training more")  # recommend()
        return f"one node is recommended: {rec.nodes[0]} alone {t:.0f} s{per}, {several}, {why}"
    t1 = seconds(alone) or 0.0
    return (f"{len(rec.nodes)} nodes ({rec.scheme.label()}){lead} {t:.0f} s{per}, "
            f"{t1 / t:.1f}x faster than {alone.nodes[0]} alone ({t1:.0f} s)")


def uncalibrated(choice: PlacementChoice) -> str | None:
    """Where a candidate priced faster to the target than the recommended one was passed over for its warning
    (its scheme or its global batch beyond the lab's runs: convergence.outcomes): which, why, and the run
    that would calibrate it, since a plan of this lab learns a configuration's accuracy only from a run of
    it. None where there is none."""
    rec = choice.recommended
    if not rec.to_target_s or rec.warnings:
        return None
    faster = [c for c in choice.candidates if c.warnings and c.to_target_s
              and c.to_target_s < NEAR_BEST_TO_TARGET * rec.to_target_s]
    if not faster:
        return None
    c = min(faster, key=lambda c: c.to_target_s or 0.0)
    return (f"{len(c.nodes)} nodes ({c.scheme.label()}) are priced faster, {c.to_target_s:.0f} s, but not "
            f"recommended: {'; '.join(c.warnings)}. {_calibrating_run(choice, c)}")


def _calibrating_run(choice: PlacementChoice, c: Placement) -> str:
    """The launch whose collected run would calibrate candidate c (the plan learns a configuration's accuracy
    only from a run of it)."""
    sets = " ".join(f"--set {shlex.quote(x)}" for x in settings_of(c))
    return (f"One run of it calibrates the plan: clusterctl launch {choice.job} {sets} (and the plan's other "
            "--set), then clusterctl collect")


def unpriced(choice: PlacementChoice) -> str | None:
    """Where candidates of several nodes could not be priced to the target (no collected run at their global
    batch, no noise scale to bring one there) and could still reach it sooner than the recommended one
    (Placement.within_epochs): the likeliest of them (no warning, fewest micro-batches, the most epochs to
    spare, then the shortest epoch), how many epochs it has, and the run that would calibrate it. Without
    this a plan of a lab with one calibration run reads as if the node counts between were slower. None
    where there is none."""
    open_ = [c for c in choice.candidates if c.within_epochs]
    if not open_ or not choice.convergence:
        return None
    c = min(open_, key=lambda c: (bool(c.warnings), c.accumulate, -(c.within_epochs or 0), c.epoch_s or 0.0,
                                  *changes(c)[1:]))
    conv, rec = choice.convergence, choice.recommended
    epochs = f"; the job trains {conv['job_epochs']}" if conv.get("job_epochs") else ""
    others = f" ({len(open_) - 1} more such candidates: - in the table's time column)" if len(open_) > 1 else ""
    return (f"{len(c.nodes)} nodes ({c.scheme.label()}, global batch {c.global_batch}) are not priced to "
            f"validation accuracy {float(conv['target']):g}: no collected run at that batch, and no gradient "
            "noise scale to bring a run's samples to it (bench's probe, PyTorch jobs only, or plain runs at two "
            f"batches). They reach it sooner than the recommendation ({rec.to_target_s:.0f} s) if they do "
            f"within {c.within_epochs} epochs ({c.epoch_s or 0:.0f} s an epoch{epochs}){others}. "
            + _calibrating_run(choice, c))


def continued(choice: PlacementChoice) -> str | None:
    """Where some of the recommended candidate's references put the target past the job's epochs: how many,
    how its time counts those (the run trains on to the target, or a `launch --continue`), and its best and
    worst outcome; None where none do."""
    conv = choice.convergence or {}
    rec, epochs, target = choice.recommended, conv.get("job_epochs"), conv.get("target")
    late = [e for e in rec.epochs_to_target if epochs and e > epochs]
    if not late or target is None:
        return None
    on = int(conv.get("job_trains_on") or epochs or 0)
    restart = f"{rec.restart_s:.0f} s to end and start again" if rec.restart_s is not None else \
        "no run on as many nodes to say what ending and starting again costs: 0 s counted"
    if max(late) <= on:
        how = f"the job trains on to it (target_acc, max_epochs {on}), no restart"
    else:
        how = (f"theirs with `clusterctl launch --continue RUN --set epochs={max(late)}` ({restart}); "
               f"`--set target_acc={float(target):g} --set max_epochs={max(late)}` trains on to it instead, "
               "without the restart")
    spread = (f": {rec.to_target_range_s[0]:.0f} s at best, {rec.to_target_range_s[1]:.0f} s at worst"
              if rec.to_target_range_s else "")
    return (f"{len(late)} of the {len(rec.epochs_to_target)} collected runs it is priced from reach validation "
            f"accuracy {float(target):g} only after the job's {epochs} epochs: its time is the mean, {how}"
            + spread)


def other_schedule(choice: PlacementChoice) -> str | None:
    """Where the recommended candidate's time to the target comes only from collected runs planned for other
    epochs than the job's (convergence.outcomes takes them when none of the job's own exist): which, and
    the run that calibrates it. A longer schedule keeps the learning rate high longer and reaches a high
    target later: on the emulated room such plans priced picks an epoch late (+63-66%, performance.md).
    None where the job's own schedule is among them, or no target was asked."""
    conv = choice.convergence or {}
    rec, epochs, target = choice.recommended, conv.get("job_epochs"), conv.get("target")
    if not rec.to_target_s or not epochs or target is None:
        return None
    fam = convergence.family(rec.scheme)
    refs = [r for r in conv.get("references") or [] if r.get("scheme") == fam]
    planned = sorted({int(r["epochs"]) for r in refs if isinstance(r.get("epochs"), int)})
    if not any(r.get("reached") for r in refs) or not planned or epochs in planned:
        return None  # (none of its own reached: priced as plain, which its warning says)
    return (f"its time to {float(target):g} is priced from collected runs with {fam} planned for "
            f"{', '.join(map(str, planned))} epochs, not the job's {epochs}: a schedule of another length decays "
            "its learning rate at another time and reaches a high target at another epoch (docs/planning.md). "
            f"`clusterctl launch {choice.job} --plan` runs it for the job's epochs, and calibrates it once collected")


def even_kept(choice: PlacementChoice) -> str | None:
    """Where the recommended candidate keeps the job's even shares although balance() gave others: which, and
    how much faster the model priced them (less than SHARES_GAIN, bench's spread between two measurements of a
    node). None where its shares are balance()'s own."""
    rec = choice.recommended
    if not rec.balanced or not rec.balanced_images_per_s:
        return None
    gain = rec.balanced_images_per_s / rec.planned_images_per_s - 1
    return (f"its shares are the job's even ones ({_shares(rec.shares)}): "
            f"balanced ones ({_shares(rec.balanced)}) are priced at "
            f"{rec.balanced_images_per_s:.1f} images/s against {rec.planned_images_per_s:.1f} ({100 * gain:+.1f}%), "
            f"less than the {100 * (SHARES_GAIN - 1):.0f}% faster that outweighs bench's spread between two "
            "measurements of a node; and a run on other shares than its references' is another draw of training "
            "(docs/planning.md)")


def _shares(shares: dict[str, int]) -> str:
    """Batch shares as the plan prints them: "node1=32, node2=32"."""
    return ", ".join(f"{n}={b}" for n, b in shares.items())


THIN = 0.01  # passed the target by less than this (a point): seeds' accuracies at one epoch differ by more


def thin(choice: PlacementChoice) -> str | None:
    """Where a run the recommended candidate's time to the target is priced from passed the target by less
    than a point at the epoch that reached it (Placement.spare): by how few validation images, and what the epoch more
    costs that a run of it scoring a little lower (another seed, other shares) trains. On the emulated room,
    picks one image of 359 short took 1.5x their priced time (docs/performance.md). None where they passed
    by more, no target was asked, or the runs do not say."""
    rec, left = choice.recommended, choice.recommended.spare
    if not rec.to_target_s or not rec.epoch_s or left is None or left[0] / left[1] >= THIN:
        return None
    n, v, count = left
    runs = "a collected run" if count == 1 else f"{count} collected runs"
    target = float((choice.convergence or {})["target"])
    return (f"{runs} it is priced from reached validation accuracy {target:g} with as few as {n} of {v} "
            f"images to spare ({100 * n / v:.1f} points) at the epoch that did: a run of it that scores a little "
            f"lower (another seed, other shares) reaches it an epoch later, +{rec.epoch_s:.0f} s "
            f"({100 * rec.epoch_s / rec.to_target_s:.0f}% more)")


def other_processor(choice: PlacementChoice) -> str | None:
    """Where collected runs the recommended candidate's time to the target is priced from ran on other
    processors than its nodes (facts.processor: the CPU's model and vector extension, the GPUs): which. The
    same program replays a run to the digit on the same processors and computes other floats on others, so
    its epoch at the target is then another draw (docs/planning.md). None where they are the same, no target
    was asked, or bench or a run's saved facts do not say."""
    conv, rec = choice.convergence or {}, choice.recommended
    mine = conv.get("processors") or {}
    if not rec.to_target_s or not rec.priced_from or any(n not in mine for n in rec.nodes):
        return None
    here = {mine[n] for n in rec.nodes}
    refs = [r for r in conv.get("references") or [] if r.get("run_id") in rec.priced_from]
    if not refs or not all(r.get("processors") for r in refs):
        return None
    other = [r for r in refs if set(r["processors"]) != here]
    if not other:
        return None
    runs = "a collected run" if len(refs) == 1 else f"{len(other)} of the {len(refs)} collected runs"
    return (f"{runs} its time to {float(conv['target']):g} is priced from ran on "
            f"{' / '.join(sorted({p for r in other for p in r['processors']}))}, its nodes are "
            f"{' / '.join(sorted(here))}: a run on other processors computes other floats and may reach the "
            "target at another epoch (on the emulated room, one node's run scored 0.986 at its first epoch on "
            "AVX2 and 0.975 on AVX-512: docs/planning.md). A run of it on these nodes, once collected, is "
            "priced with the others")


def summary_rows(choice: PlacementChoice) -> tuple[list[str], list[list[str]]]:
    """`clusterctl plan`'s table (header, rows of strings): per node set its uncompressed row and its
    fastest scheme, and every scheme of the recommended node set; the recommended row's nodes cell ends
    with " (recommended)", a scheme with an accuracy warning is marked "!"."""
    target = choice.convergence["target"] if choice.convergence else None
    header = ["nodes", "scheme", "global batch", "even split img/s", "planned split img/s", "e2e img/s", "run s",
              *([f"s to {target:g}", "epochs to it"] if target else []),
              "step s", "all-reduce wait s", "MB/step", "epoch s", "shares"]
    rec = choice.recommended
    best: dict[int, Placement] = {}
    for c in choice.candidates:
        if len(c.nodes) not in best or speed(c) > speed(best[len(c.nodes)]):
            best[len(c.nodes)] = c
    shown = [c for c in choice.candidates if c.nodes == rec.nodes or best[len(c.nodes)] is c
             or (c.grad_compression == "none" and c.accumulate == 1)]
    rows = []
    for c in shown:
        mark = " (recommended)" if c.nodes == rec.nodes and c.scheme == rec.scheme else ""
        rows.append([",".join(c.nodes) + mark, c.scheme.label() + (" !" if c.warnings else ""),
                     str(c.global_batch), f"{c.even_images_per_s:.1f}", f"{c.planned_images_per_s:.1f}",
                     "-" if c.e2e_images_per_s is None else f"{c.e2e_images_per_s:.1f}",
                     "-" if c.run_s is None else f"{c.run_s:.0f}",
                     *([_cell(c.to_target_s, "{:.0f}"), _cell(_epochs(c, choice), "{:.1f}")] if target else []),
                     f"{c.step_s:.3f}", f"{c.comm_s:.3f}",
                     "-" if c.bytes_per_step is None else f"{c.bytes_per_step / 1e6:.2f}",
                     f"{c.epoch_s:.0f}" if c.epoch_s else "-", _shares(c.shares)])
    return header, rows


def _cell(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def _epochs(c: Placement, choice: PlacementChoice) -> float | None:
    """Epochs to the target: the mean over the references' whole epochs (a plan saved before them: the
    training sets the samples to the target make)."""
    if c.epochs_to_target:
        return statistics.fmean(c.epochs_to_target)
    n = (choice.convergence or {}).get("train_samples")
    return c.samples_to_target / n if c.samples_to_target and n else None


def _job_bench(inv: Inventory, spec: jobs.JobSpec, job: str) -> tuple[bench.BenchResult, bench.FrameworkBench]:
    """The inventory's benchmark, checked to fit the job (framework, batch, image size)."""
    b = bench.load(inv)
    comp = b.compute.get(spec.framework)
    if not comp or not comp.nodes:
        raise ClusterError(f"the benchmark of {inv.name} has no {spec.framework} figures",
                           f"clusterctl bench -i {inv.path} --jobs {job}")
    if comp.batch != spec["batch"] or comp.size != spec["dataset"]["size"]:
        raise ClusterError(f"the benchmark ran batch {comp.batch} at {comp.size} px, the job uses "
                           f"batch {spec['batch']} at {spec['dataset']['size']} px",
                           f"re-run clusterctl bench with the job's settings (--set batch={spec['batch']})")
    return b, comp


def choose(inv: Inventory, job: str, overrides: list[str] | None = None, limit: str | None = None,
           target_acc: float | None = None) -> PlacementChoice:
    """Every candidate node set x communication scheme for the job, the best one recommended; saved for
    `launch --plan`. `limit` (a host pattern) narrows the job's nodes the candidates are made of.
    `target_acc`: rank by the predicted time to that validation accuracy (convergence.py)."""
    spec = jobs.load(job, overrides or [])
    b, comp = _job_bench(inv, spec, job)
    allowed = {h.name for h in launch.select_hosts(inv, spec, limit)}
    speeds = {n: NodeSpeed.from_bench(r) for n, r in comp.nodes.items() if n in allowed}
    work = workload(spec, b.network)
    cands = candidates(speeds, spec["batch"], b.network, work=work)
    conv = None
    if target_acc is not None:
        model = convergence.calibrate(spec, target_acc, comp.noise_scale)
        to_target(cands, speeds, b.network, work, model)
        conv = {**model.to_dict(), "processors": {n: p for n, p in b.processors.items() if n in speeds},
                "train_samples": work.train_samples, "job_epochs": work.epochs,
                "job_trains_on": work.trains_on(target_acc)}
    rec = recommend(cands)
    if conv:
        bound_unpriced(cands, rec, speeds, b.network, work)
    choice = PlacementChoice(spec.name, spec.framework, str(inv.path), time.time(), b.time, speeds, b.network,
                             spec["batch"], cands, rec, conv)
    p = choice_path(inv, spec.name)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(choice.to_dict(), indent=1))
    return choice


def workload(spec: jobs.JobSpec, network: NetworkBench | None) -> Workload:
    """The job's gradients (its model's real shapes with its dataset's classes) and the schemes to weigh:
    no compression, fp16 and PowerSGD at the job's rank on either wire, each with accumulate 1, 2, 4 and the
    job's own, and local SGD at the job's period."""
    shapes, samples, val = commmodel.job_model(spec)
    if shapes is None:
        return Workload.flat(network, samples)
    accumulates = tuple(sorted({1, 2, 4, int(spec["accumulate"])}))
    return Workload(shapes, spec.framework, float(spec["bucket_mb"]),
                    tuple(commmodel.schemes(int(spec["powersgd_rank"]), accumulates,
                                            int(spec["localsgd_period"]), jobs.POWERSGD_WIRES)), samples,
                    int(spec["epochs"]), float(spec["optimizer"]["warmup_epochs"]), int(spec["powersgd_start_step"]),
                    int(spec["localsgd_start_step"]), val or 0, int(spec["bn_recompute"]),
                    float(spec["target_acc"]), int(spec["max_epochs"]))


def choice_path(inv: Inventory, job: str) -> Path:
    """Where `clusterctl plan` saves its document (the folder keeps the command's name)."""
    return paths.home() / "plans" / f"{paths.inventory_key(inv.name, inv.path)}-{job}.json"


def load_recommended(inv: Inventory, job: str) -> Placement:
    p = choice_path(inv, job)
    if not p.exists():
        raise ClusterError(f"no plan for {job} on {inv.name}", f"make one: clusterctl plan {job} -i {inv.path}")
    try:
        return Placement.from_dict(json.loads(read_regular(p, f"remove {p} and make it again: clusterctl plan {job} "
                                                              f"-i {inv.path}", noun="a plan"))["recommended"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{p}: not a plan clusterctl can read ({type(e).__name__}: {e})",
                         f"make it again: clusterctl plan {job} -i {inv.path}") from None


def overrides_for(inv: Inventory, job: str) -> list[str]:
    """`launch --plan`: the recommended nodes, their shares and communication scheme, as job settings
    (settings given after them, `--set`, still win)."""
    return settings_of(load_recommended(inv, job))


def settings_of(c: Placement) -> list[str]:
    """A candidate's nodes, shares and communication scheme as job settings (`--set`): only the keys its scheme
    reads (a plain candidate's launch line names no PowerSGD rank), PowerSGD's wire always with PowerSGD, since
    the plan weighs both and the job's own may be the other."""
    powersgd = c.grad_compression == "powersgd"
    return ([f"nodes=[{', '.join(c.nodes)}]"] + [f"shares.{n}={b}" for n, b in c.shares.items()]
            + [f"grad_compression={c.grad_compression}"]
            + ([f"powersgd_rank={c.powersgd_rank}"] if powersgd else [])
            + [f"accumulate={c.accumulate}"]
            + ([f"localsgd_period={c.localsgd_period}"] if c.scheme.local else [])
            + ([f"powersgd_wire={c.powersgd_wire}"] if powersgd else []))
