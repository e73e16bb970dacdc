"""`clusterctl study`: the paper's matrix (each job on 1, 2, ... N nodes), collected and reported.

A study is identified by its inventory, jobs, node counts, settings and the one
setting it varies (`--vary grad_compression=none,fp16`: the comparison with and
without compression in one command); its record
($CLUSTERCTL_HOME/studies/<id>/study.json) maps each cell to its run, so running
the same command again skips the cells already done and retries the rest.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cluster import paths
from cluster.study import report
from cluster.runs import collect, jobs, launch, records
from cluster.errors import ClusterError, UsageError
from cluster.inventory.model import Inventory


@dataclass
class Cell:
    job: str
    nodes: int
    run_id: str | None = None
    state: str = "pending"  # pending | succeeded | failed | stopped | error
    error: str | None = None
    skipped: bool = False  # done by an earlier invocation
    setting: str | None = None  # the varied setting of this cell, KEY=VALUE (None: nothing varied)


def study_id(inv: Inventory, job_names: list[str], sizes: list[int], overrides: list[str],
             vary: str | None = None, limit: str | None = None, on: str | None = None) -> str:
    doc: dict[str, Any] = {"inventory": str(inv.path), "jobs": job_names, "sizes": sizes, "set": sorted(overrides)}
    if on:  # a Slurm cluster's runs are another study than the room's
        doc["on"] = on
    if vary:  # absent otherwise: the studies recorded before --vary keep their ids
        doc["vary"] = vary
    if limit:  # the same: other nodes are another study
        doc["limit"] = limit
    return f"study-{hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:12]}"


def variants(vary: str | None) -> list[str | None]:
    """`--vary KEY=V1,V2,...` as one KEY=V setting per value (validated with the job later)."""
    if vary is None:
        return [None]
    key, eq, values = vary.partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not eq or not key.strip() or len(vals) < 2 or len(set(vals)) < len(vals):
        raise UsageError(f"--vary {vary!r}: expected one setting and two or more different values",
                         "e.g. --vary grad_compression=none,fp16")
    return [f"{key.strip()}={v}" for v in vals]


def _runs_alone(setting: str | None, first: str | None) -> bool:
    """Whether a one-node cell of this variant is run: once for a setting that only changes the wire
    (the report's scaling baseline of every variant), else for each value."""
    return setting == first or (setting or "").partition("=")[0] not in jobs.WIRE_KEYS


def study_dir(sid: str) -> Path:
    return paths.home() / "studies" / sid


def run(inv: Inventory, job_names: list[str], sizes: list[int], overrides: list[str] | None = None,
        price_kwh: float | None = None, log: Callable[[str], None] = lambda s: None,
        on_run: Callable[[records.RunRecord, Any], None] | None = None,
        target_acc: float = report.DEFAULT_TARGET_ACC, vary: str | None = None, limit: str | None = None,
        forks: int = 32, on: str | None = None) -> tuple[str, list[Cell], Path | None]:
    """Each job on each node count (the first N of its nodes, narrowed by `limit`, a host pattern), each run
    collected, one report; `forks` bounds the nodes contacted at once. `on`: the inventory's Slurm cluster of
    that name runs every cell instead (N nodes of its partition, Slurm's verdict, the job's folder collected)."""
    overrides = list(overrides or [])
    settings = variants(vary)
    # every spec valid before anything runs
    specs = {(name, v): jobs.load(name, overrides + ([v] if v else [])) for name in job_names for v in settings}
    if not sizes or any(n < 1 for n in sizes):
        raise UsageError(f"--nodes {sizes}: expected node counts >= 1", "e.g. --nodes 1,2,4")
    if on and limit:
        raise UsageError("--limit picks the inventory's PCs; a Slurm cluster chooses a job's nodes",
                         f"leave --limit out with --on {on}")
    sid = study_id(inv, job_names, sizes, overrides, vary, limit, on)
    d = study_dir(sid)
    d.mkdir(parents=True, exist_ok=True)
    rec_path = d / "study.json"
    done = json.loads(rec_path.read_text())["cells"] if rec_path.exists() else []
    previous = {(c["job"], c["nodes"], c.get("setting")): c for c in done}
    cells: list[Cell] = []
    for (name, setting), spec in specs.items():
        hosts = launch.select_hosts(inv, spec, limit) if not on else []
        what = name + (f" with {setting}" if setting else "")
        for n in sizes:
            if not on and n > len(hosts):
                raise UsageError(f"--nodes {n}: job {name} has only {len(hosts)} nodes in {inv.path}",
                                 f"use counts up to {len(hosts)}")
            if n == 1 and not _runs_alone(setting, settings[0]):
                continue
            cell = Cell(name, n, setting=setting)
            old = previous.get((name, n, setting))
            if old and old.get("state") == "succeeded":
                cell.run_id, cell.state, cell.skipped = old["run_id"], "succeeded", True
                log(f"{what} on {n} node(s): done before ({old['run_id']})")
                cells.append(cell)
                continue
            subset = ",".join(h.name for h in hosts[:n])
            log(f"{what} on {n} node(s): {subset or on}")
            try:
                if on:
                    record = _on_slurm(inv, spec, on, n, log)
                    cell.run_id, cell.state = record.run_id, record.state
                else:
                    record, _ = launch.launch(inv, spec, limit=subset, forks=forks, log=log)
                    cell.run_id = record.run_id
                    record = launch.follow(record, on_update=on_run)
                    cell.state = record.state
                    collect.collect(record, forks=forks)
            except ClusterError as e:
                cell.state, cell.error = "error", e.message
            cells.append(cell)
            previous[(name, n, setting)] = dict(cell.__dict__)  # saved after every cell: an interrupted study resumes
            _save(rec_path, sid, inv, job_names, sizes, overrides, vary, list(previous.values()))
    _save(rec_path, sid, inv, job_names, sizes, overrides, vary, [dict(c.__dict__) for c in cells])
    finished = [c.run_id for c in cells if c.state == "succeeded" and c.run_id]
    page = None
    if finished:
        page = d / "report.html"
        figs, _ = report.write_pages(finished, html=page, markdown=d / "report.md", price_kwh=price_kwh,
                                     target_acc=target_acc)
        (d / "report.json").write_text(json.dumps([f.to_dict() for f in figs], indent=1, default=str))
    return sid, cells, page


def _on_slurm(inv: Inventory, spec: jobs.JobSpec, cluster: str, nodes: int,
              log: Callable[[str], None]) -> records.RunRecord:
    """One cell on the inventory's Slurm cluster: submitted, followed to Slurm's verdict, collected."""
    from cluster.slurm import run as slurm_run, submit
    from cluster.slurm.resources import SlurmOverrides

    record = slurm_run.submit(submit.prepare(inv, spec, cluster, SlurmOverrides(nodes=nodes)), log)
    record = slurm_run.follow(record)
    slurm_run.collect(record)
    return record


def _save(path: Path, sid: str, inv: Inventory, job_names: list[str], sizes: list[int], overrides: list[str],
          vary: str | None, cells: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"study": sid, "inventory": str(inv.path), "jobs": job_names, "nodes": sizes,
                                "set": overrides, "vary": vary, "updated": time.time(), "cells": cells}, indent=1))
