"""SSH to one node through paramiko, host keys verified against the inventory's known_hosts: commands here,
the connection in cluster.transport.ssh_connection, file copies in cluster.transport.sftp.

NOTE: paramiko directly rather than fabric's Connection: fabric accepts unknown
host keys by default and runs each command through invoke's polling Runner;
here host-key policy, timeouts and per-host results must be ours, and the
fan-out benchmark (docs/performance.md, "Fan-out") counts every millisecond per command.

A command's timeout is kept on the node too (`bounded_command`): sshd without a pty does not signal a
command whose channel closed, so a command the head gave up on would otherwise run on, and with a cut link
the head cannot reach the node to stop it.
"""
from __future__ import annotations

import math
import re
import secrets
import shlex
import socket
import time

import paramiko

from cluster.errors import CommandTimeout, TransportError
from cluster.transport.base import CommandResult
from cluster.transport.sftp import SFTPCopies
from cluster.transport.ssh_connection import KEEPALIVE_S

__all__ = ["KEEPALIVE_S", "SSHTransport", "bounded_command", "group_kill_command", "node_bound", "split_marker"]

PGID_MARKER = "clusterctl-pgid"  # the wrapper's first line on stderr: "clusterctl-pgid:<token>:<pgid>"
TOKEN_ENV = "CLUSTERCTL_CMD_TOKEN"  # in the environment of the command's process group, for the head's kill
NODE_MARGIN_S = 5  # the node's bound is the head's timeout plus this: the head's verdict (and kill) come first
KILL_AFTER_S = 5  # SIGTERM at the node's bound, SIGKILL this long after if the group is still there
KILL_BOUND_S = 5.0  # the head's kill after a timeout: at most min(this, connect_timeout)
RUN_GRACE_S = 3.0  # past the command's deadline the watchdog closes the connection (a write that never returns)


def node_bound(timeout: float, margin: float = NODE_MARGIN_S) -> int:
    """Whole seconds the node lets a command with the head's `timeout` run (the node's clock starts later)."""
    return math.ceil(timeout + margin)


def bounded_command(command: str, timeout: float, token: str, margin: float = NODE_MARGIN_S,
                    kill_after: float = KILL_AFTER_S) -> str:
    """`command` run by the login shell under GNU `timeout` on the node, which signals the command's whole
    process group at the node's bound; first it reports its process group on stderr (see split_marker).

    sshd starts each command as a session leader, so `$$` is the group's id, and `exec timeout` keeps it
    (timeout's own setpgid is then a no-op): a process that leaves the group (`setsid`, the node agent's
    `start`) is not signalled. Stdin passes through, exit codes are the command's (a signal re-raised).
    NOTE: without `timeout` on the node (not coreutils) the command runs unbounded there, as before: the
    head's kill after a timeout still reaches it while the node answers."""
    q = shlex.quote
    shell = '"${SHELL:-/bin/sh}"'  # the user's login shell, as sshd would have run `command`
    return (f"{TOKEN_ENV}={q(token)}; export {TOKEN_ENV}; echo {q(f'{PGID_MARKER}:{token}:')}\"$$\" >&2; "
            f"set --; if command -v timeout >/dev/null 2>&1; then "
            f"set -- timeout -k {q(f'{kill_after:g}')} {q(str(node_bound(timeout, margin)))}; fi; "
            f"exec \"$@\" {shell} -c {q(command)}")


def split_marker(err: bytes, token: str) -> tuple[int | None, bytes]:
    """The process group the wrapper reported and stderr without that line (anything a login script printed
    before it stays). A line without this call's token is the command's own and stays too."""
    m = re.search(rb"(?:^|\n)(" + re.escape(f"{PGID_MARKER}:{token}:".encode()) + rb"(\d+)\n)", err)
    if m is None:
        return None, err
    return int(m.group(2)), err[:m.start(1)] + err[m.end(1):]


def group_kill_command(pgid: int, token: str) -> str:
    """SIGKILL to process group `pgid` if one of its members carries `token` in its environment (exit 0),
    else nothing (exit 1): a number reused by a stranger is never signalled.

    NOTE: any member, not only the leader: `timeout` may have exited with its command while a background
    child still holds the channel open. A live member keeps the group's number from being reused."""
    q = shlex.quote
    return (f"pg={q(str(pgid))}; want={q(f'{TOKEN_ENV}={token}')}; for d in /proc/[0-9]*; do "
            '{ read -r s < "$d/stat"; } 2>/dev/null || continue; set -- ${s##*) }; '
            '[ "$3" = "$pg" ] || continue; '
            'if tr "\\000" "\\n" < "$d/environ" 2>/dev/null | grep -qxF -e "$want"; then '
            'kill -s KILL -- "-$pg"; exit 0; fi; done; exit 1')


class SSHTransport(SFTPCopies):
    """A node over SSH: commands with bounded waits, the node's clock, and (inherited) connection and copies."""

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult:
        timeout = timeout or self.host.command_timeout
        start = time.monotonic()
        token = secrets.token_hex(8)
        err: list[bytes] = []  # stderr as it came: on a timeout, the wrapper's marker names the group to kill
        # NOTE: the whole command (session, exec, stdin, output, close) runs under the watchdog: each of its
        # sends may block in paramiko's unbounded Packetizer.write_all on a frozen node
        limit = [start + timeout + RUN_GRACE_S]  # when the watchdog closes the connection; moved for the kill
        with self._watchdog(lambda: limit[0] - time.monotonic(), f"command watchdog {self.host.name}") as fired:
            try:
                code, out = self._command(bounded_command(command, timeout, token), start, timeout, stdin, err)
            except (CommandTimeout, TransportError) as e:
                if fired.is_set():  # whatever paramiko raised once the watchdog closed the socket under it
                    raise TransportError(
                        f"{self.host.name}: the node stopped taking data: the command had not ended "
                        f"{timeout + RUN_GRACE_S:g}s after it started; connection closed",
                        "is the node frozen? (`ping` it, `ssh` to it by hand)", "timeout") from None
                pgid, _ = split_marker(b"".join(err), token)
                if isinstance(e, CommandTimeout) and pgid is not None:
                    bound = min(self.host.connect_timeout, KILL_BOUND_S)
                    limit[0] = time.monotonic() + bound + RUN_GRACE_S
                    self._kill_group(pgid, token, bound)
                raise
        _, stderr = split_marker(b"".join(err), token)
        return CommandResult(code, out.decode(errors="replace"), stderr.decode(errors="replace"),
                             time.monotonic() - start)

    def _command(self, command: str, start: float, timeout: float, stdin: bytes | None,
                 err: list[bytes]) -> tuple[int, bytes]:
        """One command on a channel of its own: (exit code, stdout); stderr goes into `err` as it comes."""
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
            self._close_channel(chan)
            self._abort()
            timed_out = isinstance(e, (socket.timeout, TimeoutError))
            raise TransportError(f"{self.host.name}: sshd did not start the command"
                                 f"{' in time' if timed_out else ''}: {e}",
                                 "is sshd hung or the node overloaded? (`ssh` to it by hand)",
                                 "timeout" if timed_out else "unreachable") from None
        try:
            chan.settimeout(max(deadline - time.monotonic(), 0.05))  # bounds sendall's wait for window
            if stdin:
                chan.sendall(stdin)  # bounded: the window by settimeout, a blocked socket by the watchdog
            chan.shutdown_write()
            out = self._drain(chan, deadline, err)
            code = chan.recv_exit_status() if chan.status_event.wait(max(deadline - time.monotonic(), 0.1)) else -1
        except (socket.timeout, TimeoutError):
            raise CommandTimeout(f"{self.host.name}: command still running after {timeout:g}s") from None
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise TransportError(f"{self.host.name}: connection lost during the command: {e}",
                                 "check the node and the network", "unreachable") from None
        finally:
            self._close_channel(chan)
        if code == -1 and self._lost(transport):  # no exit status because the connection itself went away
            self._abort()
            raise TransportError(f"{self.host.name}: connection lost during the command (no exit status)",
                                 "check the node and the network, then run it again", "unreachable")
        return code, out

    def _kill_group(self, pgid: int, token: str, bound: float) -> bool:
        """After a timeout, SIGKILL to the command's process group on the node, if the node still answers
        within `bound` s (the node's own bound ends it otherwise). Best effort: True if it was killed."""
        end = time.monotonic() + bound
        client = self._client
        transport = client.get_transport() if client is not None else None
        if transport is None or not transport.is_active():
            return False
        try:
            chan = transport.open_session(timeout=bound)
        except (paramiko.SSHException, OSError, EOFError) as e:
            if "Timeout" in str(e):  # the node stopped answering (a cut link): the next call reconnects
                self._abort()
            return False
        try:
            kill = group_kill_command(pgid, token)
            self._bounded_request(chan, lambda: chan.exec_command(kill),  # bounded: a timer
                                  max(end - time.monotonic(), 0.1))
            return chan.status_event.wait(max(end - time.monotonic(), 0.05)) and chan.recv_exit_status() == 0
        except (socket.timeout, paramiko.SSHException, OSError, EOFError):
            self._abort()
            return False
        finally:
            self._close_channel(chan)

    @staticmethod
    def _close_channel(chan: paramiko.Channel) -> None:
        """Close without letting a failed send replace the error being reported (the watchdog may have closed
        the socket under it)."""
        try:
            chan.close()
        except Exception:  # noqa: BLE001 - the command's own outcome is the one to report
            pass

    @staticmethod
    def _lost(transport: paramiko.Transport, wait: float = 1.0) -> bool:
        """Did the connection die? (A command killed by a signal also ends without an exit status, on a
        connection that stays up: give the transport's thread a moment to notice a closed socket.)"""
        deadline = time.monotonic() + wait
        while transport.is_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not transport.is_active()

    @staticmethod
    def _drain(chan: paramiko.Channel, deadline: float, err: list[bytes]) -> bytes:
        """Read stdout until EOF (waking at once on data), stderr into `err` as it comes; honour the deadline."""
        out: list[bytes] = []
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
        return b"".join(out)

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

