"""What a Slurm cluster says about itself (sinfo, parsed from recorded outputs of slurm-wlm 22.05) and the refusal
of a job its partition cannot give (exit 2 before anything is submitted)."""
from __future__ import annotations

import pytest

from cluster.errors import EXIT_USAGE
from cluster.slurm import facts, fit
from cluster.slurm.facts import FactError, Partition, SlurmNode
from cluster.slurm.resources import Resources, mem_mb, time_minutes
from tests.conftest import FIXTURES

LAB = FIXTURES / "slurm"  # the lab's recordings: `sinfo -h -N -o '%N %P %T %c %m'`
MINE = FIXTURES / "slurm" / "launch"  # with GRES and time limits: facts.SINFO_FORMAT


def sinfo(path: str) -> dict[str, Partition]:
    base = MINE if path.startswith("sinfo_gres") else LAB
    return facts.SINFO.parse((base / path).read_text(), 0)


def test_the_command_asks_for_the_format_the_parser_reads() -> None:
    assert facts.SINFO.command == "sinfo -h -N -o '%N %P %T %c %m %G %l'"
    assert facts.SINFO_FORMAT in (MINE / "README.md").read_text()


def test_sinfo_with_gres_and_limits() -> None:
    parts = sinfo("sinfo_gres_limits_idle.txt")
    assert sorted(parts) == ["debug", "gpu", "long"]
    debug, long_, gpu = parts["debug"], parts["long"], parts["gpu"]
    assert (debug.default, long_.default, gpu.default) == (True, False, False)
    assert (debug.time_limit_min, long_.time_limit_min, gpu.time_limit_min) == (60, 1440, None)
    assert [(n.name, n.cpus, n.memory_mb, n.gpus, n.usable) for n in debug.nodes] == [
        ("cn1", 2, 1000, 0, True), ("cn2", 2, 1000, 0, True)]
    assert [(n.name, n.state, n.cpus, n.memory_mb, n.gpus, n.gres, n.usable) for n in gpu.nodes] == [
        ("cn3", "unknown*", 4, 2000, 2, "gpu:tesla:2", False)]


def test_node_states_as_sinfo_prints_them() -> None:
    running = sinfo("sinfo_gres_limits_running.txt")["debug"].nodes
    assert [(n.state, n.usable) for n in running] == [("mixed", True), ("idle", True)]
    drained = sinfo("sinfo_gres_limits_drained.txt")["long"].nodes
    assert [(n.state, n.usable) for n in drained] == [("mixed", True), ("drained", False)]
    down = sinfo("sinfo_node_down.txt")["debug"].nodes
    assert [(n.name, n.state, n.usable) for n in down] == [("node1", "mixed", True), ("node2", "down*", False)]
    allocated = sinfo("sinfo_allocated.txt")["debug"].nodes
    assert all(n.state == "allocated" and n.usable for n in allocated)


def test_the_labs_five_field_recordings_are_read_without_gpus_or_limit() -> None:
    parts = sinfo("sinfo_idle.txt")
    assert list(parts) == ["debug"] and parts["debug"].default and parts["debug"].time_limit_min is None
    assert [(n.name, n.cpus, n.memory_mb, n.gpus) for n in parts["debug"].nodes] == [
        ("node1", 2, 1, 0), ("node2", 2, 1, 0)]


@pytest.mark.parametrize("gres, gpus", [  # hand-written GRES strings in sinfo's %G forms (sinfo(1), gres.conf(5))
    ("(null)", 0), ("gpu:2", 2), ("gpu:tesla:2", 2), ("gpu:a100:4(S:0-1)", 4), ("gpu:a100:4(S:0-1),mps:400", 4),
    ("mps:400,gpu:v100:2(S:0),gpu:t4:1", 3), ("nic:1", 0), ("gpu", 1)])
def test_gpus_from_gres(gres: str, gpus: int) -> None:
    assert facts.gres_gpus(gres) == gpus


@pytest.mark.parametrize("out, rc, words", [
    ("cn1 debug* idle 2\n", 0, "expected the fields"),
    ("cn1 debug* idle two 1000 (null) 1:00:00\n", 0, "cannot read"),
    ("cn1 debug* idle 2 1000 (null) soon\n", 0, "cannot read"),
    ("sinfo: error: Unable to contact slurm controller (connect failure)\n", 1, "sinfo failed (exit 1)"),
])
def test_what_the_parser_cannot_read_is_said(out: str, rc: int, words: str) -> None:
    with pytest.raises(FactError) as e:
        facts.parse_sinfo(out, rc)
    assert words in str(e.value) and e.value.fix


def res(nodes: int = 2, partition: str | None = None, cpus: int | None = None, mem: str | None = None, gpus: int = 0,
        time: str | None = None) -> Resources:
    return Resources(nodes=nodes, nproc_per_node=1, partition=partition, account=None, qos=None, time=time,
                     time_minutes=time_minutes(time) if time else None, mem=mem, mem_mb=mem_mb(mem) if mem else None,
                     gpus_per_node=gpus, cpus_per_task=cpus, requeue=False)


def refused(parts: dict[str, Partition], r: Resources) -> str:
    with pytest.raises(fit.Refused) as e:
        fit.check(parts, r)
    assert e.value.exit_code == EXIT_USAGE and e.value.fix
    return str(e.value)


def test_a_request_that_fits_passes_on_the_default_partition() -> None:
    parts = sinfo("sinfo_gres_limits_idle.txt")
    assert fit.partition_for(parts, res()).name == "debug"
    assert fit.check(parts, res(cpus=2, mem="1000", time="59")) == []
    # cn3 has what the job asks for, but its slurmd never answered (unknown*): it fits, and waits
    assert fit.check(parts, res(nodes=1, partition="gpu", gpus=2, cpus=4, mem="2000M", time="30-00")) == [
        "partition gpu: 0 of the 1 nodes that fit can start a job now (cn3 (unknown*)): the job waits until 1 can"]


def test_more_nodes_than_the_partition_has_is_refused() -> None:
    msg = refused(sinfo("sinfo_idle.txt"), res(nodes=3))
    assert "partition debug has 2 node(s); the job asks for 3" in msg and "--nodes 2" in msg


def test_more_per_node_than_its_nodes_have_is_refused() -> None:
    parts = sinfo("sinfo_gres_limits_idle.txt")
    assert "4 CPUs per task on 2 node(s), 0 of its 2 nodes" in refused(parts, res(cpus=4))
    assert "--cpus-per-task 2" in refused(parts, res(cpus=4))
    assert "2048 memory (MB) per node" in refused(parts, res(mem="2G"))
    assert "--mem 1000" in refused(parts, res(mem="2G"))
    assert "1 GPUs per node" in refused(parts, res(gpus=1)) and "--gpus-per-node 0" in refused(parts, res(gpus=1))
    assert "3 GPUs per node on 1 node(s), 0 of its 1 nodes" in refused(parts, res(nodes=1, partition="gpu", gpus=3))
    # the lab's nodes say RealMemory=1 (not set in slurm.conf): Slurm would never start a job asking for more
    assert "memory (MB) per node" in refused(sinfo("sinfo_idle.txt"), res(mem="100M"))


def test_a_time_beyond_the_partition_limit_is_refused() -> None:
    parts = sinfo("sinfo_gres_limits_idle.txt")
    assert "at most 60 minutes; the job asks for --time 2:00:00 (120 minutes)" in refused(parts, res(time="2:00:00"))
    assert fit.check(parts, res(partition="long", time="1-00:00:00")) == []
    assert "at most 1440 minutes" in refused(parts, res(partition="long", time="1-00:00:01"))


def test_an_unknown_partition_or_none_at_all_is_refused_naming_those_there_are() -> None:
    parts = sinfo("sinfo_gres_limits_idle.txt")
    assert "no partition 'batch' that you can use (sinfo lists: debug, gpu, long)" in refused(parts, res(partition="batch"))
    no_default = {k: v for k, v in parts.items() if not v.default}
    assert "no default partition" in refused(no_default, res())


def test_nodes_that_fit_but_are_down_give_a_note_not_a_refusal() -> None:
    assert fit.check(sinfo("sinfo_node_down.txt"), res()) == [
        "partition debug: 1 of the 2 nodes that fit can start a job now (node2 (down*)): the job waits until 2 can"]
    assert fit.check(sinfo("sinfo_gres_limits_drained.txt"), res(partition="long"))[0].startswith(
        "partition long: 1 of the 2 nodes")


def test_each_resource_fits_but_not_on_the_same_nodes_is_refused() -> None:
    nodes = (SlurmNode("a", "idle", 64, 1000, 0, "(null)"), SlurmNode("b", "idle", 2, 512000, 0, "(null)"))
    parts = {"p": Partition("p", True, None, nodes)}
    assert fit.check(parts, res(nodes=1, cpus=64)) == [] and fit.check(parts, res(nodes=1, mem="500G")) == []
    assert "no 1 of its nodes have all the job asks for at once" in refused(parts, res(nodes=1, cpus=64, mem="500G"))
