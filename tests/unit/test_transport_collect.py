"""collect against a node whose agent lies (a compromised or broken node): every path it names must land
strictly inside the node's folder on the head, or be refused by name; nothing is written anywhere else."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from cluster.runs import collect, render
from cluster.inventory.model import Host
from cluster.transport.local import LocalTransport


@pytest.mark.parametrize("rel", [".", "./", "a/.", "./x", "a/./b", "", "..", "/", "/etc/passwd", "a/../../b"])
def test_dot_empty_climbing_and_absolute_paths_are_refused(tmp_path: Path, rel: str) -> None:
    base = tmp_path / "run" / "node1"
    with pytest.raises(collect.UnsafePath):
        collect.safe_dest(base, rel)


def test_plain_relative_paths_are_accepted(tmp_path: Path) -> None:
    base = tmp_path / "run" / "node1"
    assert collect.safe_dest(base, "train.log") == base / "train.log"
    assert collect.safe_dest(base, "out/metrics.jsonl") == base / "out" / "metrics.jsonl"
    assert collect.safe_dest(base, ".hidden") == base / ".hidden"
    assert collect.safe_dest(base, "a..b") == base / "a..b"


def _hostile_agent(workdir: Path, files: list[object]) -> None:
    """A node agent that answers `manifest` with the given entries (what a tampered node could send)."""
    agent = workdir / render.AGENT
    agent.parent.mkdir(parents=True)
    agent.write_text(f"import json, sys\nprint(json.dumps({{'ok': True, 'files': {files!r}, 'skipped': []}}))\n")


def test_a_lying_listing_cannot_write_outside_the_node_folder(tmp_path: Path) -> None:
    workdir, head = tmp_path / "node", tmp_path / "head"
    run_dir = workdir / "runs" / "r1"
    run_dir.mkdir(parents=True)
    good = b"epoch 1 loss 0.5\n"
    (run_dir / "train.log").write_bytes(good)
    sha = hashlib.sha256(good).hexdigest()
    entry = {"size": len(good), "sha256": sha}
    bad_paths = [".", "", "..", "./", "a/./b", "/etc/passwd", "out/../../../x"]
    _hostile_agent(workdir, [{"path": p, **entry} for p in bad_paths] + [
        {"path": "train.log", **entry},
        {"path": None, **entry},  # not a string
        {"path": "other.log", "size": "big", "sha256": sha},  # not a size
        {"path": "third.log", "size": len(good), "sha256": "x" * 64},  # not a sha256
        "train.log",  # not an entry at all
    ])
    t = LocalTransport(Host(name="node1", address="127.0.0.1", connection="local", workdir=str(workdir),
                            python=sys.executable))
    dest = head / "runs" / "r1" / "node1"
    res = collect.collect_node(t, str(run_dir), dest, checkpoints=False)
    assert res.status == "ok" and res.files == 1 and res.fetched == 1
    assert (dest / "train.log").read_bytes() == good
    refused = {r["path"]: r["reason"] for r in res.refused}
    assert set(refused) >= {".", "", "..", "./", "a/./b", "/etc/passwd", "out/../../../x", "None"}
    assert len(res.refused) == len(bad_paths) + 4
    assert all(r.startswith("node1: refused") and "nothing written" in r for r in refused.values())
    # nothing beside the node's folder, nothing above it
    assert sorted(p.name for p in (head / "runs" / "r1").iterdir()) == ["node1"]
    assert sorted(p.name for p in (head / "runs").iterdir()) == ["r1"]
    assert not (head / "runs" / "r1" / "node1.part").exists()
    assert not list(tmp_path.glob("*.part")) and not (tmp_path / "x").exists()
    assert json.dumps(res.to_dict())  # the result is plain data (run.json, --json)
