"""SSH to one node through paramiko, host keys verified against the inventory's known_hosts.

NOTE: paramiko directly rather than fabric's Connection: fabric accepts unknown
host keys by default and runs each command through invoke's polling Runner;
here host-key policy, timeouts and per-host results must be ours, and the
fan-out benchmark (docs/performance.md) counts every millisecond per command.
"""
from __future__ import annotations

import io
import logging
import os
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import paramiko
from paramiko.message import Message
from paramiko.sftp import CMD_DATA, CMD_READ, CMD_STATUS, SFTPError, int64

from cluster import hostkeys
from cluster.errors import ClusterError, CommandTimeout, TransportError
from cluster.inventory import Host
from cluster.transport.base import STALL_ENV, CommandResult, Transport

KEEPALIVE_S = 15
_CHUNK = 32768  # paramiko's SFTPFile.MAX_REQUEST_SIZE: larger requests are split (or refused by old servers)
_READ_WINDOW = 64  # read requests in flight (2 MiB): one round trip per request would cap a 1 GbE link
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


class _Progress:
    """One copy: bytes moved, when the last one moved (for the stall message), the remote file it holds open."""

    def __init__(self, total: int | None, moved: str) -> None:
        self.total = total
        self.moved = moved  # "sent" | "received"
        self.done = 0
        self.last = time.monotonic()
        self.file: paramiko.SFTPFile | None = None

    def add(self, n: int) -> None:
        self.done += n
        self.last = time.monotonic()

    def describe(self) -> str:
        of = f" of {self.total}" if self.total is not None else ""
        return f"{self.done}{of} bytes {self.moved}"


class _Replies:
    """Where paramiko's reply dispatcher puts the answers to our read requests (by request number)."""

    def __init__(self) -> None:
        self.got: dict[int, tuple[int, Message]] = {}

    def _async_response(self, t: int, msg: Message, num: int) -> None:
        self.got[num] = (t, msg)


def _pipelined_reads(sftp: paramiko.SFTPClient, handle: bytes, offset: int, length: int) -> Iterator[bytes]:
    """Bytes [offset, offset+length) of an open remote file, in order, with _READ_WINDOW requests in flight.

    NOTE: paramiko's own SFTPFile.prefetch sends every request from a helper thread that a stalled link
    leaves spinning or dying with a printed traceback; here every wait is a read of the channel in the
    caller's thread, bounded by the channel's timeout. Uses paramiko's request/dispatch internals
    (_async_request, _read_response: unchanged since paramiko 1.x). Yields b"" at a premature end of file."""
    replies = _Replies()
    pending: deque[tuple[int, int, int]] = deque()  # (request number, offset, length), in file order
    end, next_off = offset + length, offset

    def ask(off: int, n: int) -> tuple[int, int, int]:
        return sftp._async_request(replies, CMD_READ, handle, int64(off), int(n)), off, n

    while pending or next_off < end:
        while len(pending) < _READ_WINDOW and next_off < end:
            n = min(_CHUNK, end - next_off)
            pending.append(ask(next_off, n))
            next_off += n
        num, off, n = pending.popleft()
        while num not in replies.got:
            sftp._read_response()  # one reply; socket.timeout after the channel's timeout of silence
        t, msg = replies.got.pop(num)
        if t == CMD_STATUS:
            try:
                sftp._convert_status(msg)
            except EOFError:
                yield b""
                return
            raise SFTPError(f"unexpected reply to a read at offset {off}")
        if t != CMD_DATA:
            raise SFTPError(f"unexpected reply type {t} to a read at offset {off}")
        data = msg.get_string()
        if not data:
            yield b""
            return
        if len(data) < n:  # a short read (allowed by the protocol): ask for the rest before anything else
            pending.appendleft(ask(off + len(data), n - len(data)))
        yield data


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

    def _live_transport(self) -> paramiko.Transport:
        """The connection's transport, reconnecting once if it died since the last call."""
        self.connect()
        assert self._client is not None
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            self._abort()
            self.connect()
            assert self._client is not None
            transport = self._client.get_transport()
            if transport is None or not transport.is_active():
                raise TransportError(f"{self.host.name}: connection lost", "check the node and the network",
                                     "unreachable")
        return transport

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult:
        timeout = timeout or self.host.command_timeout
        start = time.monotonic()
        deadline = start + timeout
        transport = self._live_transport()
        try:
            chan = transport.open_session(timeout=self.host.connect_timeout)
        except (paramiko.SSHException, OSError, EOFError) as e:
            if "Timeout" in str(e):  # sshd stopped answering: drop the connection, the next call reconnects
                self._abort()
                raise TransportError(f"{self.host.name}: sshd did not open a session within "
                                     f"{self.host.connect_timeout:g}s", "is sshd hung or the node overloaded?",
                                     "timeout") from None
            raise TransportError(f"{self.host.name}: cannot open a session: {e}", "check sshd's MaxSessions",
                                 "unreachable") from None
        try:
            # the reply to exec comes from sshd itself: silence means a hung sshd, not a slow command
            self._bounded_request(chan, lambda: chan.exec_command(command),  # bounded: a timer
                                  min(timeout, max(self.stall_timeout, self.host.connect_timeout)))
        except (socket.timeout, paramiko.SSHException, EOFError, OSError) as e:
            chan.close()
            self._abort()
            timed_out = isinstance(e, (socket.timeout, TimeoutError))
            raise TransportError(f"{self.host.name}: sshd did not start the command"
                                 f"{' in time' if timed_out else ''}: {e}",
                                 "is sshd hung or the node overloaded? (`ssh` to it by hand)",
                                 "timeout" if timed_out else "unreachable") from None
        try:
            chan.settimeout(max(deadline - time.monotonic(), 0.05))  # bounds sendall's wait for window
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
        if code == -1 and self._lost(transport):  # no exit status because the connection itself went away
            self._abort()
            raise TransportError(f"{self.host.name}: connection lost during the command (no exit status)",
                                 "check the node and the network, then run it again", "unreachable")
        return CommandResult(code, out.decode(errors="replace"), err.decode(errors="replace"),
                             time.monotonic() - start)

    @staticmethod
    def _lost(transport: paramiko.Transport, wait: float = 1.0) -> bool:
        """Did the connection die? (A command killed by a signal also ends without an exit status, on a
        connection that stays up: give the transport's thread a moment to notice a closed socket.)"""
        deadline = time.monotonic() + wait
        while transport.is_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not transport.is_active()

    @staticmethod
    def _drain(chan: paramiko.Channel, deadline: float, timeout: float) -> tuple[bytes, bytes]:
        """Read stdout until EOF (waking at once on data), stderr as it comes; honour the deadline."""
        out: list[bytes] = []
        err: list[bytes] = []
        chan.settimeout(0.05)
        while True:
            while chan.recv_stderr_ready():
                err.append(chan.recv_stderr(65536))  # bounded: data is ready
            try:
                data = chan.recv(65536)  # bounded: settimeout(0.05) above, deadline checked
            except socket.timeout:
                if time.monotonic() > deadline:
                    raise
                continue
            if not data:
                break
            out.append(data)
        chan.settimeout(max(deadline - time.monotonic(), 0.05))
        while data := chan.recv_stderr(65536):  # bounded: settimeout(deadline) above
            err.append(data)
        return b"".join(out), b"".join(err)

    def clock_sample(self) -> tuple[float, float, float]:
        # The login shell may take 100 ms+ to start (.bashrc): wait until it is ready, then time only
        # the last leg (a newline in, the date out), so the midpoint estimate stays honest.
        transport = self._live_transport()
        try:
            chan = transport.open_session(timeout=self.host.connect_timeout)
        except (paramiko.SSHException, OSError, EOFError) as e:
            self._abort()
            raise TransportError(f"{self.host.name}: clock probe: cannot open a session: {e}",
                                 "check the node and the network", "unreachable") from None
        try:
            chan.settimeout(10)  # every recv and send below waits at most 10 s
            probe = "echo ready; read _; date +%s.%N"
            self._bounded_request(chan, lambda: chan.exec_command(probe), 10)  # bounded: a timer
            buf = b""
            while b"ready\n" not in buf:
                data = chan.recv(64)  # bounded: settimeout(10)
                if not data:
                    raise TransportError(f"{self.host.name}: clock probe ended early", None, "unreachable")
                buf += data
            t0 = time.time()
            chan.sendall(b"\n")
            out = b""
            while not out.endswith(b"\n"):
                data = chan.recv(64)  # bounded: settimeout(10)
                if not data:
                    break
                out += data
            t1 = time.time()
        except (socket.timeout, TimeoutError):
            self._abort()
            raise TransportError(f"{self.host.name}: clock probe got no answer within 10s",
                                 "is sshd hung or the node overloaded?", "timeout") from None
        except (paramiko.SSHException, OSError, EOFError) as e:
            self._abort()
            raise TransportError(f"{self.host.name}: connection lost during the clock probe: {e}",
                                 "check the node and the network", "unreachable") from None
        finally:
            chan.close()
        try:
            return t0, float(out.strip()), t1
        except ValueError:
            raise TransportError(f"{self.host.name}: clock probe: `date +%s.%N` printed {out[:80]!r}",
                                 "the node needs GNU date (coreutils)", "error") from None

    # ------------------------------------------------------------------ file transfers, each bounded by a stall limit
    #
    # paramiko waits without a limit unless told: the SFTP channel gets settimeout(stall), which bounds every
    # read of a reply (socket.timeout after `stall` s of silence) and every wait for send window (a node that
    # stopped reading). A slow link keeps moving bytes, so it is never cut; a frozen one is, after `stall` s.

    def _abort(self) -> None:
        """Drop the whole connection after a stalled or broken transfer: a half-read SFTP stream cannot be
        reused, and a node that stopped answering one channel is suspect. The next call reconnects."""
        client, self._client, self._sftp = self._client, None, None
        if client is not None:
            client.close()  # closes the socket first, so nothing waits on the silent peer

    def _bounded_request(self, chan: paramiko.Channel, request: Callable[[], None], bound: float) -> None:
        """A channel request (exec, subsystem): paramiko waits for its reply without a limit, so a timer
        closes the channel after `bound` s, which wakes the wait; reported as socket.timeout."""
        fired = threading.Event()

        def fire() -> None:
            fired.set()
            try:
                chan.close()
            except Exception:  # noqa: BLE001 - a timer thread must not print a traceback
                pass

        timer = threading.Timer(bound, fire)
        timer.daemon = True
        timer.start()
        try:
            request()
        except (paramiko.SSHException, EOFError, OSError):
            if fired.is_set():
                raise socket.timeout(f"no reply within {bound:g}s") from None
            raise
        finally:
            timer.cancel()
        if fired.is_set():
            raise socket.timeout(f"no reply within {bound:g}s")

    def _sftp_client(self) -> paramiko.SFTPClient:
        if self._sftp is None or not self._sftp.sock.active:
            self._sftp = None
            transport = self._live_transport()
            try:
                chan = transport.open_session(timeout=self.stall_timeout)
            except paramiko.SSHException as e:
                if "Timeout" in str(e):
                    raise socket.timeout(str(e)) from None
                raise
            chan.settimeout(self.stall_timeout)
            self._bounded_request(chan, lambda: chan.invoke_subsystem("sftp"), self.stall_timeout)
            self._sftp = paramiko.SFTPClient(chan)  # its version exchange reads under the channel's timeout
        return self._sftp

    @contextmanager
    def _transfer(self, verb: str, path: str, total: int | None, moved: str) -> Iterator[_Progress]:
        """Turn a stall or a lost link during a copy into a TransportError naming node, file and bytes done.

        The remote file is closed here, not by a `with`: closing waits for the node's acknowledgements,
        which after a stall would cost a second stall limit; on failure the connection goes first."""
        progress = _Progress(total, moved)
        h = self.host
        try:
            yield progress
            if progress.file is not None:
                progress.file.close()  # reads the pipelined writes' acks: errors (disk full) surface here
                progress.file = None
        except (socket.timeout, TimeoutError):
            self._abort_copy(progress)
            raise TransportError(
                f"{h.name}: {verb} {path}: no progress for {time.monotonic() - progress.last:.0f}s "
                f"(stall limit {self.stall_timeout:g}s) after {progress.describe()}; copy abandoned",
                f"check that {h.address} still answers (`ping`, `ssh {h.user}@{h.address}`: a hung sshd or disk?); "
                f"then run the command again: copies resume from the bytes already verified. "
                f"A longer limit: {STALL_ENV}=<seconds>", "timeout") from None
        except (paramiko.SSHException, EOFError) as e:
            self._abort_copy(progress)
            raise TransportError(f"{h.name}: {verb} {path}: connection lost after {progress.describe()}: {e}",
                                 "check the node and the network, then run the command again (copies resume)",
                                 "unreachable") from None
        except OSError as e:
            if e.errno is not None:  # the node's answer about the file (no such file, permission denied)
                self._close_quietly(progress)
                raise
            self._abort_copy(progress)  # "Socket is closed" and friends: the channel died under us
            raise TransportError(f"{h.name}: {verb} {path}: connection lost after {progress.describe()}: {e}",
                                 "check the node and the network, then run the command again (copies resume)",
                                 "unreachable") from None
        except BaseException:
            self._close_quietly(progress)
            raise

    def _abort_copy(self, progress: _Progress) -> None:
        self._abort()
        self._close_quietly(progress)

    @staticmethod
    def _close_quietly(progress: _Progress) -> None:
        """Close the remote file without waiting for acknowledgements (none will come on a dead channel),
        so neither we nor paramiko's finaliser (SFTPFile.__del__) waits or prints a traceback."""
        f, progress.file = progress.file, None
        if f is not None:
            f.set_pipelined(False)
            try:
                f.close()
            except Exception:  # noqa: BLE001 - the copy already failed; that error is the one to report
                pass

    def _write(self, src: BinaryIO, remote_path: str, offset: int, total: int, mode: int, verb: str) -> None:
        with self._transfer(verb, remote_path, total, "sent") as progress:
            progress.add(offset)
            sftp = self._sftp_client()
            f = progress.file = sftp.open(remote_path, "r+b" if offset else "wb")
            f.set_pipelined(True)  # writes go out back to back; their acks are read at close
            if offset:
                f.seek(offset)
            while chunk := src.read(_CHUNK):
                f.write(chunk)
                progress.add(len(chunk))
        with self._transfer("setting the mode of", remote_path, None, "sent"):
            self._sftp_client().chmod(remote_path, mode)

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o644) -> None:
        self._write(io.BytesIO(data), remote_path, 0, len(data), mode, "copying to")

    def put_file(self, local: Path, remote_path: str, mode: int = 0o644) -> None:
        with open(local, "rb") as src:
            self._write(src, remote_path, 0, os.fstat(src.fileno()).st_size, mode, f"copying {local} to")

    def put_tail(self, local: Path, remote_path: str, offset: int, mode: int = 0o644) -> None:
        with open(local, "rb") as src:
            src.seek(offset)
            self._write(src, remote_path, offset, os.fstat(src.fileno()).st_size, mode,
                        f"resuming the copy of {local} to")

    def get_bytes(self, remote_path: str) -> bytes:
        out = bytearray()
        with self._transfer("copying from", remote_path, None, "received") as progress:
            f = progress.file = self._sftp_client().open(remote_path, "rb")
            while chunk := f.read(_CHUNK):
                out += chunk
                progress.add(len(chunk))
        return bytes(out)

    def get_range(self, remote_path: str, offset: int, length: int, sink: Callable[[bytes], None]) -> None:
        with self._transfer("copying from", remote_path, offset + length, "received") as progress:
            progress.add(offset)
            sftp = self._sftp_client()
            f = progress.file = sftp.open(remote_path, "rb")
            for chunk in _pipelined_reads(sftp, f.handle, offset, length):
                if not chunk:
                    raise ClusterError(
                        f"{self.host.name}: {remote_path} ended after {progress.done} bytes, "
                        f"{offset + length} expected", "the file shrank on the node; run the command again")
                sink(chunk)
                progress.add(len(chunk))

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        if self._client is not None:
            self._client.close()
            self._client = None
