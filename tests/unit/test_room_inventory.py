"""The inventory's room (`slurm.NAME` with a controller and nodes): the shape `lab up --gateway` writes, the
controller reached like a host, and every error naming the file, the line, the dotted field and the fix."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.errors import InventoryError
from cluster.inventory import loader
from tests.conftest import write

ROOM = """\
defaults: {user: student, become: true, known_hosts: /dev/null, proxy_jump: root@10.77.0.254}
groups:
  lab: {hosts: [node1, node2, node3]}
hosts:
  node1: {address: 10.77.0.11}
  node2: {address: 10.77.0.12}
  node3: {address: 10.77.0.13}
  old: {address: 10.77.0.30}
slurm:
  room:
    controller: {address: 10.77.0.254, user: root, proxy_jump: none}
    nodes: lab
    partition: room
"""


def error(tmp_path: Path, text: str) -> InventoryError:
    with pytest.raises(InventoryError) as e:
        loader.load(write(tmp_path, text), check_files=False)
    return e.value


def test_the_room_lab_up_writes_parses_with_its_controller_reached_directly(tmp_path: Path) -> None:
    inv = loader.load(write(tmp_path, ROOM), check_files=False)
    room = inv.rooms["room"]
    assert (room.nodes, room.partition) == (("node1", "node2", "node3"), "room")
    c = room.controller
    # a host entry: defaults apply (known_hosts), its own fields win, and `proxy_jump: none` drops the jump
    assert (c.address, c.user, c.known_hosts, c.proxy_jump, c.jumps) == ("10.77.0.254", "root", "/dev/null", None, ())
    assert inv.clusters == {} and "controller" not in inv.hosts  # not a university cluster, not a compute host
    assert room.to_dict()["nodes"] == ["node1", "node2", "node3"]


def test_a_controller_may_be_an_inventory_host_and_nodes_a_pattern(tmp_path: Path) -> None:
    text = ROOM.replace("controller: {address: 10.77.0.254, user: root, proxy_jump: none}", "controller: old")
    inv = loader.load(write(tmp_path, text.replace("nodes: lab", "nodes: 'node1:node2'").replace(
        "    partition: room\n", "")), check_files=False)
    room = inv.rooms["room"]
    assert (room.controller.name, room.controller.address, room.nodes, room.partition) == (
        "old", "10.77.0.30", ("node1", "node2"), "room")


def test_the_admins_queue_limits_are_read(tmp_path: Path) -> None:
    text = ROOM.replace("partition: room", "partition: room\n    default_time: '2:00:00'\n    max_time: 1-00:00:00"
                        "\n    max_pcs_per_job: 2")
    room = loader.load(write(tmp_path, text), check_files=False).rooms["room"]
    assert (room.default_time, room.max_time, room.max_pcs_per_job) == ("2:00:00", "1-00:00:00", 2)
    plain = loader.load(write(tmp_path, ROOM), check_files=False).rooms["room"]
    assert (plain.default_time, plain.max_time, plain.max_pcs_per_job) == (None, None, None)


@pytest.mark.parametrize(("given", "seconds"), [("30m", 1800), ("90s", 90), ("1h", 3600), (600, 600), ("'45'", 45)])
def test_suspend_after_and_resume_timeout_are_seconds(tmp_path: Path, given: object, seconds: int) -> None:
    """Slurm's SuspendTime and ResumeTimeout are seconds: `30m`, `90s`, `1h` or a number of seconds."""
    text = ROOM.replace("partition: room", f"partition: room\n    suspend_after: {given}\n    resume_timeout: {given}")
    room = loader.load(write(tmp_path, text), check_files=False).rooms["room"]
    assert (room.suspend_after, room.resume_timeout) == (seconds, seconds)
    assert (room.to_dict()["suspend_after"], room.to_dict()["resume_timeout"]) == (seconds, seconds)
    plain = loader.load(write(tmp_path, ROOM), check_files=False).rooms["room"]
    assert (plain.suspend_after, plain.resume_timeout) == (None, None)  # no power saving unless asked


@pytest.mark.parametrize(("old", "new", "field", "words"), [
    ("partition: room", "partition: room\n    suspend_after: 30 minutes", "slurm.room.suspend_after",
     "expected a time in seconds from 1 s to 7 days (Slurm's SuspendTime is seconds), got '30 minutes'"),
    ("partition: room", "partition: room\n    suspend_after: 0m", "slurm.room.suspend_after", "got '0m'"),
    ("partition: room", "partition: room\n    suspend_after: 8000000", "slurm.room.suspend_after", "7 days"),
    ("partition: room", "partition: room\n    suspend_after: true", "slurm.room.suspend_after", "got True"),
    ("partition: room", "partition: room\n    resume_timeout: '1:00:00'", "slurm.room.resume_timeout",
     "Slurm's ResumeTimeout is seconds"),
    ("partition: room", "partition: room\n    default_time: 2h", "slurm.room.default_time",
     "expected a Slurm time limit"),
    ("partition: room", "partition: room\n    max_time: '0'", "slurm.room.max_time", "expected a Slurm time limit"),
    ("partition: room", "partition: room\n    max_pcs_per_job: 4", "slurm.room.max_pcs_per_job",
     "expected a number of PCs from 1 to 3"),
    ("controller: {address: 10.77.0.254, user: root, proxy_jump: none}", "controller: node2",
     "slurm.room.controller", "the controller runs slurmctld, never a job"),
    ("controller: {address: 10.77.0.254, user: root, proxy_jump: none}", "controller: nowhere",
     "slurm.room.controller", "'nowhere' is not a host of this inventory"),
    ("controller: {address: 10.77.0.254, user: root, proxy_jump: none}", "controller: {user: root}",
     "slurm.room.controller.address", "needs its address"),
    ("nodes: lab", "nodes: labs", "slurm.room.nodes", "matches no host or group"),
    ("nodes: lab", "nodes: 3", "slurm.room.nodes", "needs its compute PCs"),
    ("partition: room", "partition: 'my room'", "slurm.room.partition", "expected a Slurm partition name"),
    ("partition: room", "workdir: /srv", "slurm.room.workdir", "unknown key"),
])
def test_room_errors_name_the_field_and_the_fix(tmp_path: Path, old: str, new: str, field: str, words: str) -> None:
    assert old in ROOM
    e = error(tmp_path, ROOM.replace(old, new, 1))
    assert e.field == field and words in str(e) and e.fix, str(e)
    assert str(e).startswith(str(tmp_path / "inv.yaml")) and e.line is not None
    if field.endswith(("suspend_after", "resume_timeout")):
        assert e.fix and "30m, 90s, 1h, or a number of seconds" in e.fix
