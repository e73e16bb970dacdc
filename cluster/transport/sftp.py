"""File copies over SFTP, each bounded by a stall limit, with pipelined reads and writes.

paramiko waits without a limit unless told: the SFTP channel gets settimeout(stall), which bounds every
read of a reply (socket.timeout after `stall` s of silence) and every wait for send window (a node that
stopped reading). One wait it cannot bound: a write the kernel will not take (paramiko's Packetizer.write_all
retries a full socket buffer forever), which a frozen node causes when TCP's buffers are smaller than the
SSH window left. So each copy also has a watchdog that closes the connection under it once nothing moved
for the stall limit plus a grace (`_silent_limit`). A slow link keeps moving bytes, so it is never cut; a
frozen one is, after `stall` s (the watchdog: at most twice that).
"""
from __future__ import annotations

import io
import os
import socket
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Protocol, cast

import paramiko
from paramiko.message import Message
from paramiko.sftp import CMD_DATA, CMD_READ, CMD_STATUS, SFTPError, int64

from cluster.errors import ClusterError, TransportError
from cluster.transport.base import STALL_ENV
from cluster.transport.ssh_connection import SSHConnection

_CHUNK = 32768  # paramiko's SFTPFile.MAX_REQUEST_SIZE: larger requests are split (or refused by old servers)
_READ_WINDOW = 64  # read requests in flight (2 MiB): one round trip per request would cap a 1 GbE link


class _SFTPInternals(Protocol):
    """The request/dispatch internals of paramiko's SFTPClient that _pipelined_reads uses (not in its stubs)."""

    def _async_request(self, fileobj: object, t: int, *args: object) -> int: ...

    def _read_response(self, waitfor: int | None = None) -> None: ...

    def _convert_status(self, msg: Message) -> None: ...


def _silent_limit(stall: float) -> float:
    """Seconds without progress after which a copy's watchdog closes its connection: the stall limit, then as
    long again (at least 1 s) for paramiko's own timeout to speak first and for the last window's bytes, sent
    but not yet acknowledged, to drain at the end of a copy on a slow link."""
    return stall + max(stall, 1.0)


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


def _pipelined_reads(client: paramiko.SFTPClient, handle: bytes, offset: int, length: int) -> Iterator[bytes]:
    """Bytes [offset, offset+length) of an open remote file, in order, with _READ_WINDOW requests in flight.

    NOTE: paramiko's own SFTPFile.prefetch sends every request from a helper thread that a stalled link
    leaves spinning or dying with a printed traceback; here every wait is a read of the channel in the
    caller's thread, bounded by the channel's timeout. Uses paramiko's request/dispatch internals
    (_async_request, _read_response: unchanged since paramiko 1.x). Yields b"" at a premature end of file."""
    sftp = cast(_SFTPInternals, client)
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


class SFTPCopies(SSHConnection):
    """put_* and get_* over one SFTP session per connection; a failed copy names node, file and bytes done."""

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
        silent = _silent_limit(self.stall_timeout)

        def left() -> float:  # seconds until the watchdog closes the connection
            return silent - (time.monotonic() - progress.last)

        with self._watchdog(left, f"stall watchdog {h.name}") as fired:
            try:
                yield progress
                if progress.file is not None:
                    progress.file.close()  # reads the pipelined writes' acks: errors (disk full) surface here
                    progress.file = None
            except (socket.timeout, TimeoutError):
                raise self._stalled(verb, path, progress) from None
            except (paramiko.SSHException, EOFError, OSError) as e:
                if fired.is_set():  # the watchdog closed the connection: a stall, whatever paramiko raised
                    raise self._stalled(verb, path, progress) from None
                if isinstance(e, OSError) and e.errno is not None:
                    self._close_quietly(progress)  # the node's answer about the file (no such file, permission)
                    raise
                self._abort_copy(progress)  # "Socket is closed" and friends: the channel died under us
                raise TransportError(f"{h.name}: {verb} {path}: connection lost after {progress.describe()}: {e}",
                                     "check the node and the network, then run the command again (copies resume)",
                                     "unreachable") from None
            except BaseException:
                self._close_quietly(progress)
                raise

    def _stalled(self, verb: str, path: str, progress: _Progress) -> TransportError:
        """A copy that stopped moving: the connection goes (abort), the error says how long and what moved."""
        h = self.host
        self._abort_copy(progress)
        return TransportError(
            f"{h.name}: {verb} {path}: no progress for {time.monotonic() - progress.last:.0f}s "
            f"(stall limit {self.stall_timeout:g}s) after {progress.describe()}; copy abandoned",
            f"check that {h.address} still answers (`ping`, `ssh {h.user}@{h.address}`: a hung sshd or disk?); "
            f"then run the command again: copies resume from the bytes already verified. "
            f"A longer limit: {STALL_ENV}=<seconds>", "timeout")

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
            handle = cast(bytes, f.handle)  # the stubs say SFTPHandle (the server side's); a client's is bytes
            for chunk in _pipelined_reads(sftp, handle, offset, length):
                if not chunk:
                    raise ClusterError(
                        f"{self.host.name}: {remote_path} ended after {progress.done} bytes, "
                        f"{offset + length} expected", "the file shrank on the node; run the command again")
                sink(chunk)
                progress.add(len(chunk))
