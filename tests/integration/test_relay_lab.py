"""Peer relay and the head's uplink on a real simulated lab (3 nodes, 40 Mbit/s links and uplink).

Small on purpose (a stand-in wheelhouse of ~14 MiB, a few seconds per distribution): a relay node killed
mid-transfer, a corrupted file on a relay, a re-run after an interrupted distribution, and the uplink
shared by two nodes. Lab subnets 13-15 of tests/integration/conftest.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster.relay import distribute as relay
from cluster.lab import lifecycle, net, sshd
from cluster.inventory import loader, model
from cluster.nodes.fanout import Group
from tests.conftest import ROOT
from tests.integration.conftest import lab_up, pytestmark, wait_until  # noqa: F401

RATE = "40mbit"  # 5 MB/s: the big file takes ~2.5 s per copy, time enough to act in the middle
STALL_S = "4"
BIG = 12 << 20
SMALL = (1 << 20, 600 * 1024)


@pytest.fixture(scope="module")
def rlab(tmp_path_factory: pytest.TempPathFactory):
    with lab_up(tmp_path_factory, "r", 3, 13, bandwidth=RATE, uplink=RATE) as (state, d):
        src = d / "files"
        src.mkdir()
        files = {}
        for name, size in (("small_a-1.0-py3-none-any.whl", SMALL[0]), ("small_b-1.0-py3-none-any.whl", SMALL[1]),
                           ("big-1.0-py3-none-any.whl", BIG)):
            data = os.urandom(size)
            (src / name).write_bytes(data)
            files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": size}
        yield state, src, files


@pytest.fixture(autouse=True)
def short_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_TRANSFER_STALL_S", STALL_S)


def hosts(state: lifecycle.LabState) -> list[model.Host]:
    return list(loader.load(state.inventory).hosts.values())


def node_dir(state: lifecycle.LabState, node: str, sub: str) -> Path:
    return Path(next(n.dir for n in state.nodes if n.name == node)) / "srv" / sub


def assert_complete(state: lifecycle.LabState, node: str, sub: str, files: dict) -> None:
    d = node_dir(state, node, sub)
    for name, meta in files.items():
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == meta["sha256"], f"{node}: {name}"
    assert json.loads((d / relay.MANIFEST).read_text()) == {n: m["sha256"] for n, m in files.items()}


def listening(state: lifecycle.LabState) -> list[str]:
    """TCP ports listening in the nodes' namespaces, other than sshd's."""
    out = []
    for n in state.nodes:
        ss = subprocess.run(["ip", "netns", "exec", n.netns, "ss", "-Hltn"], capture_output=True, text=True,
                            timeout=30).stdout
        out += [f"{n.name} {line.split()[3]}" for line in ss.splitlines() if not line.split()[3].endswith(":22")]
    return out


def distribute(state: lifecycle.LabState, src: Path, files: dict, sub: str, **kw):
    hs = hosts(state)
    with Group(hs) as g:
        return relay.distribute(g, hs, relay.items(src, files), {h.name: f"/srv/cluster/{sub}" for h in hs}, **kw)


def fetches_running() -> bool:
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"relaynode.py\x00fetch" in p.read_bytes():
                return True
        except OSError:
            pass
    return False


def part_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_uplink_is_shared_by_nodes(rlab) -> None:
    """Two nodes moving data to or from the head at once each get about half of the uplink, in both
    directions (the bridge's root qdisc; its ingress through the ifb). Timed on the head from the moment
    every node is connected, so process start-up is not counted."""
    state, _, _ = rlab
    n = 2 << 20
    client = ("import socket,sys\ns=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=30)\n"
              "s.settimeout(30)\ngo=s.recv(1)\n"
              "if sys.argv[3]=='down':\n  while s.recv(65536): pass\n  s.sendall(b'k')\n"
              f"else:\n  s.sendall(b'x'*{n})\n  s.shutdown(socket.SHUT_WR)\n  s.recv(1)\n")

    def once(nodes: list[lifecycle.NodeState], mode: str) -> float:
        with socket.create_server((state.gateway, 0)) as srv:
            srv.settimeout(30)
            port = srv.getsockname()[1]
            procs = [subprocess.Popen(["ip", "netns", "exec", x.netns, "python3", "-c", client, state.gateway,
                                       str(port), mode]) for x in nodes]
            conns = [srv.accept()[0] for _ in nodes]  # bounded: settimeout(30)

            def move(c: socket.socket) -> None:
                c.settimeout(30)
                if mode == "down":  # until the node says it has every byte (not just the kernel's buffer)
                    c.sendall(b"g" + b"y" * n)
                    c.shutdown(socket.SHUT_WR)
                    c.recv(1)  # bounded: settimeout(30)
                else:
                    c.sendall(b"g")
                    while c.recv(65536):  # bounded: settimeout(30)
                        pass
                c.close()

            t = time.monotonic()
            threads = [threading.Thread(target=move, args=(c,)) for c in conns]
            for th in threads:
                th.start()
            for th in threads:
                th.join(timeout=60)
            took = time.monotonic() - t
            for p in procs:
                p.wait(timeout=60)
        return took

    for mode in ("down", "up"):
        alone = once(state.nodes[:1], mode)
        both = once(state.nodes[:2], mode)
        # 2 MiB at 40 Mbit/s is 0.42 s; two at once share the one uplink: about twice as long
        assert alone > 0.35, f"{mode}: the link is not shaped ({alone:.2f}s)"
        assert both > 1.6 * alone, f"{mode}: two nodes did not share the uplink (alone {alone:.2f}s, both {both:.2f}s)"


def test_relay_sends_once_and_nothing_listens_after(rlab) -> None:
    state, src, files = rlab
    calls: dict[str, list[int]] = {}
    states: list[relay.NodeProgress] = []
    plan, res = distribute(state, src, files, "w1", status=states.append,
                           progress=lambda n, k: calls.setdefault(n, []).append(k))
    assert plan.edges()[0][0] == "head" and [e[:2] for e in plan.edges()[1:]] == [("node1", "node2"),
                                                                                  ("node2", "node3")]
    total = sum(m["size"] for m in files.values())
    assert all(r.ok for r in res.values()), {n: r.error for n, r in res.items()}
    d = {n: r.value for n, r in res.items()}
    assert d["node1"].from_head == total and d["node2"].from_head == 0 and d["node3"].from_head == 0
    assert d["node2"].from_peers == {"node1": total} and d["node3"].from_peers == {"node2": total}
    for n in ("node1", "node2", "node3"):
        assert_complete(state, n, "w1", files)
    assert listening(state) == []
    # progress per byte: more reports than batches while the big file moved, adding up to every node's total
    nbatches = len(relay.batches(relay.items(src, files)))
    assert {n: sum(c) for n, c in calls.items()} == {n: total for n in ("node1", "node2", "node3")}
    assert all(len(c) > nbatches for c in calls.values()), calls
    assert any(s.node == "node3" and s.source == "node2" and 0 < s.have < total for s in states)
    assert {s.node for s in states if s.state == "done" and s.have == total} == {"node1", "node2", "node3"}
    again_plan, again = distribute(state, src, files, "w1")
    assert not any(again_plan.needs.values()) and all(r.value.received == 0 for r in again.values())


def test_relay_node_killed_mid_transfer_the_others_complete(rlab) -> None:
    state, src, files = rlab
    box: dict = {}
    th = threading.Thread(target=lambda: box.update(r=distribute(state, src, files, "w2")))
    th.start()
    part = node_dir(state, "node3", "w2") / ".big-1.0-py3-none-any.whl.part"
    wait_until(lambda: part_size(part) >= 3 << 20, 60, "node3 to be relaying the big file")
    victim = next(n for n in state.nodes if n.name == "node2")
    net.kill_netns(victim.netns)  # the PC dies: its relay, its sshd, its fetch
    th.join(timeout=120)
    assert not th.is_alive()
    _, res = box["r"]
    sshd.restart_sshd(state, "node2")
    assert res["node2"].status == "unreachable"
    assert res["node1"].ok and res["node3"].ok, {n: r.error for n, r in res.items()}
    for n in ("node1", "node3"):
        assert_complete(state, n, "w2", files)
    d3 = res["node3"].value
    # node3 went on from node1 where node2 left off: nothing it had verified came again
    assert d3.from_peers.get("node1", 0) > 0 and d3.from_head == 0
    assert d3.received == sum(m["size"] for m in files.values())
    assert listening(state) == []


def test_corrupted_file_on_a_relay_is_refused_and_fetched_again(rlab) -> None:
    state, src, files = rlab
    _, res = distribute(state, src, files, "w3")
    assert all(r.ok for r in res.values())
    big = "big-1.0-py3-none-any.whl"
    on2 = node_dir(state, "node2", "w3") / big
    with open(on2, "r+b") as f:  # the relay's disk flips a byte; size and manifest unchanged
        f.seek(5 << 20)
        b = f.read(1)
        f.seek(5 << 20)
        f.write(bytes([b[0] ^ 0xFF]))
    (node_dir(state, "node3", "w3") / big).unlink()
    _, res = distribute(state, src, files, "w3")
    assert all(r.ok for r in res.values()), {n: r.error for n, r in res.items()}
    d3, d2 = res["node3"].value, res["node2"].value
    assert any("from node2" in x and "does not match" in x for x in d3.refused), d3.refused
    assert d3.from_peers.get("node1", 0) > 0
    # node2's own copy was hashed because it served a bad piece, and replaced by the head
    assert any("its own" in x for x in d2.refused) and d2.from_head == BIG
    for n in ("node1", "node2", "node3"):
        assert_complete(state, n, "w3", files)


INTERRUPTED = """
import sys
from cluster.relay import distribute as relay
from cluster.inventory import loader
from cluster.nodes.fanout import Group
hs = list(loader.load(sys.argv[1]).hosts.values())
items = relay.items(__import__("pathlib").Path(sys.argv[2]), __import__("json").loads(sys.argv[3]))
with Group(hs) as g:
    relay.distribute(g, hs, items, {h.name: "/srv/cluster/w4" for h in hs})
"""


def test_rerun_after_an_interrupted_distribution_resumes(rlab) -> None:
    """The head dies mid-distribution (SIGKILL); the next run sends nothing already verified, and only the
    tail of each interrupted copy."""
    state, src, files = rlab
    p = subprocess.Popen([sys.executable, "-c", INTERRUPTED, state.inventory, str(src), json.dumps(files)],
                         cwd=ROOT, env={**os.environ, "CLUSTERCTL_TRANSFER_STALL_S": STALL_S})
    big = "big-1.0-py3-none-any.whl"
    part1 = node_dir(state, "node1", "w4") / f".{big}.part"
    try:  # the head's own copy to node1 is cut halfway; node2 and node3 relay behind it
        wait_until(lambda: part_size(part1) >= 5 << 20, 60, "node1 halfway through the big file")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    # a fetch already running on a node goes on without the head: it ends with its file or its stall limit
    wait_until(lambda: not fetches_running(), 30, "the nodes' fetches to end")
    before = {}
    for n in ("node1", "node2", "node3"):
        d = node_dir(state, n, "w4")
        try:
            verified = json.loads((d / relay.MANIFEST).read_text())
        except FileNotFoundError:
            verified = {}
        parts = {f: part_size(d / f".{f}.part") for f in files}
        before[n] = (verified, parts)
    assert before["node3"][0], "nothing was verified before the interruption: the test proves nothing"
    assert before["node1"][1][big] < BIG and before["node3"][1][big] < BIG, "the big file was not cut"
    _, res = distribute(state, src, files, "w4")
    assert all(r.ok for r in res.values()), {n: r.error for n, r in res.items()}
    for n, (verified, parts) in before.items():
        assert_complete(state, n, "w4", files)
        todo = [f for f in files if f not in verified]
        d = res[n].value
        assert d.files == len(todo)
        # only what was not verified moves: each interrupted copy resumes after its last whole piece
        most = sum(files[f]["size"] - (parts[f] // relay.PIECE) * relay.PIECE for f in todo)
        assert d.received <= most, (n, d.to_dict(), parts)
        assert d.resumed >= sum((parts[f] // relay.PIECE) * relay.PIECE for f in todo) - relay.PIECE
    # the relays of the killed run lost their pidfile to the new run's survey, and ended
    wait_until(lambda: listening(state) == [], 10, "every relay to stop")
