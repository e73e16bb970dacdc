"""Fault injection on copies over SSH, against a real sshd in the simulated lab (docs/reliability.md).

A node whose sshd is frozen (SIGSTOP on every process of its network namespace: TCP stays up, nothing
answers) in the middle of a copy to it (launch's upload, the wheel push, dataset staging all use
put_file/send_file) and in the middle of `clusterctl collect`: the call must end within the stall limit
plus the documented slack, with the right error and exit code, write nothing outside its target, and after
SIGCONT the next call must finish the copy without sending the verified bytes again. Also: a slow link that
keeps moving is never cut, and a revoked host key is refused (exit 3) while a @cert-authority line is not
an error. Each fault adds a row (fault, stage, time to verdict, outcome) printed at the end of the module.
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from cluster.runs import records
from cluster.lab import lifecycle, sshd
from cluster.errors import TransportError
from cluster.inventory.model import Host
from cluster.transport.base import STALL_ENV
from cluster.transport.ssh import SSHTransport
from tests.conftest import ROOT
from tests.integration.conftest import clusterctl, lab_up, wait_until

STALL_S = 2.0  # the stall limit these tests use (the default is 30 s: same code path, shorter wait)
LINK = "16mbit"  # 2 MB/s each way: a 4 MiB copy takes about 2 s, so there is time to freeze it midway
LINK_BYTES_S = 2_000_000
SSH_WINDOW = 2 * 2**20  # what the node's sshd lets us send before it must read (OpenSSH's session window)
# The promised bound, from the freeze: the bytes the kernel still accepts (at most one SSH window in
# flight) drain at link speed, then `stall` seconds without progress, then a little process overhead.
BOUND_S = STALL_S + SSH_WINDOW / LINK_BYTES_S + 2.0
SIZE = 4 * 2**20

ROWS: list[tuple[str, str, float, str]] = []


@pytest.fixture(scope="module")
def tlab(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[lifecycle.LabState]:
    try:
        with lab_up(tmp_path_factory, "x", 1, 23, bandwidth=LINK) as (state, _):
            yield state
    finally:
        _print_table(pytestconfig)


def _print_table(config: pytest.Config) -> None:
    """The figures for docs/reliability.md, past pytest's output capture (shown without -s too)."""
    if not ROWS:
        return
    lines = ["", f"fault injection, copies (stall limit {STALL_S:g} s, link {LINK}, promised bound {BOUND_S:.1f} s)",
             f"| {'fault':<36} | {'stage':<30} | time to verdict | outcome |",
             f"|{'-' * 38}|{'-' * 32}|{'-' * 17}|---------|"]
    lines += [f"| {fault:<36} | {stage:<30} | {secs:13.1f} s | {outcome} |" for fault, stage, secs, outcome in ROWS]
    capture = config.pluginmanager.get_plugin("capturemanager")
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or tr is None:
        print("\n".join(lines), file=sys.stderr)
        return
    with capture.global_and_fixture_disabled():
        for line in lines:
            tr.write_line(line)


def _host(state: lifecycle.LabState) -> Host:
    d, n = Path(state.dir), state.nodes[0]
    return Host(name=n.name, address=n.address, user="root", identity_file=str(d / "id_ed25519"),
                known_hosts=str(d / "known_hosts"), workdir=str(sshd.MOUNT_POINT), python=sys.executable,
                connect_timeout=3)


def _node_dir(state: lifecycle.LabState) -> Path:
    """The node's /srv/cluster, seen from the head (the lab bind-mounts it from here)."""
    return Path(state.nodes[0].dir) / "srv"


def _pids(state: lifecycle.LabState) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", state.nodes[0].netns], capture_output=True, text=True,
                         timeout=10).stdout
    return [int(p) for p in out.split()]


@contextmanager
def frozen(state: lifecycle.LabState) -> Iterator[list[int]]:
    """SIGSTOP every process of the node (sshd, its sessions, internal-sftp): TCP stays up, nothing answers.
    Always resumed, whatever the test does."""
    pids = _pids(state)
    assert pids, "the node has no sshd to freeze"
    stopped = []
    try:
        for p in pids:
            os.kill(p, signal.SIGSTOP)
            stopped.append(p)
        yield pids
    finally:
        for p in stopped:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _size(p: Path) -> int:
    return p.stat().st_size if p.exists() else 0


def _settled_size(p: Path) -> int:
    """The size once the resumed (SIGCONT) old session has written what it still had buffered and exited."""
    last, since = -1, time.monotonic()
    while time.monotonic() - since < 0.5:
        now = _size(p)
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(0.05)
    return last


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _outside(home: Path, run_id: str) -> set[str]:
    """What the head holds outside the run's folder, but for the MACs the nodes' facts gave (clusterctl's own
    state, for `wake`: collect records them as check and provision do)."""
    return {p for p in _tree(home) if not p.startswith(f"runs/{run_id}/")
            and not (p == "state" or p.startswith("state/") and p.endswith(".macs.json"))}


def test_a_slow_link_that_keeps_moving_is_never_cut(tlab: lifecycle.LabState, tmp_path: Path) -> None:
    src = tmp_path / "slow.bin"
    src.write_bytes(os.urandom(SIZE))
    t = SSHTransport(_host(tlab))
    t.stall_timeout = 0.5  # far below the copy's duration: only silence may count, not total time
    try:
        start = time.monotonic()
        t.put_file(src, "/srv/cluster/slow.bin")
        up = time.monotonic() - start
        got = bytearray()
        start = time.monotonic()
        t.get_range("/srv/cluster/slow.bin", 0, SIZE, got.extend)
        down = time.monotonic() - start
    finally:
        t.close()
    assert (_node_dir(tlab) / "slow.bin").read_bytes() == src.read_bytes() == bytes(got)
    assert up > 3 * t.stall_timeout and down > 3 * t.stall_timeout, (up, down)
    ROWS.append(("slow link (16 Mbit/s), stall 0.5 s", "put_file + get_range 4 MiB", up + down,
                 "completed, not cut"))


def test_sshd_frozen_mid_upload_then_resumed(tlab: lifecycle.LabState, tmp_path: Path) -> None:
    src = tmp_path / "data.npz"
    src.write_bytes(os.urandom(SIZE))
    part = _node_dir(tlab) / "datasets" / ".data.npz.part"
    part.parent.mkdir(exist_ok=True)
    before = _tree(_node_dir(tlab))
    t = SSHTransport(_host(tlab))
    t.stall_timeout = STALL_S
    outcome: dict[str, Any] = {}

    def upload() -> None:
        try:
            outcome["sent"] = t.send_file(src, "/srv/cluster/datasets/.data.npz.part")
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = e
        outcome["end"] = time.monotonic()

    worker = threading.Thread(target=upload, daemon=True)
    try:
        worker.start()
        wait_until(lambda: _size(part) >= 512 * 1024, 30, "the upload to start")
        with frozen(tlab):
            froze = time.monotonic()
            worker.join(BOUND_S + 10)
            assert not worker.is_alive(), f"the upload still waits {BOUND_S + 10:.0f}s after the freeze"
        verdict = outcome["end"] - froze
        e = outcome.get("error")
        assert isinstance(e, TransportError) and e.problem == "timeout", repr(e)
        assert e.exit_code == 3
        assert "node1" in e.message and ".data.npz.part" in e.message and "bytes sent" in e.message
        assert "resume" in (e.fix or "")
        assert verdict <= BOUND_S, f"verdict after {verdict:.1f}s, bound {BOUND_S:.1f}s"
        ROWS.append(("sshd frozen (SIGSTOP)", "upload (put_file) 4 MiB", verdict, "TransportError timeout, exit 3"))

        have = _settled_size(part)
        assert 0 < have < SIZE
        start = time.monotonic()
        sent = t.send_file(src, "/srv/cluster/datasets/.data.npz.part")  # reconnects by itself
        resumed = time.monotonic() - start
    finally:
        t.close()
    assert sent == SIZE - have, "the verified bytes must not be sent again"
    assert hashlib.sha256(part.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()
    assert _tree(_node_dir(tlab)) - before == {"datasets/.data.npz.part"}  # nothing else written
    ROWS.append(("after SIGCONT", "upload resumed", resumed, f"sent {sent} of {SIZE} bytes, sha256 equal"))


def test_a_frozen_node_behind_small_tcp_buffers_still_costs_only_a_bounded_stall(tlab: lifecycle.LabState,
                                                                                  tmp_path: Path) -> None:
    """The wait paramiko cannot bound: TCP buffers smaller than the SSH window left, so a write to a frozen
    node blocks in the kernel, where paramiko's Packetizer.write_all retries forever (it hung a CI run).
    The copy's watchdog closes the connection: a stall verdict within twice the stall limit."""
    netns = tlab.nodes[0].netns
    sysctl = ["ip", "netns", "exec", netns, "sysctl", "-q"]
    old = subprocess.run([*sysctl, "-n", "net.ipv4.tcp_rmem"], capture_output=True, text=True, timeout=10).stdout
    subprocess.run([*sysctl, "-w", "net.ipv4.tcp_rmem=4096 8192 8192"], check=True, timeout=10)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(SIZE))
    t = SSHTransport(_host(tlab))
    t.stall_timeout = STALL_S
    outcome: dict[str, Any] = {}
    try:
        t.run("true", timeout=10)  # connected: now the head's side of the socket gets a small send buffer
        sock = t._client.get_transport().sock  # type: ignore[union-attr]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)

        def upload() -> None:
            try:
                t.put_file(src, "/srv/cluster/big.bin")
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                outcome["error"] = e
            outcome["end"] = time.monotonic()

        worker = threading.Thread(target=upload, daemon=True)
        worker.start()
        wait_until(lambda: _size(_node_dir(tlab) / "big.bin") >= 256 * 1024, 30, "the upload to start")
        with frozen(tlab):
            froze = time.monotonic()
            worker.join(2 * STALL_S + 10)
            assert not worker.is_alive(), f"the upload still waits {2 * STALL_S + 10:.0f}s after the freeze"
    finally:
        t.close()
        subprocess.run([*sysctl, "-w", f"net.ipv4.tcp_rmem={old.strip()}"], timeout=10)
    e = outcome.get("error")
    assert isinstance(e, TransportError) and e.problem == "timeout", repr(e)
    verdict = outcome["end"] - froze
    assert verdict <= 2 * STALL_S + 2.0, f"verdict after {verdict:.1f}s"
    ROWS.append(("sshd frozen, 8 KiB TCP buffers", "upload (put_file) 4 MiB", verdict,
                 "TransportError timeout (watchdog), exit 3"))


def _agent(state: lifecycle.LabState) -> None:
    from cluster.runs import payload, render

    p = _node_dir(state) / render.AGENT
    p.parent.mkdir(parents=True, exist_ok=True)
    for name, content in payload.agent_files().items():
        p.with_name(name).write_bytes(content)


def _record(state: lifecycle.LabState, run_id: str) -> records.RunRecord:
    host = _host(state)
    return records.RunRecord(run_id=run_id, job="faults", framework="pytorch", state="failed", created=time.time(),
                          nodes=[records.RunNode(host.name, 0, 1, f"/srv/cluster/runs/{run_id}")],
                          inventory={"path": str(state.inventory), "name": state.name, "hosts": [host.to_dict()]})


def test_sshd_frozen_mid_collect_then_resumed(tlab: lifecycle.LabState, tmp_path: Path) -> None:
    run_id = "faults-collect-1"
    home = Path(os.environ["CLUSTERCTL_HOME"])
    env = {"CLUSTERCTL_HOME": str(home), STALL_ENV: f"{STALL_S:g}"}
    node_run = _node_dir(tlab) / "runs" / run_id
    node_run.mkdir(parents=True)
    (node_run / "train.log").write_text("epoch 1 loss 0.9\n")
    (node_run / "big.bin").write_bytes(os.urandom(SIZE))
    _agent(tlab)
    records.save(_record(tlab, run_id))
    base = records.run_path(run_id)
    part = base / "node1" / "big.bin.part"
    outside_before = _outside(home, run_id)

    proc = subprocess.Popen([sys.executable, "-m", "cluster", "collect", run_id, "--json"], cwd=ROOT,
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _size(part) >= 512 * 1024 or proc.poll() is not None, 60, "collect to start copying")
        assert proc.poll() is None, proc.communicate()
        with frozen(tlab):
            froze = time.monotonic()
            try:
                out, err = proc.communicate(timeout=BOUND_S + 10)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"collect still waits {BOUND_S + 10:.0f}s after the freeze") from None
            verdict = time.monotonic() - froze
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, (out, err)
    node = json.loads(out)["nodes"][0]
    assert node["status"] == "unreachable" and "big.bin" in node["error"] and "no progress" in node["error"], node
    assert "Traceback" not in err
    assert verdict <= BOUND_S + 1.5, f"verdict after {verdict:.1f}s, bound {BOUND_S + 1.5:.1f}s (+ process exit)"
    ROWS.append(("sshd frozen (SIGSTOP)", "clusterctl collect 4 MiB", verdict, "node unreachable, exit 3"))
    assert records.load(run_id).state == "failed"  # the record's state is not touched by collect
    have = _size(part)
    assert 0 < have < SIZE

    start = time.monotonic()
    r = clusterctl("collect", run_id, "--json", env=env, timeout=120)
    resumed = time.monotonic() - start
    assert r.returncode == 0, (r.stdout, r.stderr)
    node = json.loads(r.stdout)["nodes"][0]
    small = len("epoch 1 loss 0.9\n")
    assert node["status"] == "ok" and node["bytes"] in (SIZE - have, SIZE - have + small), (node, have)
    assert (base / "node1" / "big.bin").read_bytes() == (node_run / "big.bin").read_bytes()
    assert not part.exists()
    outside_after = _outside(home, run_id)
    assert outside_after == outside_before, outside_after ^ outside_before  # nothing outside the run folder
    ROWS.append(("after SIGCONT", "collect resumed", resumed, f"fetched {node['bytes']} of {SIZE} bytes, verified"))


def test_revoked_host_key_is_refused_cert_authority_is_not_an_error(tlab: lifecycle.LabState, tmp_path: Path) -> None:
    d = Path(tlab.dir)
    kind, b64 = (Path(tlab.nodes[0].dir) / "hostkey.pub").read_text().split()[:2]
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "ca")], check=True)
    ca = " ".join((tmp_path / "ca.pub").read_text().split()[:2])
    inv = tmp_path / "inv.yaml"
    kh = tmp_path / "known_hosts"
    inv.write_text((d / "inventory.yaml").read_text().replace(str(d / "known_hosts"), str(kh)))
    recorded = (d / "known_hosts").read_text()

    kh.write_text(f"@cert-authority *.lab.example.org {ca}\n" + recorded)
    start = time.monotonic()
    r = clusterctl("exec", str(inv), "--", "true", timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr)
    ROWS.append(("@cert-authority line in known_hosts", "exec", time.monotonic() - start, "ignored, exit 0"))

    kh.write_text(f"@cert-authority *.lab.example.org {ca}\n{recorded}@revoked * {kind} {b64}\n")
    start = time.monotonic()
    r = clusterctl("exec", str(inv), "--", "true", timeout=60, env={"COLUMNS": "300"})  # the path unfolded
    both = r.stdout + r.stderr
    assert r.returncode == 3, both
    assert "REVOKED" in both and f"{kh}:3" in both and "Traceback" not in both, both
    ROWS.append(("node's host key @revoked", "exec", time.monotonic() - start, "refused, exit 3"))


def test_sshd_frozen_before_a_command_and_before_connecting(tlab: lifecycle.LabState) -> None:
    host = _host(tlab)
    t = SSHTransport(host)
    try:
        assert t.run("echo up", timeout=30).stdout.strip() == "up"  # an open connection, then the freeze
        with frozen(tlab):
            start = time.monotonic()
            with pytest.raises(TransportError) as e:
                t.run("echo hello", timeout=600)
            verdict = time.monotonic() - start
            assert e.value.problem == "timeout" and "node1" in e.value.message, e.value
            assert verdict <= host.connect_timeout + 1.5, verdict
            ROWS.append(("sshd frozen (SIGSTOP)", "command on an open connection", verdict,
                         "TransportError timeout, exit 3"))
            fresh = SSHTransport(host)
            start = time.monotonic()
            with pytest.raises(TransportError) as e:
                fresh.connect()
            verdict = time.monotonic() - start
            assert e.value.problem == "timeout", e.value
            assert verdict <= host.connect_timeout + 1.5, verdict
            ROWS.append(("sshd frozen (SIGSTOP)", "connect (banner)", verdict, "TransportError timeout, exit 3"))
        start = time.monotonic()
        assert t.run("echo back", timeout=30).stdout.strip() == "back"  # the same transport reconnects
        ROWS.append(("after SIGCONT", "next command", time.monotonic() - start, "reconnected, exit 0"))
    finally:
        t.close()


def test_the_nodes_answer_about_a_file_is_not_a_lost_node(tlab: lifecycle.LabState) -> None:
    """No such file, permission denied: the node answered, so the error is about the file (OSError) and the
    connection stays up for the next call."""
    t = SSHTransport(_host(tlab))
    try:
        with pytest.raises(FileNotFoundError):
            t.get_bytes("/srv/cluster/no/such/file")
        with pytest.raises(FileNotFoundError):
            t.put_bytes(b"x", "/srv/cluster/no/such/dir/file")
        client = t._client
        t.put_bytes(b"hello", "/srv/cluster/hello.txt", 0o600)
        assert t._client is client  # not reconnected: nothing was wrong with the link
        assert t.get_bytes("/srv/cluster/hello.txt") == b"hello"
        assert (_node_dir(tlab) / "hello.txt").stat().st_mode & 0o777 == 0o600
    finally:
        t.close()
