"""Shaping a lab like a real room: link rates (tc), the head's one uplink, and per-node CPU speed (cgroups).

Only the lab's own devices and cgroups are touched, each named after the lab.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from cluster.errors import LabError
from cluster.lab.net import sh

RATE_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)\Z")


def shape_link(netns: str, veth: str, bandwidth: str) -> None:
    """Both directions, like a 1 GbE port: towards the node on the host side, from it inside."""
    tbf = ("root", "tbf", "rate", bandwidth, "burst", "128kb", "latency", "50ms")
    sh("tc", "qdisc", "add", "dev", veth, *tbf)
    sh("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "eth0", *tbf)


def unshape_link(netns: str, veth: str) -> None:
    """The link back at the bridge's full speed (a benchmark's runs whose arithmetic, not timing, counts)."""
    sh("tc", "qdisc", "del", "dev", veth, "root")
    sh("ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", "eth0", "root")


def shape_uplink(name: str, bridge: str, rate: str) -> str:
    """One limit for the head's side of the bridge, in each direction: what the head sends to any node
    leaves through the bridge device's root qdisc; what any node sends to the head arrives on the bridge's
    ingress, which is redirected to an ifb device shaped the same way. Frames from node to node are
    forwarded between the ports without passing either, like a switch. Only the lab's own devices are
    touched (never the host's routes, firewall or other interfaces). Returns the ifb's name."""
    ifb = f"{name}-ifb"
    tbf = ("root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms")
    sh("tc", "qdisc", "add", "dev", bridge, *tbf)
    sh("ip", "link", "add", ifb, "type", "ifb")
    sh("ip", "link", "set", ifb, "up")
    sh("tc", "qdisc", "add", "dev", ifb, *tbf)
    sh("tc", "qdisc", "add", "dev", bridge, "handle", "ffff:", "ingress")
    # u32 matching everything (cls_matchall is not in every kernel)
    sh("tc", "filter", "add", "dev", bridge, "parent", "ffff:", "protocol", "all", "u32", "match", "u32", "0", "0",
        "action", "mirred", "egress", "redirect", "dev", ifb)
    return ifb


CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")


def _cgroup_dir(lab: str, node: str) -> Path:
    if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
        return CGROUP_V1 / f"clusterctl-{lab}-{node}"
    v2 = CGROUP_V2 / "cgroup.controllers"
    if v2.exists() and "cpu" in v2.read_text().split():
        return CGROUP_V2 / f"clusterctl-{lab}-{node}"
    raise LabError("per-node CPU limits need the cgroup cpu controller (v1 or v2)",
                   "start the lab without --cpu-quota, or on a machine with cgroups")


def limit_cpu(lab: str, node: str, pid: int, core: int, quota: float) -> None:
    """Pin the node's sshd `pid` (and so everything started through it) to one core, and cap its CPU time."""
    cg = _cgroup_dir(lab, node)
    cg.mkdir(exist_ok=True)
    period = 100_000
    if (cg / "cpu.cfs_quota_us").exists():
        (cg / "cpu.cfs_period_us").write_text(str(period))
        (cg / "cpu.cfs_quota_us").write_text(str(int(quota * period)))
    else:
        (cg / "cpu.max").write_text(f"{int(quota * period)} {period}")
    (cg / "cgroup.procs").write_text(str(pid))
    os.sched_setaffinity(pid, {core})


def remove_cgroups(lab: str) -> list[str]:
    removed = []
    for base in (CGROUP_V1, CGROUP_V2):
        for cg in base.glob(f"clusterctl-{lab}-node*") if base.exists() else []:
            try:
                cg.rmdir()  # only empty groups can go: down() has ended their processes
                removed.append(f"cgroup {cg.name}")
            except OSError:
                pass
    return removed
