"""The room's slurm.conf, gres.conf and cgroup.conf (`provision --slurm`), rendered from the PCs' facts.

Text only: nothing is written or started here, so what the room's Slurm is told can be read and golden-tested.
Debian 12's slurm-wlm 22.05 as packaged: SlurmUser=slurm, its spool and log folders and its units' pid files.
The controller runs slurmctld only; every PC of the node group is a compute node, handed out whole.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cluster.errors import ClusterError, UsageError
from cluster.room.state import POWER_BIN

# slurmctld and slurmd listen on these; srun listens in a fixed range (SrunPortRange) so a firewall can open it.
PORTS: dict[str, Any] = {"slurmctld": 6817, "slurmd": 6818, "srun": (60001, 63000)}
JOBCOMP = "/var/log/slurm/jobcomp.log"
HEADROOM_MIB, HEADROOM_SHARE = 512, 0.05
# Power saving (cluster/room/slurm_power.py, installed on the controller): one program under three names,
# since slurmctld runs each with the hostlist as its only argument.
POWER_NAMES = {"SuspendProgram": "slurm-suspend", "ResumeProgram": "slurm-resume",
               "ResumeFailProgram": "slurm-resume-fail"}
SUSPEND_TIMEOUT_S = 60  # an old PC's shutdown, with room to spare; Slurm wakes a PC again only after it (a job may wait as long)


class FactMissing(ClusterError):
    """A PC's facts lack what its slurm.conf line needs (exit 1: a blocking problem found on a node)."""


@dataclass(frozen=True)
class RoomNode:
    """One compute PC as slurm.conf describes it; `name` is the NodeName (the caller checks it is the PC's
    hostname, which slurmd looks itself up by)."""

    name: str
    hostname: str
    address: str
    cpus: int
    sockets: int
    cores_per_socket: int
    threads_per_core: int
    memory_mb: int  # RealMemory
    gpus: tuple[tuple[str, str], ...] = ()  # (gres type, device file)


def gres_type(gpu_name: str) -> str:
    """nvidia-smi's name as a Slurm word: 'NVIDIA GeForce GTX 1050 Ti' -> 'gtx_1050_ti'."""
    words = [w for w in re.split(r"[^a-z0-9]+", gpu_name.lower()) if w and w not in ("nvidia", "geforce")]
    return "_".join(words) or "gpu"


def real_memory(total_mib: int) -> int:
    """RealMemory for a PC whose /proc/meminfo MemTotal is `total_mib`: MemTotal minus max(5 %, 512 MiB).

    slurmd reports MemTotal in MiB (`slurmd -C` prints exactly /proc/meminfo's MemTotal // 1024) and drains a
    node that finds less than its configured RealMemory ("Low RealMemory"); MemTotal moves by a few MiB with a
    kernel or driver update. With memory a consumable resource (CR_Core_Memory) a job is given at most
    RealMemory, so the headroom is also what the OS, slurmd and a classroom PC's desktop keep for themselves.
    (The 5 % is stackhpc's openhpc role's; 512 MiB is the floor for PCs of 4-8 GiB, where 5 % is too little.)"""
    return total_mib - max(int(total_mib * HEADROOM_SHARE), HEADROOM_MIB)


def _need(facts: dict[str, Any], name: str, what: str, key: str) -> Any:
    value = (facts.get(what) or {}).get(key)
    if value is None:
        raise FactMissing(f"{name}: its facts have no {what}.{key}, which its slurm.conf line needs",
                          f"gather its facts again (`clusterctl check {name}`) with this clusterctl, then rerun")
    return value


def node_from_facts(name: str, address: str, facts: dict[str, Any]) -> RoomNode:
    """A PC's slurm.conf line from its facts (cluster.nodes.facts: NodeFacts.to_dict() or its values)."""
    cpus = int(_need(facts, name, "cpu", "logical"))
    sockets, cores, threads = (int(_need(facts, name, "cpu", k))
                               for k in ("sockets", "cores_per_socket", "threads_per_core"))
    if sockets * cores * threads != cpus:
        # uneven cores (a hybrid CPU, some CPUs offline): count each logical CPU as a core, so that Slurm's
        # CPUs never exceeds what slurmd finds
        sockets, cores, threads = 1, cpus, 1
    total = int(_need(facts, name, "memory", "total_mib"))
    gpu_fact = facts.get("gpus") or {}
    if gpu_fact.get("error"):
        raise FactMissing(f"{name}: nvidia-smi failed ({gpu_fact['error']}), so its GPUs are unknown",
                          "load the NVIDIA driver (nvidia-smi must list the cards), or remove nvidia-smi from a "
                          "PC without a GPU; then rerun")
    if "gpus" not in gpu_fact:
        _need(facts, name, "gpus", "gpus")
    gpus = []
    for gpu in gpu_fact["gpus"]:
        if gpu.get("index") is None:
            _need({"gpus": gpu}, name, "gpus", "index")
        gpus.append((gres_type(gpu["name"]), f"/dev/nvidia{gpu['index']}"))
    return RoomNode(name=name, hostname=str(_need(facts, name, "hostname", "name")), address=address, cpus=cpus,
                    sockets=sockets, cores_per_socket=cores, threads_per_core=threads,
                    memory_mb=real_memory(total), gpus=tuple(gpus))


def _header(file: str, cluster: str) -> str:
    return (f"# {file} of room '{cluster}', written by clusterctl (`clusterctl provision --slurm`) from the PCs'"
            " facts.\n# Hand edits are overwritten: change the inventory or the PCs, then run it again.\n")


def _gres(node: RoomNode) -> str:
    counts: dict[str, int] = {}
    for kind, _ in node.gpus:
        counts[kind] = counts.get(kind, 0) + 1
    return ",".join(f"gpu:{kind}:{n}" for kind, n in sorted(counts.items()))


def _node_line(n: RoomNode) -> str:
    gres = f" Gres={_gres(n)}" if n.gpus else ""
    return (f"NodeName={n.name} NodeAddr={n.address} CPUs={n.cpus} Sockets={n.sockets} "
            f"CoresPerSocket={n.cores_per_socket} ThreadsPerCore={n.threads_per_core} "
            f"RealMemory={n.memory_mb}{gres} State=UNKNOWN\n")


def _plugins(cgroup_v2: bool) -> str:
    if cgroup_v2:
        return ("# every PC has cgroup v2: a job is fenced into its PC's cores, memory and GPUs (cgroup.conf);\n"
                "# task/affinity pins the tasks, task/cgroup confines them (the order slurm.conf(5) recommends)\n"
                "ProctrackType=proctrack/cgroup\nTaskPlugin=task/affinity,task/cgroup\n")
    return ("# NOT CONFINED: not every PC has cgroup v2, so processes are tracked by their parents and nothing\n"
            "# limits a job to the cores, memory or GPUs it was given (see cgroup.conf)\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n")


@dataclass(frozen=True)
class Queue:
    """The room's queue policy, the admin's (inventory `slurm.ROOM`): a job's time limit when it gives none,
    the longest it may ask, the most PCs one job may hold (None: no limit)."""

    default_time: str | None = None
    max_time: str | None = None
    max_pcs_per_job: int | None = None

    def partition_limits(self) -> str:
        return (f"{f'DefaultTime={self.default_time} ' if self.default_time else ''}"
                f"MaxTime={self.max_time or 'INFINITE'}"
                f"{f' MaxNodes={self.max_pcs_per_job}' if self.max_pcs_per_job else ''}")


@dataclass(frozen=True)
class Power:
    """Slurm's power saving for the room (inventory `suspend_after`): a PC idle `suspend_after` seconds is
    switched off, and woken for the job it is given; `resume_timeout` seconds later a PC that has not
    registered is marked down. `why` says where resume_timeout came from (cluster.room.power)."""

    suspend_after: int
    resume_timeout: int
    why: str

    def lines(self) -> str:
        programs = "".join(f"{k}={POWER_BIN}/{v}\n" for k, v in POWER_NAMES.items())
        return (f"# power saving: a PC idle {self.suspend_after} s is switched off (an SSH login that may run only\n"
                "# poweroff), woken by Wake-on-LAN for a job it is given, marked DOWN with the reason if it does not\n"
                "# register within ResumeTimeout; each call is a JSON line in /var/log/slurm/clusterctl-power.log.\n"
                "# The controller is never suspended: it is no NodeName, so no SuspendExcNodes is needed.\n"
                f"SuspendTime={self.suspend_after}\n{programs}SuspendTimeout={SUSPEND_TIMEOUT_S}\n"
                f"# ResumeTimeout: {self.why}\nResumeTimeout={self.resume_timeout}\n")


def _slurm_conf(cluster: str, partition: str, ctld: str, nodes: list[RoomNode], cgroup_v2: bool,
                queue: Queue, power: Power | None = None) -> str:
    gres_types = "GresTypes=gpu\n" if any(n.gpus for n in nodes) else ""
    lo, hi = PORTS["srun"]
    return f"""{_header("slurm.conf", cluster)}ClusterName={cluster}
# the controller runs slurmctld only, never jobs: it is no NodeName below
SlurmctldHost={ctld}
SlurmctldPort={PORTS["slurmctld"]}
SlurmdPort={PORTS["slurmd"]}
# srun listens in this fixed range (not on random ports), so a firewall can open it
SrunPortRange={lo}-{hi}
AuthType=auth/munge
CredType=cred/munge
SlurmUser=slurm
SlurmdUser=root
# Debian's slurm-wlm folders, and the pid files its systemd units wait for
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
{_plugins(cgroup_v2)}# no slurmdbd: no accounting; `sacct -c` reads one line per finished job from this file
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={JOBCOMP}
# cons_tres for the --gpus options; memory is consumable, so RealMemory's headroom stays the OS's
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# the queue: first come, first served (fair share needs slurmdbd's accounting, which a room does not run);
# backfill starts a later job early where it fits before the next one's start, which time limits make known
PriorityType=priority/basic
SchedulerType=sched/backfill
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
# PCs get switched off: one that stops answering is DOWN after 2 minutes (its job requeued), and it is back
# in service as soon as its slurmd registers again after a boot
SlurmdTimeout=120
ReturnToService=2
{power.lines() if power else ""}{gres_types}{"".join(_node_line(n) for n in nodes)}\
# whole PCs: a job never shares a PC, nor its GPU, with another job (OverSubscribe=EXCLUSIVE)
PartitionName={partition} Nodes={",".join(n.name for n in nodes)} Default=YES {queue.partition_limits()} \
OverSubscribe=EXCLUSIVE State=UP
"""


def _cgroup_conf(cluster: str, cgroup_v2: bool) -> str:
    if cgroup_v2:
        return (f"{_header('cgroup.conf', cluster)}CgroupPlugin=cgroup/v2\n"
                "ConstrainCores=yes\nConstrainRAMSpace=yes\nConstrainDevices=yes\n")
    return (f"{_header('cgroup.conf', cluster)}# Jobs are NOT confined: not every PC has cgroup v2 (a kernel "
            "without it, or PCs\n# that see no /sys/fs/cgroup), so a job can use more cores, memory and GPUs "
            "than it was given.\n# Slurm 22.05 loads a cgroup plugin all the same; with proctrack/linuxproc "
            "and task/none it confines nothing.\nCgroupPlugin=cgroup/v1\n")


def _gres_conf(cluster: str, nodes: list[RoomNode]) -> str:
    lines = [f"NodeName={n.name} Name=gpu Type={kind} File={dev}\n" for n in nodes for kind, dev in n.gpus]
    return _header("gres.conf", cluster) + "".join(lines)


def render(*, cluster: str, partition: str, controller_hostname: str, controller_address: str,
           nodes: list[RoomNode], cgroup_v2: bool, queue: Queue = Queue(), power: Power | None = None
           ) -> dict[str, str]:
    """{file name: text} for /etc/slurm/ on every PC of the room; gres.conf only where a PC has a GPU;
    `power`: Slurm's power saving (None: PCs stay on).
    `cgroup_v2` must hold for every PC (the caller passes all(...)): one PC without it leaves the room
    unconfined, since one slurm.conf names the plugins for all."""
    if not nodes:
        raise UsageError(f"room '{cluster}' has no compute PCs", "name a group of PCs in slurm.<room>.nodes")
    ordered = sorted(nodes, key=lambda n: n.name)
    names = [n.name for n in ordered]
    if len(set(names)) != len(names) or controller_hostname in names:
        raise UsageError(f"room '{cluster}': a PC is named twice among the controller and its nodes ({names})",
                         "the controller runs slurmctld only: keep it out of the node group, and give each "
                         "PC its own hostname")
    files = {"slurm.conf": _slurm_conf(cluster, partition, f"{controller_hostname}({controller_address})",
                                       ordered, cgroup_v2, queue, power),
             "cgroup.conf": _cgroup_conf(cluster, cgroup_v2)}
    if any(n.gpus for n in ordered):
        files["gres.conf"] = _gres_conf(cluster, ordered)
    return files

