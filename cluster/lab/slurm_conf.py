"""The lab's Slurm configuration (`lab up --slurm`): slurm.conf and cgroup.conf, and the addresses, ports and
sizes they name; text only (nothing started here), so that what a lab's Slurm is told can be read and tested."""
from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

from cluster.errors import LabError

PARTITION = "debug"
CPUS = 2  # per compute node: bookkeeping only (no confinement, no pinning), whatever the host has
SLURMD_POINT = Path("/srv/clusterctl-slurmd")  # each compute node's own slurmd spool, pid and log
SLURMD_PORT = 6818  # each slurmd in its own network namespace: no clash between nodes or labs

CGROUP_CONF = """\
# cgroup.conf of a clusterctl simulated lab (written by `clusterctl lab up --slurm`)
# Slurm 22.05 always loads a cgroup plugin; the nodes see no /sys/fs/cgroup of their own, and with
# proctrack/linuxproc and task/none nothing is confined: CPU counts are bookkeeping only.
CgroupPlugin=cgroup/v1
"""


def login_address(net: ipaddress.IPv4Network) -> str:
    """The login node's address: the subnet's .10, below the nodes (.11+) and apart from a gateway's."""
    return str(list(net.hosts())[9])


def ctld_port(net: ipaddress.IPv4Network) -> int:
    """slurmctld's port on the head, from the lab's subnet (labs have subnets of their own), moved past any
    port already taken."""
    base = 20000 + (int(net.network_address) >> (32 - net.prefixlen)) % 20000
    for port in range(base, base + 50):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise LabError(f"no free port for slurmctld in {base}-{base + 49}", "free one, or use another --subnet")


def render_slurm_conf(*, name: str, ctld_host: str, ctld_addr: str, ctld_port: int, munge_socket: str,
                      slurm_dir: str, jobcomp: str, nodes: list[tuple[str, str]], cpus: int = CPUS,
                      partition: str = PARTITION) -> str:
    """slurm.conf of the lab: one controller, `nodes` (name, address) in one default partition."""
    node_lines = "".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN\n" for n, a in nodes)
    return f"""\
# slurm.conf of clusterctl simulated lab '{name}' (written by `clusterctl lab up --slurm`)
ClusterName={name}
# NOTE: no CommunicationParameters=NoCtldInAddrAny: slurmctld would bind to what the head's name resolves to
SlurmctldHost={ctld_host}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={slurm_dir}/ctld
SlurmctldPidFile={slurm_dir}/slurmctld.pid
SlurmctldLogFile={slurm_dir}/slurmctld.log
SlurmctldDebug=info
# each compute node's own folder (mounted there in its namespace)
SlurmdSpoolDir={SLURMD_POINT}/spool
SlurmdPidFile={SLURMD_POINT}/slurmd.pid
SlurmdLogFile={SLURMD_POINT}/slurmd.log
SlurmdDebug=info
# the configured CPUs win over what the (shared) host really has
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# no slurmdbd: `sacct -c` reads one line per finished job from this file
JobCompType=jobcomp/filetxt
JobCompLoc={jobcomp}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
# a crashed node is DOWN after 25-33 s; a restarted slurmd brings it back
SlurmdTimeout=20
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=300
{node_lines}PartitionName={partition} Nodes={','.join(n for n, _ in nodes)} Default=YES MaxTime=60 State=UP
"""


def render_cgroup_conf() -> str:
    return CGROUP_CONF
