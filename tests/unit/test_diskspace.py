"""provision's disk check (cluster/provision/diskspace.py): the node's answer parsed, what a node still needs, and
nodes of one machine sharing one free space (the simulated lab; several GPUs of one PC as nodes)."""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from cluster.provision import diskspace
from cluster.provision.diskspace import GIB, Need, NodeDisk
from cluster.provision.wheelhouse import Wheelhouse

# diskspace.command() as run on the development machine (the test wheelhouse, the project's .venv);
# pip freeze cut to three of its lines
RECORDED = """16558ff5-43dd-456a-9f2d-43278b01f88f
@@du
4001905696
8283019566
@@freeze
absl-py==2.5.1
torch==2.14.1
uv==0.13.9
@@df
Filesystem     1024-blocks     Used Available Capacity Mounted on
/dev/vda         264212084 46152852  60238060      44% /
"""
LOCK = "absl-py==2.5.1\ntorch==2.14.1\nuv==0.13.9\n"


def test_the_recorded_answer_parses() -> None:
    d = diskspace.parse(RECORDED)
    assert (d.boot_id, d.filesystem, d.mount) == ("16558ff5-43dd-456a-9f2d-43278b01f88f", "/dev/vda", "/")
    assert (d.free, d.wheels_present, d.venv_present) == (60238060 * 1024, 4001905696, 8283019566)
    assert "torch==2.14.1" in d.freeze
    for bad in ("", "boot\n@@du\n12\n@@freeze\n@@df\nFilesystem\n/dev/vda 1 2 3 4% /\n",
                RECORDED.replace("60238060", "lots")):
        with pytest.raises(ValueError):
            diskspace.parse(bad)


def test_what_a_node_still_needs() -> None:
    need = Need(wheels=4 * GIB, installed=9 * GIB, lock_text=LOCK)
    empty = NodeDisk("b", "/dev/sda1", "/", 100 * GIB, 0, 0)
    assert need.on(empty) == int(13 * GIB * diskspace.MARGIN) + diskspace.MARGIN_BYTES
    # a venv that holds every pin needs nothing more, whatever the estimate of its size says
    done = NodeDisk("b", "/dev/sda1", "/", 100 * GIB, 4 * GIB, 7 * GIB, "absl-py==2.5.1\ntorch==2.14.1\nuv==0.13.9\n")
    assert need.on(done) == 0
    # half the wheels, a venv missing a pin: the rest of both
    half = NodeDisk("b", "/dev/sda1", "/", 100 * GIB, 2 * GIB, 5 * GIB, "absl-py==2.5.1\n")
    assert need.on(half) == int(6 * GIB * diskspace.MARGIN) + diskspace.MARGIN_BYTES


def test_nodes_of_one_machine_share_its_free_space() -> None:
    need = Need(wheels=4 * GIB, installed=9 * GIB, lock_text=LOCK)
    same = {f"node{i}": NodeDisk("boot-1", "/dev/vda", "/", 30 * GIB, 0, 0) for i in (1, 2, 3)}
    out = diskspace.shortfalls(same, {n: need for n in same})
    assert set(out) == {"node1", "node2", "node3"}  # 13.9 GiB each fits alone, 41.7 together do not
    assert "30.0 GiB free" in out["node2"] and "3 nodes on this machine (node1, node2, node3)" in out["node2"]
    assert "about 41.7 GiB" in out["node1"] and "12.0 GiB of wheels" in out["node1"]
    # three PCs, each its own /dev/vda: each judged alone
    apart = {f"node{i}": NodeDisk(f"boot-{i}", "/dev/vda", "/", 30 * GIB, 0, 0) for i in (1, 2, 3)}
    assert diskspace.shortfalls(apart, {n: need for n in apart}) == {}
    # one machine, two filesystems: each node's own
    split = {"a": NodeDisk("boot-1", "/dev/vda", "/", 20 * GIB, 0, 0),
             "b": NodeDisk("boot-1", "/dev/vdb", "/data", 10 * GIB, 0, 0)}
    out = diskspace.shortfalls(split, {n: need for n in split})
    assert list(out) == ["b"] and "on /data: 10.0 GiB free" in out["b"] and "machine" not in out["b"]
    # a node that was not measured is not judged
    assert diskspace.shortfalls({}, {"x": need}) == {}


def test_installed_bytes_come_from_the_zip_directory(tmp_path: Path) -> None:
    w = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(w, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("pkg/__init__.py", "x = 1\n" * 100)  # 600 bytes, + its .pyc counted at the same size
        z.writestr("pkg/data.bin", b"\0" * 5000)
        z.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\n")
    wh = Wheelhouse(tmp_path, ("pkg",), {w.name: {"sha256": "-", "size": w.stat().st_size}})  # as wheelhouse.build
    assert diskspace.installed_bytes(wh) == 2 * 600 + 5000 + 10
