"""Run records on the head: $CLUSTERCTL_HOME/runs/<run-id>/run.json (and the rendered files).

A record carries everything needed to find the run again without the inventory
it came from: the job's resolved settings, a snapshot of the hosts, and each
node's run folder and process ids.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from cluster import paths
from cluster.errors import UsageError
from cluster.inventory import GpuSpec, Host

ACTIVE = ("starting", "running")
FINAL = ("succeeded", "failed", "stopped")
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def runs_dir() -> Path:
    return paths.home() / "runs"


def new_run_id(job: str) -> str:
    return f"{job}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def run_path(run_id: str) -> Path:
    if not RUN_ID_RE.match(run_id):
        raise UsageError(f"'{run_id}' is not a run id", "see `clusterctl runs` for the ids")
    return runs_dir() / run_id


def save(record: dict[str, Any]) -> Path:
    """Write the record atomically; keys starting with `_` are the caller's working state, not saved."""
    d = run_path(record["run_id"])
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "run.json.tmp"
    kept = {k: v for k, v in record.items() if not k.startswith("_")}
    tmp.write_text(json.dumps(kept, indent=1, default=str) + "\n")
    os.replace(tmp, d / "run.json")  # a reader never sees half a record
    return d / "run.json"


def load(run_id: str | None = None) -> dict[str, Any]:
    """A run by id (a unique prefix will do), or the latest one."""
    if run_id is None:
        records = list_runs()
        if not records:
            raise UsageError("no runs recorded yet", "start one: clusterctl launch resnet50-ddp")
        return records[-1]
    p = run_path(run_id) / "run.json"
    if not p.exists():
        matches = [r for r in list_runs() if r["run_id"].startswith(run_id)]
        if len(matches) == 1:
            return matches[0]
        raise UsageError(f"no run '{run_id}'" + (f" ({len(matches)} runs start with it)" if matches else ""),
                         "see `clusterctl runs` for the ids")
    return json.loads(p.read_text())


def list_runs() -> list[dict[str, Any]]:
    """Every recorded run, oldest first."""
    out = []
    d = runs_dir()
    for p in d.glob("*/run.json") if d.exists() else []:
        try:
            out.append(json.loads(p.read_text()))
        except ValueError:
            continue
    return sorted(out, key=lambda r: r.get("created", 0))


def hosts(record: dict[str, Any]) -> list[Host]:
    """The hosts as they were when the run started (the inventory may have changed since)."""
    out = []
    for d in record["inventory"]["hosts"]:
        d = dict(d)
        gpu = d.pop("gpu", None)
        d["groups"] = tuple(d.get("groups", ()))
        out.append(Host(**d, gpu=GpuSpec(**gpu) if gpu else None))
    return out
