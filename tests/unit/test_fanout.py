"""Fan-out policy with real transports: local nodes, a closed port, and a port that never answers."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from cluster.nodes.fanout import Group
from cluster.inventory.model import Host
from cluster.transport import Transport


def local(name: str, tmp_path: Path) -> Host:
    return Host(name=name, address="127.0.0.1", connection="local", workdir=str(tmp_path / name),
                command_timeout=30)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port on loopback that accepts connections and never says a word (a hung sshd)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def test_results_for_every_node_whatever_each_does(tmp_path: Path, silent_port: int) -> None:
    hosts = [
        local("ok", tmp_path),
        local("fails", tmp_path),
        local("slow", tmp_path),
        Host(name="refused", address="127.0.0.1", port=closed_port(), connect_timeout=2),
        Host(name="hung", address="127.0.0.1", port=silent_port, connect_timeout=1.5),
    ]
    cmds = {"ok": "echo hello", "fails": "echo oops >&2; exit 3", "slow": "sleep 30"}
    start = time.monotonic()
    with Group(hosts) as g:
        r = g.run(lambda h: cmds.get(h.name, "true"), timeout=2)
    wall = time.monotonic() - start
    assert list(r) == ["ok", "fails", "slow", "refused", "hung"]
    assert (r["ok"].status, r["ok"].stdout) == ("ok", "hello\n")
    assert (r["fails"].status, r["fails"].exit_code, r["fails"].stderr) == ("failed", 3, "oops\n")
    assert (r["slow"].status, r["slow"].problem) == ("failed", "command-timeout")
    assert (r["refused"].status, r["refused"].problem) == ("unreachable", "refused")
    assert (r["hung"].status, r["hung"].problem) == ("unreachable", "timeout")
    assert "sshd" in (r["refused"].fix or "")
    assert set(r.succeeded) == {"ok"} and set(r.failed) == {"fails", "slow"}
    assert set(r.unreachable) == {"refused", "hung"} and not r.ok
    # everything ran at once: the slowest node bounds the wall time, not the sum
    assert wall < 2 + 1.5 + 2, wall


def test_unreachable_node_is_not_retried_within_one_group(tmp_path: Path) -> None:
    hosts = [local("ok", tmp_path), Host(name="refused", address="127.0.0.1", port=closed_port())]
    with Group(hosts) as g:
        first = g.run("true")
        second = g.run("true")
    assert first["refused"] is second["refused"]  # the remembered failure, no second connect
    assert second["ok"].ok


def test_bounded_concurrency(tmp_path: Path) -> None:
    hosts = [local(f"n{i}", tmp_path) for i in range(4)]
    with Group(hosts, forks=2) as g:
        r = g.run("date +%s.%N; sleep 0.5; date +%s.%N")
    spans = sorted(tuple(map(float, x.stdout.split())) for x in r.values())
    # with 2 forks, the 3rd node starts only after one of the first two ended
    assert spans[2][0] >= min(spans[0][1], spans[1][1]) - 0.05


def test_call_returns_values_and_catches_surprises(tmp_path: Path) -> None:
    def fn(t: Transport) -> str:
        if t.host.name == "n1":
            raise ValueError("boom")
        return t.host.workdir

    with Group([local("n0", tmp_path), local("n1", tmp_path)]) as g:
        r = g.call(fn)
    assert r["n0"].value == str(tmp_path / "n0")
    assert r["n1"].status == "failed" and r["n1"].error == "ValueError: boom"
