"""The node side of the peer relay (cluster/agent/relaynode.py) on loopback, and the head's plan.

Each test runs the real script with the system's python, as a node would: a relay serving one directory,
fetches into another, with tokens, allow lists, corrupted sources and interrupted copies.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.relay import distribute, progress as relay_progress, run as relay_run
from cluster.errors import ClusterError
from cluster.nodes.fanout import Group
from cluster.inventory.model import Host
from cluster.transport import CommandResult
from cluster.agent import relaynode

SCRIPT = Path(relaynode.__file__)
PIECE = 64 * 1024  # small pieces: several per file, fast tests


def node(verb: str, req: dict, timeout: float = 60) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, str(SCRIPT), verb], input=json.dumps(req), capture_output=True, text=True,
                       timeout=timeout)
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1])


def pieces(data: bytes) -> list[str]:
    return [hashlib.sha256(data[i:i + PIECE]).hexdigest() for i in range(0, len(data), PIECE)]


@pytest.fixture
def served(tmp_path: Path):
    """A relay on 127.0.0.1 serving tmp/src; yields (port, data, src dir, token, pidfile); stopped at the end."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(5 * PIECE + 123)
    (src / "a.whl").write_bytes(data)
    token = "t" * 32
    pidfile = tmp_path / "relay.pid"
    rc, doc = node("serve", {"token": token, "bind": "127.0.0.1", "port": 0, "root": str(src),
                             "allow": ["127.0.0.1"], "stall_s": 1.0, "idle_s": 30, "max_s": 60,
                             "pidfile": str(pidfile)})
    assert rc == 0 and doc["ok"] and isinstance(doc["port"], int), doc
    try:
        yield doc["port"], data, src, token, pidfile
    finally:
        node("stop", {"pidfile": str(pidfile)})


def fetch_req(tmp_path: Path, port: int, data: bytes, token: str, name: str = "a.whl", **kw) -> dict:
    f = {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pieces": pieces(data),
         "sources": kw.pop("sources", [["127.0.0.1", port]])}
    return {"token": token, "dir": str(tmp_path / "dst"), "piece": PIECE, "stall_s": 1.0, "connect_s": 2,
            "files": [f], **kw}


def test_fetch_verifies_names_and_records_the_file(tmp_path: Path, served) -> None:
    port, data, _, token, _ = served
    rc, doc = node("fetch", fetch_req(tmp_path, port, data, token))
    assert rc == 0 and doc["ok"], doc
    r = doc["files"]["a.whl"]
    assert r["received"] == len(data) and r["resumed_from"] == 0 and r["source"] == f"127.0.0.1:{port}"
    assert (tmp_path / "dst" / "a.whl").read_bytes() == data
    assert not (tmp_path / "dst" / ".a.whl.part").exists()
    manifest = json.loads((tmp_path / "dst" / distribute.MANIFEST).read_text())
    assert manifest == {"a.whl": hashlib.sha256(data).hexdigest()}


def test_wrong_token_is_refused_and_nothing_is_written(tmp_path: Path, served) -> None:
    port, data, _, _, _ = served
    rc, doc = node("fetch", fetch_req(tmp_path, port, data, "x" * 32))
    r = doc["files"]["a.whl"]
    assert rc == 3 and not doc["ok"] and r["failed"][f"127.0.0.1:{port}"]["kind"] == "refused"
    assert "token" in r["failed"][f"127.0.0.1:{port}"]["detail"]
    assert not (tmp_path / "dst" / "a.whl").exists() and (tmp_path / "dst" / ".a.whl.part").stat().st_size == 0


def test_names_outside_the_directory_are_refused(tmp_path: Path, served) -> None:
    port, data, _, token, _ = served
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.settimeout(5)
        s.sendall(json.dumps({"token": token, "name": "../src/a.whl", "offset": 0, "size": 10}).encode() + b"\n")
        assert s.recv(100) == b"ERR request\n"


def test_corrupt_source_is_refused_and_the_next_source_finishes(tmp_path: Path, served) -> None:
    port, data, src, token, _ = served
    # a second relay whose copy has one flipped byte in piece 3
    bad = tmp_path / "bad"
    bad.mkdir()
    corrupt = bytearray(data)
    corrupt[3 * PIECE + 7] ^= 0xFF
    (bad / "a.whl").write_bytes(bytes(corrupt))
    rc, doc2 = node("serve", {"token": token, "bind": "127.0.0.1", "port": 0, "root": str(bad), "allow": [],
                              "stall_s": 1.0, "idle_s": 30, "max_s": 60, "pidfile": str(tmp_path / "bad.pid")})
    try:
        rc, doc = node("fetch", fetch_req(tmp_path, port, data, token,
                                          sources=[["127.0.0.1", doc2["port"]], ["127.0.0.1", port]]))
    finally:
        node("stop", {"pidfile": str(tmp_path / "bad.pid")})
    r = doc["files"]["a.whl"]
    assert rc == 0 and r["ok"] and r["refused_pieces"] == 1, doc
    assert r["failed"][f"127.0.0.1:{doc2['port']}"]["kind"] == "corrupt"
    # the three good pieces from the bad source are kept: only the rest comes from the good one
    assert r["received"] == len(data) and r["source"] == f"127.0.0.1:{port}"
    assert (tmp_path / "dst" / "a.whl").read_bytes() == data


def test_resume_keeps_only_the_verified_prefix(tmp_path: Path, served) -> None:
    port, data, _, token, _ = served
    dst = tmp_path / "dst"
    dst.mkdir()
    # an interrupted copy: two good pieces, then garbage where the third should be
    (dst / ".a.whl.part").write_bytes(data[:2 * PIECE] + b"garbage" * 100)
    rc, doc = node("fetch", fetch_req(tmp_path, port, data, token))
    r = doc["files"]["a.whl"]
    assert rc == 0 and r["resumed_from"] == 2 * PIECE and r["received"] == len(data) - 2 * PIECE
    assert (dst / "a.whl").read_bytes() == data


def test_a_growing_part_is_relayed_as_it_grows(tmp_path: Path, served) -> None:
    """Cut-through: the relay serves a .part another copy is still filling."""
    port, _, src, token, _ = served
    data = os.urandom(4 * PIECE)
    part = src / ".b.whl.part"
    part.write_bytes(data[:PIECE])
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "fetch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    proc.stdin.write(json.dumps(fetch_req(tmp_path, port, data, token, name="b.whl")))
    proc.stdin.close()
    for k in (2, 3, 4):
        time.sleep(0.3)
        with open(part, "ab") as f:
            f.write(data[(k - 1) * PIECE:k * PIECE])
    part.rename(src / "b.whl")
    out = proc.stdout.read()  # bounded: the fetch ends within its stall limit (1 s) once the file stops growing
    proc.wait(timeout=30)
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["ok"] and (tmp_path / "dst" / "b.whl").read_bytes() == data


def test_a_silent_source_is_abandoned_after_the_stall_limit(tmp_path: Path) -> None:
    """A source that accepts and never answers: the fetch gives up after stall_s, not never."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        data = os.urandom(PIECE)
        t = time.monotonic()
        rc, doc = node("fetch", fetch_req(tmp_path, srv.getsockname()[1], data, "t" * 32))
        took = time.monotonic() - t
    r = doc["files"]["a.whl"]
    assert rc == 3 and next(iter(r["failed"].values()))["kind"] == "stall" and took < 10


def test_stop_ends_the_relay_and_nothing_listens(tmp_path: Path, served) -> None:
    port, _, _, _, pidfile = served
    rc, doc = node("stop", {"pidfile": str(pidfile)})
    assert rc == 0 and doc["stopped"]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_relay_stops_when_idle(tmp_path: Path) -> None:
    pidfile = tmp_path / "r.pid"
    rc, doc = node("serve", {"token": "t", "bind": "127.0.0.1", "port": 0, "root": str(tmp_path), "stall_s": 1,
                             "idle_s": 0.5, "max_s": 60, "pidfile": str(pidfile)})
    deadline = time.monotonic() + 10
    while pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pidfile.exists()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", doc["port"]), timeout=2).close()


def test_commit_and_adopt_check_sha256(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    good, other = os.urandom(1000), os.urandom(1000)
    (d / ".g.whl.part").write_bytes(good)
    (d / ".o.whl.part").write_bytes(other)
    sums = {"g.whl": hashlib.sha256(good).hexdigest(), "o.whl": hashlib.sha256(good).hexdigest()}
    rc, doc = node("commit", {"dir": str(d), "files": sums})
    assert rc == 4 and doc["files"]["g.whl"]["ok"] and not doc["files"]["o.whl"]["ok"]
    assert (d / "g.whl").exists() and not (d / ".o.whl.part").exists()
    (d / "o.whl").write_bytes(other)
    rc, doc = node("adopt", {"dir": str(d), "files": sums, "drop_bad": True})
    assert doc["verified"] == ["g.whl"] and doc["bad"] == ["o.whl"] and not (d / "o.whl").exists()
    assert json.loads((d / distribute.MANIFEST).read_text()) == {"g.whl": sums["g.whl"]}


def test_a_name_ending_in_a_newline_is_no_plain_file_name(tmp_path: Path, served) -> None:
    """NAME_RE anchors with \\Z: with `$`, "g.whl\\n" passed and became a file of that name on the node."""
    d = tmp_path / "d"
    d.mkdir()
    data = os.urandom(100)
    (d / ".g.whl\n.part").write_bytes(data)
    rc, doc = node("commit", {"dir": str(d), "files": {"g.whl\n": hashlib.sha256(data).hexdigest()}})
    assert doc["files"]["g.whl\n"] == {"ok": False, "error": "not a plain file name"} and rc != 0
    assert sorted(p.name for p in d.iterdir()) == [".g.whl\n.part"]
    port, _, _, token, _ = served
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.settimeout(5)
        s.sendall(json.dumps({"token": token, "name": "a.whl\n", "offset": 0, "size": 10}).encode() + b"\n")
        assert s.recv(100) == b"ERR request\n"


def test_plan_sources_and_head_bytes() -> None:
    sizes = {"a": 10, "b": 20}
    p = distribute.Routes("relay", ["n1", "n2", "n3"], {"n1": ["a", "b"], "n2": ["a", "b"], "n3": ["b"]}, sizes)
    assert p.edges() == [("head", "n1", 2, 30), ("n1", "n2", 2, 30), ("n2", "n3", 1, 20)]
    assert p.head_bytes == 30  # each file once
    push = distribute.Routes("push", p.chain, p.needs, sizes)
    assert push.head_bytes == 80 and all(a == "head" for a, *_ in push.edges())
    # the first node has a file already: the others get it from peers, the head sends nothing of it
    q = distribute.Routes("relay", ["n1", "n2"], {"n1": [], "n2": ["a"]}, sizes)
    assert q.head_bytes == 0 and q.edges() == [("n1", "n2", 1, 10)]
    assert "node" not in " ".join(p.lines()) and p.lines()[-1] == "relay: the head sends 0 MiB in all"


def test_batches_group_small_files_and_keep_order() -> None:
    mk = lambda n, s: distribute.Item(n, Path(n), s, "0")  # noqa: E731
    files = [mk("big", distribute.BATCH_BYTES), *(mk(f"s{i}", 1) for i in range(40))]
    b = distribute.batches(files)
    assert [len(x) for x in b] == [1, distribute.BATCH_FILES, 40 - distribute.BATCH_FILES]
    assert [i.name for x in b for i in x] == [i.name for i in files]


def test_the_shipped_parts_run_on_their_own(tmp_path: Path) -> None:
    """The node gets only what the head uploads (relay_run.NODE_FILES), without clusterctl installed: the
    entry point must find every part it imports beside itself."""
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    for name, data in relay_run.node_sources().items():
        (node_dir / name).write_bytes(data)
    d = tmp_path / "d"
    d.mkdir()
    (d / "x.whl").write_bytes(b"x" * 10)
    r = subprocess.run([sys.executable, "-E", "-s", str(node_dir / "relaynode.py"), "adopt"], cwd=tmp_path,
                       input=json.dumps({"dir": str(d), "files": {"x.whl": hashlib.sha256(b"x" * 10).hexdigest()}}),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["verified"] == ["x.whl"], r.stderr


class FakeTransport:
    """A node whose `stat` answer the test sets: what the progress poll reads."""

    def __init__(self) -> None:
        self.stat = ""
        self.commands: list[str] = []

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult:
        self.commands.append(command)
        return CommandResult(0, self.stat, "", 0.0)

    def close(self) -> None:
        pass


def test_progress_is_per_byte_monotonic_and_ends_at_the_total() -> None:
    a, b = distribute.Item("a.whl", Path("a.whl"), 100, "0"), distribute.Item("b.whl", Path("b.whl"), 200, "0")
    t = FakeTransport()
    got: list[tuple[str, int]] = []
    states: list[distribute.NodeProgress] = []
    tracker = relay_progress.Tracker(lambda n: t, {"n2": "/srv/w"}, {"n2": (300, 2)},
                                     progress=lambda n, k: got.append((n, k)), status=states.append)
    tracker.begin("n2", [a, b], "n1")
    t.stat = "100 a.whl\n50 .b.whl.part\n"  # a whole, b's verified prefix growing
    tracker.poll_once()
    assert got == [("n2", 150)] and states[-1].have == 150 and states[-1].source == "n1"
    assert "n1" in states[-1].line() and "150" not in states[-1].line()  # MiB in the line, not bytes
    t.stat = "100 a.whl\n20 .b.whl.part\n"  # a resume cut the .part back: the count never goes back
    tracker.poll_once()
    assert got == [("n2", 150)]
    tracker.done("n2", [a, b])
    tracker.finish("n2", ok=True)
    assert sum(k for _, k in got) == 300 and states[-1].state == "done" and states[-1].files_done == 2
    assert ".b.whl.part" in t.commands[0]
    tracker.poll_once()  # nothing is polled once a node is done
    assert len(t.commands) == 2


def test_distribute_on_loopback_relays_along_the_chain(tmp_path: Path) -> None:
    """Three local nodes: the head sends each file once, the others relay; progress adds up to every node's
    total, and no relay is left running."""
    src = tmp_path / "src"
    src.mkdir()
    files = {}
    for name, size in (("big-1.0-py3-none-any.whl", distribute.PIECE + 12345), ("small-1.0-py3-none-any.whl", 777)):
        data = os.urandom(size)
        (src / name).write_bytes(data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": size}
    hosts = [Host(name=f"n{i}", address="127.0.0.1", connection="local", workdir=str(tmp_path / f"w{i}"))
             for i in (1, 2, 3)]
    got: dict[str, int] = {}
    states: list[distribute.NodeProgress] = []
    with Group(hosts) as g:
        plan, res = distribute.distribute(g, hosts, distribute.items(src, files), {h.name: h.workdir + "/wheels" for h in hosts},
                                     progress=lambda n, k: got.__setitem__(n, got.get(n, 0) + k),
                                     status=states.append)
    total = sum(int(m["size"]) for m in files.values())
    assert all(r.ok for r in res.values()), {n: r.error for n, r in res.items()}
    assert [e[:2] for e in plan.edges()] == [("head", "n1"), ("n1", "n2"), ("n2", "n3")]
    d = {n: r.value for n, r in res.items()}
    assert d["n1"].from_head == total and d["n2"].from_peers == {"n1": total} and d["n3"].from_peers == {"n2": total}
    assert got == {"n1": total, "n2": total, "n3": total}
    assert {s.node for s in states if s.state == "done"} == {"n1", "n2", "n3"}
    for h in hosts:
        assert not Path(distribute.pidfile(h)).exists()
        for name, meta in files.items():
            assert hashlib.sha256((Path(h.workdir) / "wheels" / name).read_bytes()).hexdigest() == meta["sha256"]


def test_the_head_lists_pieces_only_for_a_file_that_is_its_manifests(tmp_path: Path) -> None:
    """Nodes check pieces only: the piece list is made in the pass that checks the file's sha256."""
    data = os.urandom(3 * distribute.PIECE + 5)
    (tmp_path / "a.whl").write_bytes(data)
    good = {"a.whl": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}
    [item] = distribute.items(tmp_path, good)
    assert list(item.pieces) == [hashlib.sha256(data[i:i + distribute.PIECE]).hexdigest()
                                 for i in range(0, len(data), distribute.PIECE)]
    (tmp_path / "a.whl").write_bytes(data[:-1] + b"!")  # changed on disk after the manifest was written
    with pytest.raises(ClusterError, match="not the one recorded"):
        distribute.items(tmp_path, good)
