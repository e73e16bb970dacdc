"""Transport pieces that need no SSH server: the stall setting, resumable copies (send_file), the node-side
bound of a command (its wrapper, run here by a shell as sshd would) and the command watchdog."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cluster.errors import TransportError, UsageError
from cluster.inventory.model import Host
from cluster.transport import base, ssh
from cluster.transport.local import LocalTransport


def _local(tmp_path: Path) -> LocalTransport:
    return LocalTransport(Host(name="n", address="127.0.0.1", connection="local", workdir=str(tmp_path)))


def test_stall_timeout_default_and_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(base.STALL_ENV, raising=False)
    assert _local(tmp_path).stall_timeout == base.STALL_TIMEOUT_S == 30.0
    monkeypatch.setenv(base.STALL_ENV, "7.5")
    assert _local(tmp_path).stall_timeout == 7.5


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "nan", "inf"])
def test_stall_timeout_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    raw: str) -> None:
    monkeypatch.setenv(base.STALL_ENV, raw)
    with pytest.raises(UsageError) as e:
        _local(tmp_path)
    assert base.STALL_ENV in str(e.value) and "positive number of seconds" in str(e.value)
    assert e.value.exit_code == 2


def test_send_file_resumes_a_verified_prefix(tmp_path: Path) -> None:
    t = _local(tmp_path)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    dest = tmp_path / "node" / "dest.part"
    dest.parent.mkdir()
    dest.write_bytes(src.read_bytes()[:123_456])  # a copy cut short
    assert t.send_file(src, str(dest), 0o600) == 300_000 - 123_456
    assert dest.read_bytes() == src.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o600
    assert t.send_file(src, str(dest)) == 0  # complete: nothing crosses again
    assert dest.stat().st_mode & 0o777 == 0o644


def test_send_file_restarts_when_the_remote_bytes_differ(tmp_path: Path) -> None:
    t = _local(tmp_path)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(200_000))
    dest = tmp_path / "dest.part"
    wrong = bytearray(src.read_bytes()[:50_000])
    wrong[10] ^= 1
    dest.write_bytes(bytes(wrong))
    assert t.send_file(src, str(dest)) == 200_000
    assert dest.read_bytes() == src.read_bytes()
    dest.write_bytes(src.read_bytes() + b"more")  # longer than the source: not a prefix
    assert t.send_file(src, str(dest)) == 200_000
    assert dest.read_bytes() == src.read_bytes()


def test_send_file_to_a_missing_file_sends_everything(tmp_path: Path) -> None:
    t = _local(tmp_path)
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    assert t.send_file(src, str(tmp_path / "a" / "b.part")) == 1000
    assert (tmp_path / "a" / "b.part").read_bytes() == b"x" * 1000


SHELLS = [s for s in ("/bin/sh", "/bin/bash") if Path(s).exists()]
NASTY = "cat; printf '%s|%s\\n' \"it's\" '$HOME;`x`'; echo to-err >&2; exit 7"


def _as_sshd(shell: str, command: str, stdin: bytes = b"", path: str | None = None,
             timeout: float = 20) -> subprocess.CompletedProcess[bytes]:
    """`command` as sshd runs it: the login shell's -c, in a session of its own, $SHELL set."""
    env = {**os.environ, "SHELL": shell, **({"PATH": path} if path is not None else {})}
    return subprocess.run([shell, "-c", command], input=stdin, capture_output=True, env=env,
                          start_new_session=True, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_bounded_command_renders_quoted_values_and_the_node_bound() -> None:
    w = ssh.bounded_command("echo 'a b'; exit 3", 2.5, "t0k")
    assert "set -- timeout -k 5 8; fi" in w  # ceil(2.5 + 5): the node's bound ends after the head's
    assert w.endswith(" -c 'echo '\"'\"'a b'\"'\"'; exit 3'")
    assert f"{ssh.TOKEN_ENV}=t0k; export {ssh.TOKEN_ENV};" in w and "clusterctl-pgid:t0k:" in w
    evil = "x'; touch pwned; '$(id)"  # a token is hex, but every value is quoted all the same
    r = _as_sshd("/bin/sh", ssh.bounded_command(f"printf %s \"${ssh.TOKEN_ENV}\"", 1, evil))
    assert (r.returncode, r.stdout, ssh.split_marker(r.stderr, evil)[1]) == (0, evil.encode(), b"")
    assert not Path("pwned").exists()
    assert ssh.node_bound(600) == 605 and ssh.node_bound(0.2, margin=0) == 1


@pytest.mark.parametrize("shell", SHELLS)
def test_the_wrapper_changes_nothing_the_command_sees(shell: str) -> None:
    """Stdin, stdout, exit code and (its marker line stripped) stderr are those of the command run bare."""
    bare = _as_sshd(shell, NASTY, b"IN\n")
    token = "abc123"
    wrapped = _as_sshd(shell, ssh.bounded_command(NASTY, 30, token), b"IN\n")
    pgid, err = ssh.split_marker(wrapped.stderr, token)
    assert (wrapped.returncode, wrapped.stdout, err) == (bare.returncode, bare.stdout, bare.stderr)
    assert bare.returncode == 7 and bare.stdout == b"IN\nit's|$HOME;`x`\n" and bare.stderr == b"to-err\n"
    assert pgid is not None and pgid > 1
    killed = _as_sshd(shell, ssh.bounded_command("kill -s TERM $$", 30, token))
    assert killed.returncode == _as_sshd(shell, "kill -s TERM $$").returncode == -signal.SIGTERM


@pytest.mark.parametrize("shell", SHELLS)
def test_without_timeout_on_the_node_the_command_still_runs(shell: str, tmp_path: Path) -> None:
    r = _as_sshd(shell, ssh.bounded_command("echo hi; exit 3", 30, "tk"), path=str(tmp_path))  # no `timeout`
    pgid, err = ssh.split_marker(r.stderr, "tk")
    assert (r.returncode, r.stdout, err) == (3, b"hi\n", b"") and pgid is not None  # the head's kill still works


def test_split_marker_strips_only_its_own_line() -> None:
    assert ssh.split_marker(b"clusterctl-pgid:tk:4242\nboom\n", "tk") == (4242, b"boom\n")
    assert ssh.split_marker(b"bashrc says hi\nclusterctl-pgid:tk:7\nboom", "tk") == (7, b"bashrc says hi\nboom")
    for other in (b"clusterctl-pgid:other:7\nboom", b"clusterctl-pgid:tk:7", b"x clusterctl-pgid:tk:7\n", b""):
        assert ssh.split_marker(other, "tk") == (None, other)


def test_the_node_bound_ends_the_group_and_spares_a_detached_session() -> None:
    """Past the node's bound `timeout` signals the command's whole process group; a process that left it
    (setsid, as the node agent's `start` does for a training run) lives on."""
    if shutil.which("timeout") is None or shutil.which("setsid") is None:
        pytest.skip("needs coreutils timeout and util-linux setsid")
    cmd = "setsid sleep 30 >/dev/null 2>&1 & echo $!; sleep 31 & echo $!; wait"
    t0 = time.monotonic()
    r = _as_sshd("/bin/sh", ssh.bounded_command(cmd, 0.5, "tk", margin=0, kill_after=1), timeout=10)
    took = time.monotonic() - t0
    detached, grouped = (int(x) for x in r.stdout.split())
    try:
        assert r.returncode == 124 and took < 5, (r, took)  # timeout's own exit code at its bound
        time.sleep(0.2)
        assert not _alive(grouped) and _alive(detached)
    finally:
        for p in (detached, grouped):
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_the_group_kill_needs_the_token() -> None:
    """The head's kill after a timeout signals the group only if a member carries this call's token: a
    process group whose number was reused by someone else is never touched."""
    token = "k1ll"
    proc = subprocess.Popen(["/bin/sh", "-c", ssh.bounded_command("sleep 30 & sleep 31", 60, token)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "SHELL": "/bin/sh"}, start_new_session=True)
    try:
        assert proc.stderr is not None
        pgid, _ = ssh.split_marker(proc.stderr.readline(), token)
        assert pgid == proc.pid
        stranger = _as_sshd("/bin/sh", ssh.group_kill_command(pgid, "someone-else"))
        assert stranger.returncode == 1 and proc.poll() is None
        r = _as_sshd("/bin/sh", ssh.group_kill_command(pgid, token))
        assert r.returncode == 0 and proc.wait(5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


class _FrozenNode:
    """A connection to a node that stopped reading: a send blocks, as paramiko's Packetizer.write_all does on a
    full socket, until the socket is closed under it (the fake's wait is itself bounded for the test)."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.status_event = threading.Event()

    def open_session(self, timeout: float) -> _FrozenNode:
        return self

    def is_active(self) -> bool:
        return not self.closed.is_set()

    def exec_command(self, command: str) -> None:
        pass

    def settimeout(self, t: float) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.closed.wait(20)
        raise EOFError()

    def close(self) -> None:
        pass


def test_a_command_to_a_frozen_node_returns_within_its_deadline_plus_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    node = _FrozenNode()
    t = ssh.SSHTransport(Host(name="n", address="10.0.0.1"))
    monkeypatch.setattr(t, "_live_transport", lambda: node)
    monkeypatch.setattr(t, "_abort", node.closed.set)
    monkeypatch.setattr(ssh, "RUN_GRACE_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(TransportError) as e:
        t.run("cat > f", timeout=0.5, stdin=b"x" * 1000)
    took = time.monotonic() - t0
    assert e.value.problem == "timeout" and "stopped taking data" in str(e.value)
    assert node.closed.is_set() and 1.0 <= took < 2.5, took


@pytest.mark.parametrize("through_a_jump", [False, True])
def test_ctrl_c_while_connecting_is_an_interrupt_not_an_unreachable_node(tmp_path: Path, through_a_jump: bool) -> None:
    """Ctrl-C while an sshd (or the jump host before it) has not answered yet leaves as Ctrl-C: were it said
    as "unreachable", a loop that asks again (`logs -f`, a follow) would take it for a node to wait for."""
    with socket.socket() as frozen:  # accepts, never says its banner: a loaded sshd
        frozen.bind(("127.0.0.1", 0))
        frozen.listen()
        port = frozen.getsockname()[1]
        kw = {"address": "127.0.0.1", "port": port, "connect_timeout": 20.0,
              "known_hosts": str(tmp_path / "known_hosts")}
        host = (Host(name="pc", **kw, jumps=[Host(name="gw", **kw)]) if through_a_jump
                else Host(name="pc", **kw))  # type: ignore[arg-type]
        # Python's own Ctrl-C handler, as from a terminal (a suite run in the background inherits SIGINT ignored)
        before = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        start = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                ssh.SSHTransport(host).connect()
        finally:
            timer.cancel()
            signal.signal(signal.SIGINT, before)
        assert time.monotonic() - start < 10
