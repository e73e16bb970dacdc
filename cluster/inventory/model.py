"""The inventory as the rest of clusterctl sees it: hosts, their GPUs, groups and rank 0.

Plain frozen values, built and validated by cluster.inventory.loader (which re-exports them).
"""
from __future__ import annotations

import getpass
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from cluster.bounds import Range
from cluster.inventory import patterns

# Fields a host may carry; defaults and groups may set all of them except HOST_ONLY.
HOST_FIELDS = (
    "address",
    "port",
    "user",
    "identity_file",
    "known_hosts",
    "python",
    "workdir",
    "connection",
    "gpu",
    "connect_timeout",
    "command_timeout",
    "ssh_config",
    "proxy_jump",
    "proxy_command",
    "host_key_alias",
    "become",
    "mac",
    "vars",
)
HOST_ONLY = ("address", "mac")  # one PC's own: never set for a group or as a default
TOP_KEYS = ("name", "rank0", "defaults", "groups", "hosts", "slurm")  # slurm: Slurm clusters (docs/slurm.md)
GPU_KEYS = ("count", "model", "compute_capability")
CONNECTIONS = ("ssh", "local")
# A known_hosts file is read whole on every command: one line per key (~100-700 bytes), so 16 MiB is tens of
# thousands of hosts. Larger, it is not a known_hosts file (or it is /dev/zero under another name).
KNOWN_HOSTS_MAX_BYTES = 16 << 20
# The numbers an inventory gives, and what each accepts (docs/inventory.md says the same beside each field).
# connect_timeout: 10 minutes is already a node no one should wait for; command_timeout: a day, the longest
# step (an install over a slow link) with room to spare. Both finite: an infinite one removes the bound.
NUMBERS = {
    "port": Range(1, 65535, integer=True),
    "connect_timeout": Range(0, 600, low_open=True),
    "command_timeout": Range(0, 86400, low_open=True),
    "gpu.count": Range(0, 64, integer=True),
    "gpu.compute_capability": Range(1, 100, high_open=True),  # CUDA's major.minor, e.g. 6.1
}

MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}\Z")


def normalize_mac(text: str) -> str | None:
    """`AA-BB-CC-DD-EE-FF`, `aa:bb:...`, `aabb.ccdd.eeff` -> `aa:bb:cc:dd:ee:ff`; None if it is not one."""
    digits = re.sub(r"[^0-9a-fA-F]", "", text) if re.fullmatch(r"[0-9a-fA-F:.\-]{12,17}", text or "") else ""
    if len(digits) != 12:
        return None
    mac = ":".join(digits[i:i + 2] for i in range(0, 12, 2)).lower()
    return mac if mac not in ("00:00:00:00:00:00", "ff:ff:ff:ff:ff:ff") else None


@dataclass(frozen=True)
class GpuSpec:
    """What the inventory says a node's GPUs are (overrides or checks facts)."""

    count: int
    model: str | None = None
    compute_capability: str | None = None


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    port: int = 22
    user: str = field(default_factory=getpass.getuser)
    identity_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    python: str = "python3"
    workdir: str = "clusterctl"
    connection: str = "ssh"
    gpu: GpuSpec | None = None
    connect_timeout: float = 5.0
    command_timeout: float = 600.0
    ssh_config: str | None = None  # an OpenSSH client config file; None: OpenSSH's own (~/.ssh/config); "none"
    proxy_jump: str | None = None  # OpenSSH's ProxyJump: [user@]host[:port][,...] (resolved into `jumps`)
    proxy_command: str | None = None  # OpenSSH's ProxyCommand (%h %p %r %n %%), run by /bin/sh
    host_key_alias: str | None = None  # OpenSSH's HostKeyAlias: the name its key has in known_hosts
    become: bool = False  # the steps that need root run through `sudo -n` (never a password)
    mac: str | None = None  # its NIC's Ethernet address, for Wake-on-LAN (`check` records it for nodes it reaches)
    groups: tuple[str, ...] = ()
    vars: Mapping[str, Any] = field(default_factory=dict)
    jumps: tuple[Host, ...] = ()  # the jump hosts, first hop first (cluster.inventory.sshconfig resolves them)

    @property
    def known_hosts_path(self) -> Path:
        return Path(self.known_hosts).expanduser()

    @property
    def key_path(self) -> Path | None:
        return Path(self.identity_file).expanduser() if self.identity_file else None

    @property
    def host_key_name(self) -> str:
        """The name known_hosts files use for this node: its HostKeyAlias as it is, else OpenSSH's `addr` or
        `[addr]:port` form (sshconnect.c get_hostfile_hostname_ipaddr)."""
        if self.host_key_alias:
            return self.host_key_alias
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    @property
    def route(self) -> str:
        """How the head reaches it, for messages: `user@addr:port`, after its jump hosts or proxy command."""
        via = [f"{j.user}@{j.address}:{j.port}" for j in self.jumps]
        if self.proxy_command:
            via = [f"ProxyCommand {self.proxy_command}"]
        return " -> ".join([*via, f"{self.user}@{self.address}:{self.port}"])

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("name",) + HOST_FIELDS}
        d["gpu"] = None if self.gpu is None else vars(self.gpu).copy()
        d["vars"] = dict(self.vars)
        d["groups"] = list(self.groups)
        d["jumps"] = [j.to_dict() for j in self.jumps]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Host:
        """The inverse of to_dict (a run record's snapshot of how each node was reached)."""
        d = dict(d)
        gpu = d.pop("gpu", None)
        d["groups"] = tuple(d.get("groups", ()))
        d["jumps"] = tuple(cls.from_dict(j) for j in d.get("jumps", ()))
        return cls(**d, gpu=GpuSpec(**gpu) if gpu else None)


@dataclass(frozen=True)
class SlurmCluster:
    """A Slurm cluster of the inventory's `slurm:` section (cluster/inventory/clusters.py reads it): the login
    node a job is submitted from, reached like any host, and where its jobs go (`launch JOB --on NAME`)."""

    name: str
    login: Host
    workdir: str  # absolute, on the cluster's shared filesystem
    partition: str | None = None  # None: Slurm's default partition
    account: str | None = None
    qos: str | None = None
    python: str = "python3"  # the cluster's environment: a path, or a command found after env_setup
    env_setup: str | None = None  # shell lines (e.g. `module load ...`), run before the job's Python

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "login": self.login.to_dict(), "workdir": self.workdir,
                "partition": self.partition, "account": self.account, "qos": self.qos, "python": self.python,
                "env_setup": self.env_setup}


@dataclass(frozen=True)
class RoomCluster:
    """The room itself as a Slurm cluster (`slurm.NAME` with `controller` and `nodes`; `provision --slurm`
    sets it up): slurmctld on the controller PC, which never runs jobs; slurmd on each PC of `nodes`."""

    name: str
    controller: Host
    nodes: tuple[str, ...]  # inventory host names, in inventory order
    partition: str = "room"
    default_time: str | None = None  # a job's time limit when it gives none (None: no limit)
    max_time: str | None = None  # the longest a job may ask (None: no limit)
    max_pcs_per_job: int | None = None  # the most PCs one job may hold (None: all of them)
    suspend_after: int | None = None  # seconds idle before Slurm switches a PC off (None: never)
    resume_timeout: int | None = None  # seconds a woken PC has to answer Slurm (None: from the recorded wakes)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "controller": self.controller.to_dict(), "nodes": list(self.nodes),
                "partition": self.partition, "default_time": self.default_time, "max_time": self.max_time,
                "max_pcs_per_job": self.max_pcs_per_job, "suspend_after": self.suspend_after,
                "resume_timeout": self.resume_timeout}


@dataclass(frozen=True)
class Inventory:
    path: Path
    name: str
    hosts: dict[str, Host]
    groups: dict[str, tuple[str, ...]]
    rank0: str
    format: str = "clusterctl"
    notes: tuple[str, ...] = ()  # said once by the CLI (e.g. an OpenSSH setting clusterctl does not follow)
    ansible_core: str | None = None  # the ansible-core version that read it; None: clusterctl read it
    clusters: dict[str, SlurmCluster] = field(default_factory=dict)  # `slurm:`: `launch --on NAME` (own schema)
    rooms: dict[str, RoomCluster] = field(default_factory=dict)  # `slurm:` entries with a controller (the room's)
    overrides: tuple[str, ...] = ()  # the command line's KEY=VALUE it was read with: what a later reader repeats

    def select(self, limit: str | None, option: str = "--limit") -> list[Host]:
        """The hosts an Ansible host pattern selects (docs/cli.md "Host patterns"), in inventory order.

        Where ansible-core read the inventory (and is still importable), Ansible's own matcher decides;
        anywhere else the exact subset of cluster.inventory.patterns, which refuses what it does not read.
        """
        if not limit:
            return list(self.hosts.values())
        if self.ansible_core is not None:
            from cluster.inventory import ansible_core

            if ansible_core.available():
                chosen = set(ansible_core.match([self.path], limit, option))
                return [h for n, h in self.hosts.items() if n in chosen]
        chosen = set(patterns.match(limit, list(self.hosts), self.groups, str(self.path), option,
                                    subscripts=self.format == "clusterctl"))
        return [h for n, h in self.hosts.items() if n in chosen]

    @property
    def matcher(self) -> str:
        """Who reads `--limit` patterns for this inventory (`clusterctl hosts` says it)."""
        if self.ansible_core is not None:
            from cluster.inventory import ansible_core

            if ansible_core.available():
                return f"ansible-core {self.ansible_core}"
        return "clusterctl (the subset of docs/cli.md)"

    def ordered(self, hosts: Iterable[Host]) -> list[Host]:
        """Rank 0 first, then inventory order: the order ranks are given out."""
        hosts = list(hosts)
        return sorted(hosts, key=lambda h: (h.name != self.rank0, list(self.hosts).index(h.name)))
