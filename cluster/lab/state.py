"""The record of a simulated lab (lab.json in its directory): its nodes, addresses, processes and limits."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster import paths


@dataclass
class NodeState:
    name: str
    netns: str
    veth: str
    address: str
    hostname: str
    dir: str
    pid: int | None = None
    cpu: str | None = None  # "0" (the core it is pinned to)
    cpu_quota: float | None = None  # cores' worth of CPU time it may use (cgroup CPU bandwidth)
    power: str = "on"  # `lab power off`: "off", its namespace empty but for a Wake-on-LAN listener
    listener: int | None = None  # that listener's pid while the node is off


@dataclass
class LabState:
    name: str
    subnet: str
    bridge: str
    gateway: str
    bandwidth: str | None
    dir: str
    inventory: str
    nodes: list[NodeState]
    uplink: str | None = None  # the head's NIC: one limit shared by all head<->node traffic
    ifb: str | None = None  # the device that shapes node->head traffic (the bridge's ingress, redirected)
    jump: NodeState | None = None  # --gateway: the one PC the head reaches (its sshd); the nodes only through it
    user: str = "root"  # --user: the nodes' login user (not root: NOPASSWD sudo, in each node's own /etc copies)


def default_dir(name: str) -> Path:
    return paths.home() / "labs" / name


def state_path(name: str, directory: Path | None) -> Path:
    return (directory or default_dir(name)) / "lab.json"


def load_state(name: str, directory: Path | None = None) -> LabState | None:
    p = state_path(name, directory)
    if not p.exists():
        return None
    raw = json.loads(p.read_text())
    raw["nodes"] = [NodeState(**n) for n in raw["nodes"]]
    raw["jump"] = NodeState(**raw["jump"]) if raw.get("jump") else None
    return LabState(**raw)


def save_state(state: LabState) -> None:
    (Path(state.dir) / "lab.json").write_text(json.dumps(asdict(state), indent=2) + "\n")


@dataclass
class NodeStatus:
    name: str
    address: str
    netns: bool
    sshd: bool
    port_open: bool
    power: str = "on"
