"""How many samples a job needs to reach a validation accuracy, per global batch and communication scheme:
the model behind `clusterctl plan --target-acc` (docs/planning.md "Time to a target accuracy").

McCandlish et al. ("An Empirical Model of Large-Batch Training", 2018): to reach a given loss, the samples a
run needs grow with its global batch B as

    E(B) = E_min x (1 + B / B_noise)

with B_noise the gradient noise scale. The plan measures no accuracy itself; it is calibrated by
- the lab's own collected runs of the job that reached the target (`references`): each gives the samples
  it took, at its global batch and scheme, so E_min per scheme (plain all-reduce and fp16 are one: fp16
  costs no accuracy, docs/performance.md);
- B_noise: fitted from two plain references at different global batches where the lab has them, else the
  probe bench ran (its gradient noise at the run's start, bench.noise_scale), else none: then only the
  references' own global batches can be predicted.
A scheme without a run of its own is assumed to need the plain samples, and the candidate says so: PowerSGD
and local SGD usually need more (measured on digits: docs/planning.md), so that assumption flatters them.
A collected run that trained all it was given without reaching the target is data too: its scheme needs more
samples than it trained (a floor on E_min), so the plan never prices that scheme below what the lab has
already seen fail (on the emulated room a PowerSGD run that missed 0.979 in 12 epochs was otherwise priced
as plain, at 31 s against one node's 24).

The plan prices each reference's outcome, not their mean (`outcomes`): a configuration that sometimes
reaches the target in the job's epochs and sometimes ends a validation image short is either of two whole
epoch counts, never the mean's one, and the plan's figure is the mean of their times, the continuation's
restart included (placement.to_target). Where the lab has runs planned for the job's own epochs, those are
its references: a run planned longer decays its learning rate later and reaches a high target later.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from cluster.errors import ClusterError
from cluster.nodes import facts
from cluster.runs import jobs, records as runs
from cluster.study import figures
from cluster.study.commmodel import Scheme


@dataclass(frozen=True)
class Reference:
    """One collected run of the job: its samples to the target, at its batch and scheme; or, `reached`
    False, every sample it trained without reaching it."""

    run_id: str
    global_batch: int
    scheme: str  # Convergence.family of its scheme
    samples: float
    reached: bool = True
    epochs: int | None = None  # the epochs it was planned for: its learning-rate schedule's length
    nodes: int = 1
    # what ending it and launching it again would cost: its launch to its start record, plus its last epoch's
    # record to its end record (the user's own wait between them is not counted)
    restart_s: float | None = None
    # reached: the validation accuracy of the epoch that reached the target, and how many images it scored
    # (the start record's val_samples): how near the target it passed (plans.thin)
    acc: float | None = None
    val_samples: int | None = None
    # facts.processor of its nodes, each once (empty where collect saved no facts for one of them): the same
    # program reaches the target at the same epoch on the same processors, another on others (plans.other_processor)
    processors: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "global_batch": self.global_batch, "scheme": self.scheme,
                "samples": self.samples, "reached": self.reached, "epochs": self.epochs, "nodes": self.nodes,
                "restart_s": self.restart_s, "acc": self.acc, "val_samples": self.val_samples,
                "processors": list(self.processors)}

    def spare(self, target: float) -> tuple[int, int] | None:
        """(the validation images it scored above the fewest that reach `target`, of how many it scored) at
        the epoch that reached it; None where it did not, or does not say."""
        if not self.reached or self.acc is None or not self.val_samples:
            return None
        v = self.val_samples
        return round(self.acc * v) - math.ceil(target * v - 1e-9), v


@dataclass(frozen=True)
class Outcome:
    """What one reference says of a candidate: the samples to the target at its global batch, or, `reached`
    False, that it needs more than `samples` (a run that trained them without reaching it)."""

    run_id: str
    samples: float
    reached: bool
    spare: tuple[int, int] | None = None  # Reference.spare, of the scheme's own references only


def family(scheme: Scheme) -> str:
    """Schemes that train alike: plain and fp16 are one; PowerSGD per rank (its wire's bfloat16 rounding is
    far below the rank's approximation: docs/planning.md), local SGD per period."""
    if scheme.grad_compression in ("none", "fp16"):
        return "plain"
    return Scheme(scheme.grad_compression, scheme.powersgd_rank, 1, scheme.localsgd_period).label()


def progress(lead: dict[int, list[figures.Record]], target: float) -> tuple[float, bool, float | None] | None:
    """(the samples rank 0's records trained up to the end of the first epoch whose val_acc reached the
    target, True, that val_acc), or (every sample they trained, False, None) where none did; each epoch once
    (a redone one counts as its later record). None where an epoch's samples cannot be told, or no epoch ended."""
    done: dict[Any, float] = {}
    for k in sorted(lead):
        start = next((x for x in lead[k] if x.get("type") == "start"), {})
        for x in lead[k]:
            if x.get("type") != "epoch":
                continue
            n = figures.epoch_samples(x, start)
            if n is None:
                return None
            done[x.get("epoch")] = n
            if float(x.get("val_acc") or 0.0) >= target:
                return sum(done.values()), True, float(x["val_acc"])
    return (sum(done.values()), False, None) if done else None


def samples_to_target(lead: dict[int, list[figures.Record]], target: float) -> float | None:
    """The samples to the first epoch at the target (progress), or None where no epoch reached it."""
    p = progress(lead, target)
    return p[0] if p and p[1] else None


def _scheme_of(settings: dict[str, Any], nodes: int) -> Scheme:
    if nodes < 2:
        return Scheme()
    return Scheme(str(settings.get("grad_compression", "none")), int(settings.get("powersgd_rank", 2)),
                  1, int(settings.get("localsgd_period", 8)))


def references(spec: jobs.JobSpec, target: float) -> list[Reference]:
    """Every collected run of this job that ended succeeded or stopped, whose settings match the plan's (all
    but nodes, shares, the wire and accumulation, which the plan varies, target_acc and max_epochs, which say
    where a run ends, not how it trains, and epochs: a run planned longer
    decays its learning rate later, so reaches a high target later, a pessimistic reference, which
    Convergence.outcomes leaves out where runs of the job's own epochs exist): those that
    reached the target, and (reached False) the succeeded ones that trained all their epochs without. A run
    that continued another (`continues`) did not start from scratch: it never matches."""
    skip = {"nodes", "shares", "accumulate", "epochs", "target_acc", "max_epochs", *jobs.WIRE_KEYS}
    want = {k: v for k, v in spec.settings.items() if k not in skip}
    out = []
    for r in runs.scan()[0]:
        if r.job != spec.name or r.state not in ("succeeded", "stopped") or not r.collected:
            continue
        if {k: v for k, v in jobs.with_defaults(r.settings).items() if k not in skip} != want:
            continue
        lead = figures.lead_records(r)
        start = next((x for k in sorted(lead) for x in lead[k] if x.get("type") == "start"), None)
        seen = progress(lead, target)
        if start is None or seen is None or not start.get("global_batch") or not (seen[1] or r.state == "succeeded"):
            continue
        own_target = float(jobs.with_defaults(r.settings).get("target_acc") or 0)
        if not seen[1] and 0 < own_target < target:
            continue  # it ended at its own, lower target_acc: not a run that trained all it could
        scheme = _scheme_of(r.settings or {}, len(r.nodes))
        epochs = jobs.with_defaults(r.settings).get("epochs")
        val = start.get("val_samples")
        out.append(Reference(r.run_id, int(start["global_batch"]), family(scheme), seen[0], seen[1],
                             epochs=int(epochs) if isinstance(epochs, int) else None, nodes=len(r.nodes),
                             restart_s=_restart_s(r, lead, start), acc=seen[2],
                             val_samples=val if isinstance(val, int) and val > 0 else None,
                             processors=_processors(r)))
    return out


def _processors(r: runs.RunRecord) -> tuple[str, ...]:
    """facts.processor of each of the run's nodes, from the facts collect saved beside its files; () where
    one of them is not known."""
    base, seen = runs.run_path(r.run_id), set()
    for n in r.nodes:
        p = facts.processor(figures.node_facts(base / n.node))
        if not p:
            return ()
        seen.add(p)
    return tuple(sorted(seen))


def _restart_s(r: runs.RunRecord, lead: dict[int, list[figures.Record]], start: figures.Record) -> float | None:
    """Seconds from the run's launch to its first start record, plus from its last epoch's record to the end
    record after it (none where it was stopped): what a `launch --continue` adds between two epochs."""
    def when(x: figures.Record | None) -> float | None:
        t = (x or {}).get("time")
        return float(t) if isinstance(t, (int, float)) else None

    t = when(start)
    if t is None or not isinstance(r.created, (int, float)) or t < r.created:
        return None
    recs = [x for k in sorted(lead) for x in lead[k]]
    last = max((i for i, x in enumerate(recs) if x.get("type") == "epoch"), default=len(recs))
    end = next((x for x in recs[last:] if x.get("type") == "end"), None)
    t_last, t_end = when(recs[last] if last < len(recs) else None), when(end)
    return t - r.created + (max(0.0, t_end - t_last) if t_last is not None and t_end is not None else 0.0)


def fit_noise(refs: list[Reference]) -> float | None:
    """B_noise from two plain references at different global batches (the smallest and the largest):
    E2 / E1 = (1 + B2/Bn) / (1 + B1/Bn). None where they do not bound it (r <= 1: no cost measured, or
    r >= B2/B1: not even the steps were saved)."""
    plain = sorted((r for r in refs if r.scheme == "plain" and r.reached), key=lambda r: r.global_batch)
    if len(plain) < 2 or plain[0].global_batch == plain[-1].global_batch:
        return None
    lo, hi = plain[0], plain[-1]
    ratio = hi.samples / lo.samples
    if not 1.0 < ratio < hi.global_batch / lo.global_batch:
        return None
    return (hi.global_batch - ratio * lo.global_batch) / (ratio - 1.0)


@dataclass
class Convergence:
    """E_min per scheme family and B_noise, with where each came from."""

    target: float
    noise_scale: float | None
    noise_source: str  # "runs" | "probe" | "none"
    e_min: dict[str, float] = field(default_factory=dict)
    references: list[Reference] = field(default_factory=list)
    # per family, the most E_min a run that missed the target puts under it (its samples back at batch 0)
    floor: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "noise_scale": self.noise_scale, "noise_source": self.noise_source,
                "e_min": dict(self.e_min), "floor": dict(self.floor),
                "references": [r.to_dict() for r in self.references]}

    def _growth(self, batch: int) -> float:
        return 1.0 + batch / self.noise_scale if self.noise_scale else 1.0

    def outcomes(self, batch: int, scheme: Scheme, epochs: int | None = None) -> tuple[list[Outcome], str | None]:
        """Each reference's samples to the target at this global batch and scheme, and a warning or None.

        The references are the scheme's family's (plain's, with a warning, where the family has none that
        reached: raised to the most its runs that missed trained, with that warning), of those planned for
        `epochs` where there are any (the job's schedule); each brought to `batch` by B_noise. Without
        B_noise, only references run at `batch` (none: an empty list: it cannot be priced). A batch above
        every reference's, where B_noise is the probe's, is priced with a warning: the probe reads the noise
        at the run's start, a floor, so it undercounts a larger batch's samples (a new lab's first plan was
        44% short of a 4x larger batch's time, docs/performance.md); runs at two batches fit it instead."""
        fam = family(scheme)
        own = [r for r in self.references if r.scheme == fam]
        pool = own if any(r.reached for r in own) else [r for r in self.references if r.scheme == "plain"]
        assumed = pool is not own
        floors = [r for r in own if not r.reached] if assumed else []
        if epochs is not None and any(r.epochs == epochs for r in pool):
            pool = [r for r in pool if r.epochs == epochs]
        if not self.noise_scale:
            pool, floors = ([r for r in rs if r.global_batch == batch] for rs in (pool, floors))
        at = [Outcome(r.run_id, r.samples / self._growth(r.global_batch) * self._growth(batch), r.reached,
                      None if assumed else r.spare(self.target)) for r in pool]
        note = None if not assumed or not at else (f"no collected run with {fam}: assumed to need an "
                                                   "uncompressed run's samples to the target (it usually needs more)")
        if floors:
            worst = max(floors, key=lambda r: r.samples / self._growth(r.global_batch))
            floor = worst.samples / self._growth(worst.global_batch) * self._growth(batch)
            if not at or any(o.samples < floor for o in at):
                at = [o if o.samples >= floor else Outcome(worst.run_id, floor, False) for o in at] or \
                    [Outcome(worst.run_id, floor, False)]
                note = (f"a collected run with {fam} ({worst.run_id}) trained {worst.samples:.0f} samples at "
                        f"global batch {worst.global_batch} without reaching {self.target:g}: at least that "
                        "many assumed")
        top = max((r.global_batch for r in pool if r.reached), default=0)
        if note is None and at and self.noise_source == "probe" and batch > top:
            note = (f"priced beyond the lab's runs: the largest global batch of a collected run with {fam} that "
                    f"reached {self.target:g} is {top}, and what {batch} needs more comes from bench's noise "
                    "probe alone, which undercounts it (docs/planning.md)")
        return at, note

    def restart_s(self, nodes: int) -> float | None:
        """What a `launch --continue` costs on `nodes` nodes: the median of the newest three references on
        that many (the lab's start cost changes with its code and its load), else on the nearest number
        of nodes (of two as near, the larger: a start waits for its slowest node); None where none says."""
        known = [r for r in self.references if r.restart_s is not None]
        if not known:
            return None
        near = min({r.nodes for r in known}, key=lambda n: (abs(n - nodes), -n))
        return statistics.median([r.restart_s for r in known if r.nodes == near and r.restart_s is not None][-3:])


def calibrate(spec: jobs.JobSpec, target: float, probe: float | None) -> Convergence:
    """The model for this job and target from the lab's runs and bench's probe; a ClusterError naming
    the fix when no run of the job reached the target (the plan cannot guess an accuracy)."""
    refs = references(spec, target)
    if not any(r.reached for r in refs):
        raise ClusterError(f"plan --target-acc {target:g}: no collected run of {spec.name} with these settings "
                           f"reached validation accuracy {target:g}, and the plan measures no accuracy itself",
                           f"run it once and collect it (clusterctl launch {spec.name} --limit NODE, then "
                           "clusterctl collect), or ask for a lower --target-acc")
    fitted = fit_noise(refs)
    noise, source = (fitted, "runs") if fitted else ((probe, "probe") if probe else (None, "none"))
    conv = Convergence(target, noise, source, references=refs)
    for fam in sorted({r.scheme for r in refs}):
        mine = [r for r in refs if r.scheme == fam and r.reached]
        if mine:  # the mean of each reference brought back to batch 0 (E_min): several runs average their noise
            conv.e_min[fam] = math.fsum(r.samples / conv._growth(r.global_batch) for r in mine) / len(mine)
        missed = [r.samples / conv._growth(r.global_batch) for r in refs if r.scheme == fam and not r.reached]
        if missed:
            conv.floor[fam] = max(missed)
    return conv
