"""The record of a simulated lab (lab.json in its directory): its nodes, addresses, processes and limits."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster import paths
from cluster.errors import UsageError


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
class SlurmState:
    """`lab up --slurm`: the lab's Slurm cluster, what the launch target and `lab status`/`down` need."""
    conf: str  # slurm.conf on the head (-f / SLURM_CONF); the PCs see its folder at /etc/slurm
    shared: str  # the cluster's shared folder on the head
    shared_mount: str  # where the login and compute nodes see it (the same path on each)
    login: NodeState  # the login node: sshd and the Slurm client, not a compute node
    controller: str  # slurmctld's address on the lab's bridge
    ctld_port: int
    slurmd_port: int  # each slurmd in its node's own network namespace
    munge_socket: str
    jobcomp: str  # JobCompLoc: what `sacct -c` reads
    partition: str
    python: str  # the head's interpreter, for a python_env: existing through the shared /usr
    via: str | None = None  # --gateway: the namespace slurmctld and the head's clients run in
    munged_pid: int | None = None
    slurmctld_pid: int | None = None
    slurmd_pids: dict[str, int] = field(default_factory=dict)  # node name -> pid


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
    slurm: SlurmState | None = None  # --slurm: a real Slurm (slurmctld on the head, slurmd on each node)
    users: dict[str, str] = field(default_factory=dict)  # --users: name -> their key and inventory, in their home


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
    if raw.get("slurm"):  # absent from a lab.json written before --slurm existed
        raw["slurm"] = SlurmState(**{**raw["slurm"], "login": NodeState(**raw["slurm"]["login"])})
    return LabState(**raw)


def save_state(state: LabState) -> None:
    paths.write_atomic(Path(state.dir) / "lab.json", json.dumps(asdict(state), indent=2) + "\n")


def find_node(state: LabState, which: str) -> NodeState:
    """A node of the lab by name or number (node2 or 2), as the user names it on the command line."""
    name = f"node{which}" if which.isdigit() else which
    for n in state.nodes:
        if n.name == name:
            return n
    raise UsageError(f"lab {state.name} has no node {which!r}", f"use one of {[n.name for n in state.nodes]}")


def probe_ns(state: LabState) -> str | None:
    """The namespace the head reaches the lab's bridge from: the gateway's in a --gateway lab (the head has no
    route to it), else the head's own (None)."""
    return state.jump.netns if state.jump else None


@dataclass
class NodeStatus:
    name: str
    address: str
    netns: bool
    sshd: bool
    port_open: bool
    power: str = "on"
