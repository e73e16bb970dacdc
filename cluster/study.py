"""`clusterctl study`: the paper's matrix (each job on 1, 2, ... N nodes), collected and reported.

A study is identified by its inventory, jobs, node counts and settings; its
record ($CLUSTERCTL_HOME/studies/<id>/study.json) maps each cell to its run, so
running the same command again skips the cells already done and retries the rest.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cluster import collect, jobs, launch, paths, report, runs
from cluster.errors import ClusterError, UsageError
from cluster.inventory import Inventory


@dataclass
class Cell:
    job: str
    nodes: int
    run_id: str | None = None
    state: str = "pending"  # pending | succeeded | failed | stopped | error
    error: str | None = None
    skipped: bool = False  # done by an earlier invocation


def study_id(inv: Inventory, job_names: list[str], sizes: list[int], overrides: list[str]) -> str:
    blob = json.dumps({"inventory": str(inv.path), "jobs": job_names, "sizes": sizes, "set": sorted(overrides)})
    return f"study-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def study_dir(sid: str) -> Path:
    return paths.home() / "studies" / sid


def run(inv: Inventory, job_names: list[str], sizes: list[int], overrides: list[str] | None = None,
        price_kwh: float | None = None, log: Callable[[str], None] = lambda s: None,
        on_run: Callable[[runs.RunRecord, Any], None] | None = None,
        target_acc: float = report.DEFAULT_TARGET_ACC) -> tuple[str, list[Cell], Path | None]:
    overrides = list(overrides or [])
    specs = {name: jobs.load(name, overrides) for name in job_names}  # every spec valid before anything runs
    if not sizes or any(n < 1 for n in sizes):
        raise UsageError(f"--nodes {sizes}: expected node counts >= 1", "e.g. --nodes 1,2,4")
    sid = study_id(inv, job_names, sizes, overrides)
    d = study_dir(sid)
    d.mkdir(parents=True, exist_ok=True)
    rec_path = d / "study.json"
    done = json.loads(rec_path.read_text())["cells"] if rec_path.exists() else []
    previous = {(c["job"], c["nodes"]): c for c in done}
    cells: list[Cell] = []
    for name, spec in specs.items():
        hosts = launch.select_hosts(inv, spec, None)
        for n in sizes:
            if n > len(hosts):
                raise UsageError(f"--nodes {n}: job {name} has only {len(hosts)} nodes in {inv.path}",
                                 f"use counts up to {len(hosts)}")
            cell = Cell(name, n)
            old = previous.get((name, n))
            if old and old.get("state") == "succeeded":
                cell.run_id, cell.state, cell.skipped = old["run_id"], "succeeded", True
                log(f"{name} on {n} node(s): done before ({old['run_id']})")
                cells.append(cell)
                continue
            subset = ",".join(h.name for h in hosts[:n])
            log(f"{name} on {n} node(s): {subset}")
            try:
                record, _ = launch.launch(inv, spec, limit=subset, log=log)
                cell.run_id = record.run_id
                record = launch.follow(record, on_update=on_run)
                cell.state = record.state
                collect.collect(record)
            except ClusterError as e:
                cell.state, cell.error = "error", e.message
            cells.append(cell)
            previous[(name, n)] = dict(cell.__dict__)  # saved after every cell: an interrupted study resumes
            _save(rec_path, sid, inv, job_names, sizes, overrides, list(previous.values()))
    _save(rec_path, sid, inv, job_names, sizes, overrides, [dict(c.__dict__) for c in cells])
    finished = [c.run_id for c in cells if c.state == "succeeded" and c.run_id]
    page = None
    if finished:
        page = d / "report.html"
        figs, _ = report.write_pages(finished, html=page, markdown=d / "report.md", price_kwh=price_kwh,
                                     target_acc=target_acc)
        (d / "report.json").write_text(json.dumps([f.to_dict() for f in figs], indent=1, default=str))
    return sid, cells, page


def _save(path: Path, sid: str, inv: Inventory, job_names: list[str], sizes: list[int], overrides: list[str],
          cells: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"study": sid, "inventory": str(inv.path), "jobs": job_names, "nodes": sizes,
                                "set": overrides, "updated": time.time(), "cells": cells}, indent=1))
