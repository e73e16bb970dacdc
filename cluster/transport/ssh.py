"""SSH to one node through paramiko, host keys verified against the inventory's known_hosts: commands here,
the connection in cluster.transport.ssh_connection, file copies in cluster.transport.sftp.

NOTE: paramiko directly rather than fabric's Connection: fabric accepts unknown
host keys by default and runs each command through invoke's polling Runner;
here host-key policy, timeouts and per-host results must be ours, and the
fan-out benchmark (docs/performance.md) counts every millisecond per command.
"""
from __future__ import annotations

import socket
import time

import paramiko

from cluster.errors import CommandTimeout, TransportError
from cluster.transport.base import CommandResult
from cluster.transport.sftp import SFTPCopies
from cluster.transport.ssh_connection import KEEPALIVE_S

__all__ = ["KEEPALIVE_S", "SSHTransport"]


class SSHTransport(SFTPCopies):
    """A node over SSH: commands with bounded waits, the node's clock, and (inherited) connection and copies."""

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

