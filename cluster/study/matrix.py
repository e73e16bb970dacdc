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
from cluster.study import figures, report
from cluster.runs import jobs, records, schema
from cluster.schedulers import api
from cluster.errors import ClusterError, UsageError
from cluster.inventory.model import Inventory
from cluster.room.held import SlurmHolds


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
    return setting == first or (setting or "").partition("=")[0] not in schema.WIRE_KEYS


def study_dir(sid: str) -> Path:
    return paths.home() / "studies" / sid


def run(inv: Inventory, job_names: list[str], sizes: list[int], overrides: list[str] | None = None,
        price_kwh: float | None = None, log: Callable[[str], None] = lambda s: None,
        on_run: Callable[[records.RunRecord, Any], None] | None = None,
        target_acc: float = figures.DEFAULT_TARGET_ACC, vary: str | None = None, limit: str | None = None,
        forks: int = 32, on: str | None = None, outside_slurm: bool = False) -> tuple[str, list[Cell], Path | None]:
    """Each job on each node count (the first N of its nodes, narrowed by `limit`, a host pattern), each run
    collected, one report; `forks` bounds the nodes contacted at once. `on`: the inventory's Slurm cluster of
    that name runs every cell instead (N nodes of its partition, Slurm's verdict, the job's folder collected)."""
    overrides = list(overrides or [])
    settings = variants(vary)
    # every spec valid before anything runs
    specs = {(name, v): jobs.load(name, overrides + ([v] if v else [])) for name in job_names for v in settings}
    if not sizes or any(n < 1 for n in sizes):
        raise UsageError(f"--nodes {sizes}: expected node counts >= 1", "e.g. --nodes 1,2,4")
    sched = api.for_launch(on, inv)
    api.check_options(sched, {"limit": limit}, on)
    sid = study_id(inv, job_names, sizes, overrides, vary, limit, on)
    d = study_dir(sid)
    d.mkdir(parents=True, exist_ok=True)
    rec_path = d / "study.json"
    done = json.loads(rec_path.read_text())["cells"] if rec_path.exists() else []
    previous = {(c["job"], c["nodes"], c.get("setting")): c for c in done}
    cells: list[Cell] = []
    for (name, setting), spec in specs.items():
        pcs = sched.pcs(api.Submission(inv, spec, on=on, limit=limit))
        most = None if pcs is None else len(pcs)
        what = name + (f" with {setting}" if setting else "")
        for n in sizes:
            if most is not None and n > most:
                raise UsageError(f"--nodes {n}: job {name} has only {most} nodes in {inv.path}",
                                 f"use counts up to {most}")
            if n == 1 and not _runs_alone(setting, settings[0]):
                continue
            cell = Cell(name, n, setting=setting)
            old = previous.get((name, n, setting))
            if old and old.get("state") == "succeeded":
                cell.run_id, cell.state, cell.skipped = old["run_id"], "succeeded", True
                log(f"{what} on {n} node(s): done before ({old['run_id']})")
                cells.append(cell)
                continue
            log(f"{what} on {n} node(s)" + (f" of {on}" if on else ""))
            try:
                request = sched.dryrun(api.Submission(inv, spec, on=on, limit=limit, forks=forks, nodes=n,
                                                      outside_slurm=outside_slurm), log)
                record = sched.submit(request, log, forks=forks)
                cell.run_id = record.run_id
                record = sched.follow(record, on_update=on_run)
                cell.state = record.state
                sched.collect(record, forks=forks)
            except SlurmHolds:
                raise  # PCs a room's Slurm holds: every cell would be refused, the study is
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


def _save(path: Path, sid: str, inv: Inventory, job_names: list[str], sizes: list[int], overrides: list[str],
          vary: str | None, cells: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"study": sid, "inventory": str(inv.path), "jobs": job_names, "nodes": sizes,
                                "set": overrides, "vary": vary, "updated": time.time(), "cells": cells}, indent=1))
