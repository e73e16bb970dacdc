"""The room's slurm.conf, gres.conf and cgroup.conf (cluster/room/conf.py), rendered from facts parsed out of
the recorded outputs in tests/fixtures/facts/ (golden files in tests/golden/room/; UPDATE_GOLDEN=1 rewrites
them, review the diff), the facts they need (CPU topology, GPU index, cgroup), and this machine's facts
against the real `slurmd -C`."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cluster.inventory.model import Host
from cluster.nodes import facts
from cluster.room import conf
from tests import goldens
from tests.conftest import FIXTURES, ROOT

F = FIXTURES / "facts"
GOLDEN = ROOT / "tests" / "golden" / "room"


def recorded(name: str, cpu: str, smi: str | None, cgroup: str | None) -> dict[str, Any]:
    """One PC's facts: lab-node1's whole recorded script output (memory among it), with the cpu, gpus and cgroup
    facts parsed from the named recordings, and `hostname`'s output for the PC's own name."""
    values = facts.parse_all((F / "lab-node1.txt").read_text())
    values["cpu"] = facts.parse_cpu((F / cpu).read_text(), 0)
    values["gpus"] = facts.parse_gpus((F / smi).read_text() if smi else "@@absent", 0)
    if cgroup:
        values["cgroup"] = facts.parse_cgroup((F / cgroup).read_text(), 0)
    values["hostname"] = facts.parse_hostname(f"{name}\n", 0)
    return values


def gtx_room(cgroups: tuple[str, ...] = ("cgroup-v2.txt",) * 3) -> dict[str, dict[str, Any]]:
    return {f"pc{i}": recorded(f"pc{i}", "cpu-i5-2400.txt", "nvidia-smi-gtx1050ti-index.txt", cg)
            for i, cg in zip((3, 1, 2), cgroups)}  # out of order: the files list them sorted


def render(room: dict[str, dict[str, Any]], cluster: str, partition: str,
           queue: conf.Queue = conf.Queue(), power: conf.Power | None = None) -> dict[str, str]:
    nodes = [conf.node_from_facts(name, f"192.168.10.{10 + int(name[-1])}", f) for name, f in room.items()]
    return conf.render(cluster=cluster, partition=partition, controller_hostname="teacher",
                       controller_address="192.168.10.2", nodes=nodes,
                       cgroup_v2=all(f["cgroup"]["v2"] for f in room.values()), queue=queue, power=power)


# a room whose idle PCs Slurm switches off after 30 minutes; its slowest recorded wake took 84 s
POWER = conf.Power(1800, 126, "1.5x the slowest recorded wake (pc2: 84 s, by `clusterctl wake`), at least 60 s")


ROOMS = {
    # a class's queue: 2 h unless a job asks, a day at most, 2 of the 3 PCs per job
    "gtx1050ti": lambda: render(gtx_room(), "lab214", "gpu", conf.Queue("2:00:00", "1-00:00:00", 2)),
    # lab-node1's own facts: a simulated lab's node, no GPU, no /sys/fs/cgroup (its record has no cgroup fact)
    "cpu-only": lambda: render({n: recorded(n, "lab-node1.txt", None, None) for n in ("node1", "node2")},
                               "cpulab", "cpu"),
    "power-saving": lambda: render(gtx_room(), "lab214", "gpu", power=POWER),
}


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_room_files_match_golden(room: str) -> None:
    files = ROOMS[room]()
    for name, text in files.items():
        goldens.check(GOLDEN / room / name, text, f"{room}'s {name}")
    assert sorted(files) == sorted(p.name for p in (GOLDEN / room).iterdir())


def test_gtx_room_from_recorded_facts() -> None:
    files = ROOMS["gtx1050ti"]()
    slurm = files["slurm.conf"]
    # i5-2400: 1 socket, 4 cores, no SMT; 24105 MiB of MemTotal less 5 % (1205)
    assert ("NodeName=pc1 NodeAddr=192.168.10.11 CPUs=4 Sockets=1 CoresPerSocket=4 ThreadsPerCore=1 "
            "RealMemory=22900 Gres=gpu:gtx_1050_ti:1 State=UNKNOWN") in slurm
    assert re.findall(r"^NodeName=(\S+)", slurm, re.M) == ["pc1", "pc2", "pc3"]
    assert "SlurmctldHost=teacher(192.168.10.2)" in slurm and "NodeName=teacher" not in slurm
    assert ("PartitionName=gpu Nodes=pc1,pc2,pc3 Default=YES DefaultTime=2:00:00 MaxTime=1-00:00:00 MaxNodes=2 "
            "OverSubscribe=EXCLUSIVE State=UP") in slurm
    assert "GresTypes=gpu\n" in slurm and "SrunPortRange=60001-63000\n" in slurm
    assert "ProctrackType=proctrack/cgroup\n" in slurm and "TaskPlugin=task/affinity,task/cgroup\n" in slurm
    assert "NodeName=pc2 Name=gpu Type=gtx_1050_ti File=/dev/nvidia0\n" in files["gres.conf"]
    assert files["cgroup.conf"].endswith("CgroupPlugin=cgroup/v2\nConstrainCores=yes\nConstrainRAMSpace=yes\n"
                                         "ConstrainDevices=yes\n")
    assert all(t.startswith("# ") and "provision --slurm" in t.splitlines()[0] for t in files.values())


def test_power_saving_lines_only_where_the_room_asks() -> None:
    slurm = ROOMS["power-saving"]()["slurm.conf"]
    assert "SuspendTime=1800\n" in slurm and "ResumeTimeout=126\n" in slurm and "SuspendTimeout=60\n" in slurm
    for key, name in (("SuspendProgram", "slurm-suspend"), ("ResumeProgram", "slurm-resume"),
                      ("ResumeFailProgram", "slurm-resume-fail")):
        assert f"\n{key}=/usr/local/lib/clusterctl/{name}\n" in slurm  # a path: slurmctld passes the hostlist alone
    assert "# ResumeTimeout: 1.5x the slowest recorded wake (pc2: 84 s" in slurm
    # the controller is never suspended: it is no NodeName, so nothing excludes it
    assert "NodeName=teacher" not in slurm and not re.search(r"^SuspendExc", slurm, re.M)
    assert not re.search(r"^(Suspend|Resume)", ROOMS["gtx1050ti"]()["slurm.conf"], re.M)


def test_one_pc_without_cgroup_v2_leaves_the_whole_room_unconfined_and_says_so() -> None:
    files = render(gtx_room(("cgroup-v2.txt", "cgroup-v1-hybrid.txt", "cgroup-v2.txt")), "lab214", "gpu")
    assert "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n" in files["slurm.conf"]
    assert "task/cgroup" not in files["slurm.conf"]
    cg = files["cgroup.conf"]
    assert "Jobs are NOT confined" in cg and cg.endswith("CgroupPlugin=cgroup/v1\n") and "Constrain" not in cg


def test_cpu_only_room_has_no_gres() -> None:
    files = ROOMS["cpu-only"]()
    assert "gres.conf" not in files and "Gres" not in files["slurm.conf"]
    assert "CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=22900 State=UNKNOWN" in files["slurm.conf"]


def test_node_without_memory_fact_names_the_node_field_and_fix() -> None:
    f = recorded("pc1", "cpu-i5-2400.txt", None, "cgroup-v2.txt")
    del f["memory"]
    with pytest.raises(conf.FactMissing) as e:
        conf.node_from_facts("pc1", "192.168.10.11", f)
    assert "pc1" in e.value.message and "memory.total_mib" in e.value.message
    assert e.value.fix and "clusterctl check pc1" in e.value.fix and e.value.exit_code == 1


def test_gpus_recorded_without_index_or_with_a_failed_driver_are_refused() -> None:
    old = recorded("pc1", "cpu-i5-2400.txt", "nvidia-smi-gtx1050ti.txt", None)
    with pytest.raises(conf.FactMissing, match=r"gpus\.index"):
        conf.node_from_facts("pc1", "192.168.10.11", old)
    broken = recorded("pc1", "cpu-i5-2400.txt", "nvidia-smi-no-driver.txt", None)
    with pytest.raises(conf.FactMissing, match="nvidia-smi failed"):
        conf.node_from_facts("pc1", "192.168.10.11", broken)


def test_controller_among_the_nodes_is_refused() -> None:
    node = conf.node_from_facts("teacher", "192.168.10.2", recorded("teacher", "lab-node1.txt", None, None))
    with pytest.raises(conf.UsageError, match="slurmctld only"):
        conf.render(cluster="c", partition="p", controller_hostname="teacher", controller_address="192.168.10.2",
                    nodes=[node], cgroup_v2=False)


def test_gres_type_and_real_memory_rule() -> None:
    assert conf.gres_type("NVIDIA GeForce GTX 1050 Ti") == "gtx_1050_ti"
    assert conf.gres_type("Tesla P100-PCIE-16GB") == "tesla_p100_pcie_16gb"
    assert conf.real_memory(24105) == 24105 - 1205  # 5 %
    assert conf.real_memory(7875) == 7875 - 512  # an 8 GB PC: the 512 MiB floor


# ----------------------------------------------------------------------------- the facts the files need


@pytest.mark.parametrize("fixture,topology", [
    ("cpu-i5-2400.txt", (4, 1, 4, 1)),  # physical id 0 for all four, core ids 0-3, siblings = cpu cores = 4
    ("cpu-amd-epyc.txt", (2, 1, 2, 1)),
    ("lab-node1.txt", (2, 1, 2, 1)),
])
def test_cpu_topology_from_recorded_cpuinfo(fixture: str, topology: tuple[int, ...]) -> None:
    cpu = facts.parse_all((F / fixture).read_text())["cpu"] if fixture == "lab-node1.txt" else \
        facts.parse_cpu((F / fixture).read_text(), 0)
    assert (cpu["logical"], cpu["sockets"], cpu["cores_per_socket"], cpu["threads_per_core"]) == topology


def test_cpuinfo_without_physical_id_is_one_socket_of_single_thread_cores() -> None:
    text = re.sub(r"^(physical id|core id)\s*:.*\n", "", (F / "cpu-i5-2400.txt").read_text(), flags=re.M)
    cpu = facts.parse_cpu(text, 0)
    assert (cpu["sockets"], cpu["cores_per_socket"], cpu["threads_per_core"]) == (1, 4, 1)


def test_gpu_index_from_the_query_and_none_in_older_recordings() -> None:
    assert facts.GPU_CMD.count("--query-gpu=index,name,") == 2  # the normal query and the R470 fallback
    g = facts.parse_gpus((F / "nvidia-smi-gtx1050ti-index.txt").read_text(), 0)
    assert g["gpus"] == [{"index": 0, "name": "NVIDIA GeForce GTX 1050 Ti", "compute_capability": "6.1",
                          "driver": "580.95.05", "memory_mib": 4096}]
    old = facts.parse_gpus((F / "nvidia-smi-r470.txt").read_text(), 0)["gpus"]
    assert [(x["index"], x["compute_capability"]) for x in old] == [(None, "6.1"), (None, "5.2")]


def test_cgroup_fact() -> None:
    assert facts.parse_cgroup((F / "cgroup-v2.txt").read_text(), 0) == {"v2": True, "fs": "cgroup2fs"}
    assert facts.parse_cgroup((F / "cgroup-v1-hybrid.txt").read_text(), 0) == {"v2": False, "fs": "tmpfs"}
    assert facts.parse_cgroup("", 1) == {"v2": False, "fs": None}  # no /sys/fs/cgroup (the lab's nodes)
    assert facts.parse_all((F / "lab-node1.txt").read_text())["cgroup"] == {"v2": False, "fs": None}


@pytest.mark.skipif(shutil.which("slurmd") is None, reason="slurmd is not installed")
def test_this_machines_facts_agree_with_slurmd_C() -> None:
    """The real reference: `slurmd -C` prints this machine's NodeName line as Slurm sees its hardware; the cpu
    and memory facts, run here, must give the same topology and memory, and RealMemory stays below it."""
    wanted = tuple(f for f in facts.FACTS if f.name in ("cpu", "memory", "hostname"))
    out = subprocess.run(["bash", "-c", facts.script(Host(name="here", address="127.0.0.1"), wanted)],
                         capture_output=True, text=True, check=True).stdout
    values = facts.parse_all(out, wanted)
    line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    ref = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
    cpu = values["cpu"]
    assert (cpu["logical"], cpu["sockets"], cpu["cores_per_socket"], cpu["threads_per_core"]) == (
        ref["CPUs"], ref["Boards"] * ref["SocketsPerBoard"], ref["CoresPerSocket"], ref["ThreadsPerCore"])
    assert values["memory"]["total_mib"] == ref["RealMemory"]
    node = conf.node_from_facts("here", "127.0.0.1", {**values, "gpus": {"gpus": []}})
    assert node.memory_mb == conf.real_memory(ref["RealMemory"]) < ref["RealMemory"]  # never drained as Low
    assert f"NodeName={node.hostname} " in line  # the hostname fact is the name slurmd looks itself up by


@pytest.mark.skipif(shutil.which("slurmd") is None, reason="slurmd is not installed")
def test_slurmd_reads_the_rendered_files(tmp_path: Path) -> None:
    """`slurmd -G` parses slurm.conf, gres.conf and cgroup.conf as a PC's slurmd would (an unknown key is fatal;
    gres.conf disagreeing with slurm.conf warns) and prints the GPU it would offer. This machine has no
    /dev/nvidia0 (slurmd stats it): /dev/null stands in; the cgroup plugin is the one this machine can load."""
    here = facts.parse_cgroup(subprocess.run(["bash", "-c", "stat -fc %T /sys/fs/cgroup 2>/dev/null"],
                                             capture_output=True, text=True).stdout, 0)
    room = gtx_room(("cgroup-v2.txt" if here["v2"] else "cgroup-v1-hybrid.txt",) * 3)
    for name, text in render(room, "lab214", "gpu", power=POWER).items():
        (tmp_path / name).write_text(text.replace("/dev/nvidia0", "/dev/null"))
    r = subprocess.run(["slurmd", "-f", str(tmp_path / "slurm.conf"), "-G", "-N", "pc2"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "Gres Name=gpu Type=gtx_1050_ti Count=1" in r.stderr + r.stdout
    assert not re.search(r"WARNING|error", r.stderr + r.stdout)
