"""SSH to one node through paramiko, host keys verified against the inventory's known_hosts.

NOTE: paramiko directly rather than fabric's Connection: fabric accepts unknown
host keys by default and runs each command through invoke's polling Runner;
here host-key policy, timeouts and per-host results must be ours, and the
fan-out benchmark (docs/performance.md) counts every millisecond per command.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import paramiko

from cluster import hostkeys
from cluster.errors import CommandTimeout, TransportError
from cluster.inventory import Host
from cluster.transport.base import CommandResult, Transport

KEEPALIVE_S = 15
# paramiko logs failed handshakes from its own threads; we report them as results instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
_keys: dict[Path, paramiko.PKey] = {}
_keys_lock = threading.Lock()


def _load_key(path: Path) -> paramiko.PKey:
    """Parse each identity file once per process, not once per node."""
    with _keys_lock:
        if path not in _keys:
            try:
                _keys[path] = paramiko.PKey.from_path(path)
            except paramiko.PasswordRequiredException:
                raise TransportError(f"identity file {path} is protected by a passphrase",
                                     "load it into ssh-agent (`ssh-add`) and leave identity_file unset",
                                     "auth") from None
            except (OSError, paramiko.SSHException, ValueError) as e:
                raise TransportError(f"cannot load identity file {path}: {e}",
                                     "point identity_file at an OpenSSH private key", "auth") from None
        return _keys[path]


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    def __init__(self, transport: SSHTransport) -> None:
        self.transport = transport

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise hostkeys.unknown_key_error(self.transport.host, key)


def _connect_error(h: Host, e: BaseException, elapsed: float) -> BaseException:
    """paramiko's and the socket layer's failures, as errors that say what to do."""
    if isinstance(e, TransportError):  # from our host-key policy
        return e
    if isinstance(e, paramiko.BadHostKeyException):
        return hostkeys.changed_key_error(h, e.key, e.expected_key)
    if isinstance(e, paramiko.AuthenticationException):
        return TransportError(f"{h.name}: {h.user}@{h.address} refused our key: {e}",
                              f"copy your public key to the node: `ssh-copy-id -p {h.port} {h.user}@{h.address}`",
                              "auth")
    if isinstance(e, ConnectionRefusedError):
        return TransportError(f"{h.name}: {h.address}:{h.port} refused the connection",
                              "is sshd running on the node? (`systemctl status ssh` there)", "refused")
    if isinstance(e, (paramiko.SSHException, EOFError)) and elapsed >= 0.9 * h.connect_timeout:
        # The TCP connection opened but the handshake never finished (paramiko reports this as
        # "Error reading SSH protocol banner" or "No existing session", depending on timing).
        return TransportError(f"{h.name}: {h.address}:{h.port} accepted the connection but sent no SSH banner "
                              f"within {h.connect_timeout:g}s", "is sshd overloaded or hung on the node?", "timeout")
    if isinstance(e, (socket.timeout, TimeoutError)):
        return TransportError(f"{h.name}: no answer from {h.address}:{h.port} within {h.connect_timeout:g}s",
                              "is the PC on and on the lab network? (`ping` it from the head)", "timeout")
    if isinstance(e, (OSError, paramiko.SSHException, EOFError)):
        return TransportError(f"{h.name}: cannot connect to {h.address}:{h.port}: {e}",
                              "is the PC on the lab network and sshd running? (`ping` it, `systemctl status ssh`)",
                              "unreachable")
    return e


class SSHTransport(Transport):
    _client: paramiko.SSHClient | None = None
    _sftp: paramiko.SFTPClient | None = None

    def connect(self) -> None:
        if self._client is not None:
            return
        h = self.host
        client = paramiko.SSHClient()
        client.get_host_keys().update(hostkeys.known_hosts(h.known_hosts_path))
        client.set_missing_host_key_policy(_RejectUnknown(self))
        key = _load_key(h.key_path) if h.key_path else None
        start = time.monotonic()
        try:
            sock = socket.create_connection((h.address, h.port), timeout=h.connect_timeout)
            # NOTE: without TCP_NODELAY every channel open waits out Nagle + delayed ACK (~40 ms):
            # measured 48 ms -> 3 ms per command on the simulated lab.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.connect(
                hostname=h.address, port=h.port, username=h.user, pkey=key, sock=sock,
                timeout=h.connect_timeout, banner_timeout=h.connect_timeout, auth_timeout=h.connect_timeout,
                look_for_keys=key is None, allow_agent=key is None,
            )
        except BaseException as e:
            client.close()
            raise _connect_error(h, e, time.monotonic() - start) from None
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(KEEPALIVE_S)
        self._client = client

    @property
    def peer_address(self) -> str | None:
        t = self._client.get_transport() if self._client else None
        return t.getpeername()[0] if t else None

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult:
        self.connect()
        assert self._client is not None
        timeout = timeout or self.host.command_timeout
        start = time.monotonic()
        deadline = start + timeout
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            raise TransportError(f"{self.host.name}: connection lost", "check the node and the network", "unreachable")
        try:
            chan = transport.open_session(timeout=self.host.connect_timeout)
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise TransportError(f"{self.host.name}: cannot open a session: {e}", "check sshd's MaxSessions",
                                 "unreachable") from None
        try:
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            out, err = self._drain(chan, deadline, timeout)
            code = chan.recv_exit_status() if chan.status_event.wait(max(deadline - time.monotonic(), 0.1)) else -1
        except (socket.timeout, TimeoutError):
            raise CommandTimeout(f"{self.host.name}: command still running after {timeout:g}s") from None
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise TransportError(f"{self.host.name}: connection lost during the command: {e}",
                                 "check the node and the network", "unreachable") from None
        finally:
            chan.close()
        return CommandResult(code, out.decode(errors="replace"), err.decode(errors="replace"),
                             time.monotonic() - start)

    @staticmethod
    def _drain(chan: paramiko.Channel, deadline: float, timeout: float) -> tuple[bytes, bytes]:
        """Read stdout until EOF (waking at once on data), stderr as it comes; honour the deadline."""
        out: list[bytes] = []
        err: list[bytes] = []
        chan.settimeout(0.05)
        while True:
            while chan.recv_stderr_ready():
                err.append(chan.recv_stderr(65536))
            try:
                data = chan.recv(65536)
            except socket.timeout:
                if time.monotonic() > deadline:
                    raise
                continue
            if not data:
                break
            out.append(data)
        chan.settimeout(max(deadline - time.monotonic(), 0.05))
        while data := chan.recv_stderr(65536):
            err.append(data)
        return b"".join(out), b"".join(err)

    def clock_sample(self) -> tuple[float, float, float]:
        # The login shell may take 100 ms+ to start (.bashrc): wait until it is ready, then time only
        # the last leg (a newline in, the date out), so the midpoint estimate stays honest.
        self.connect()
        assert self._client is not None
        transport = self._client.get_transport()
        assert transport is not None
        chan = transport.open_session(timeout=self.host.connect_timeout)
        try:
            chan.settimeout(10)
            chan.exec_command("echo ready; read _; date +%s.%N")
            buf = b""
            while b"ready\n" not in buf:
                data = chan.recv(64)
                if not data:
                    raise TransportError(f"{self.host.name}: clock probe ended early", None, "unreachable")
                buf += data
            t0 = time.time()
            chan.sendall(b"\n")
            out = b""
            while not out.endswith(b"\n"):
                data = chan.recv(64)
                if not data:
                    break
                out += data
            t1 = time.time()
        finally:
            chan.close()
        return t0, float(out.strip()), t1

    def _sftp_client(self) -> paramiko.SFTPClient:
        self.connect()
        assert self._client is not None
        if self._sftp is None:
            self._sftp = self._client.open_sftp()
        return self._sftp

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o644) -> None:
        sftp = self._sftp_client()
        with sftp.open(remote_path, "wb") as f:
            f.write(data)
        sftp.chmod(remote_path, mode)

    def put_file(self, local: Path, remote_path: str, mode: int = 0o644) -> None:
        sftp = self._sftp_client()
        sftp.put(str(local), remote_path)
        sftp.chmod(remote_path, mode)

    def get_bytes(self, remote_path: str) -> bytes:
        with self._sftp_client().open(remote_path, "rb") as f:
            return f.read()

    def get_range(self, remote_path: str, offset: int, length: int, sink: Callable[[bytes], None]) -> None:
        with self._sftp_client().open(remote_path, "rb") as f:
            f.seek(offset)
            f.prefetch(offset + length)  # pipelined reads: one round trip would cap a 1 GbE link
            left = length
            while left > 0:
                chunk = f.read(min(1 << 20, left))
                if not chunk:
                    raise TransportError(f"{self.host.name}: {remote_path} is shorter than expected")
                sink(chunk)
                left -= len(chunk)

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        if self._client is not None:
            self._client.close()
            self._client = None
