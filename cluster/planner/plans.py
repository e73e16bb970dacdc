"""A job's plan on an inventory: `clusterctl plan JOB` prices every candidate (placement.py) from the
inventory's bench, saves the document `launch --plan` reads, and says what it found: the verdict against
one node alone, the table, and where it kept the job's even shares (docs/planning.md)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from cluster import paths
from cluster.bounds import read_regular
from cluster.errors import ClusterError, UsageError
from cluster.inventory.model import Inventory
from cluster.runs import jobs, preflight, schema
from cluster.planner import bench, commmodel
from cluster.planner.bench import NetworkBench
from cluster.planner.placement import SHARES_GAIN, NodeSpeed, Placement, PlacementChoice, Workload, candidates, \
    recommend, speed


def verdict(choice: PlacementChoice) -> str | None:
    """The plan's answer in a sentence, end to end over the job's epochs: the recommended node set against one
    node alone, or, where one node is recommended, against the fastest set of several. None without the
    job's length."""
    rec, t = choice.recommended, choice.recommended.run_s
    one = [c for c in choice.candidates if len(c.nodes) == 1 and c.run_s]
    many = [c for c in choice.candidates if len(c.nodes) > 1 and c.run_s]
    if not t or not one or not many:
        return None
    alone = min(one, key=lambda c: c.run_s or 0.0)
    best = min(many, key=lambda c: c.run_s or 0.0)
    if len(rec.nodes) == 1:
        b = best.run_s or 0.0
        several = f"the best of several ({len(best.nodes)} nodes, {best.scheme.label()}) {b:.0f} s"
        if b >= t:
            return f"one node is fastest end to end: {rec.nodes[0]} alone {t:.0f} s for the job's epochs, {several}"
        why = ("with a warning (marked ! in the table)" if best.warnings else
               "within the plan's margin, and it changes training more")  # recommend()
        return f"one node is recommended: {rec.nodes[0]} alone {t:.0f} s for the job's epochs, {several}, {why}"
    t1 = alone.run_s or 0.0
    return (f"{len(rec.nodes)} nodes ({rec.scheme.label()}): {t:.0f} s for the job's epochs, "
            f"{t1 / t:.1f}x faster than {alone.nodes[0]} alone ({t1:.0f} s)")


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
            "measurements of a node (docs/planning.md)")


def _shares(shares: dict[str, int]) -> str:
    """Batch shares as the plan prints them: "node1=32, node2=32"."""
    return ", ".join(f"{n}={b}" for n, b in shares.items())


def summary_rows(choice: PlacementChoice) -> tuple[list[str], list[list[str]]]:
    """`clusterctl plan`'s table (header, rows of strings): per node set its uncompressed row and its
    fastest scheme, and every scheme of the recommended node set; the recommended row's nodes cell ends
    with " (recommended)", a scheme with an accuracy warning is marked "!"."""
    header = ["nodes", "scheme", "global batch", "even split img/s", "planned split img/s", "e2e img/s", "run s",
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
                     f"{c.step_s:.3f}", f"{c.comm_s:.3f}",
                     "-" if c.bytes_per_step is None else f"{c.bytes_per_step / 1e6:.2f}",
                     f"{c.epoch_s:.0f}" if c.epoch_s else "-", _shares(c.shares)])
    return header, rows


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


def choose(inv: Inventory, job: str, overrides: list[str] | None = None, limit: str | None = None) -> PlacementChoice:
    """Every candidate node set x communication scheme for the job, the best one recommended; saved for
    `launch --plan`. `limit` (a host pattern) narrows the job's nodes the candidates are made of."""
    spec = jobs.load(job, overrides or [])
    b, comp = _job_bench(inv, spec, job)
    allowed = {h.name for h in preflight.select_hosts(inv, spec, limit)}
    speeds = {n: NodeSpeed.from_bench(r) for n, r in comp.nodes.items() if n in allowed}
    work = workload(spec, b.network)
    cands = candidates(speeds, spec["batch"], b.network, work=work)
    choice = PlacementChoice(spec.name, spec.framework, str(inv.path), time.time(), b.time, speeds, b.network,
                             spec["batch"], cands, recommend(cands))
    p = choice_path(inv, spec.name)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(choice.to_dict(), indent=1))
    return choice


def workload(spec: jobs.JobSpec, network: NetworkBench | None) -> Workload:
    """The job's gradients (its model's real shapes with its dataset's classes) and the schemes to weigh:
    no compression, fp16 and PowerSGD at the job's rank on either wire, each with accumulate 1, 2, 4 and the
    job's own."""
    shapes, samples, val = commmodel.job_model(spec)
    if shapes is None:
        return Workload.flat(network, samples)
    accumulates = tuple(sorted({1, 2, 4, int(spec["accumulate"])}))
    return Workload(shapes, spec.framework, float(spec["bucket_mb"]),
                    tuple(commmodel.schemes(int(spec["powersgd_rank"]), accumulates, schema.POWERSGD_WIRES)), samples,
                    int(spec["epochs"]), float(spec["optimizer"]["warmup_epochs"]), int(spec["powersgd_start_step"]),
                    val or 0, int(spec["bn_recompute"]))


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
            + ([f"powersgd_wire={c.powersgd_wire}"] if powersgd else []))
