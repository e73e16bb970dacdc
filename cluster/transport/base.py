"""The runner core every transport implements: run a shell command, move bytes."""
from __future__ import annotations

import hashlib
import os
import shlex
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cluster.errors import UsageError
from cluster.inventory.model import Host

# A copy that moves no byte for this long is abandoned (docs/reliability.md, "Every wait has a bound").
# Stall, not total time: a 2 GB dataset over a slow link may take an hour and is never cut.
STALL_TIMEOUT_S = 30.0
STALL_ENV = "CLUSTERCTL_TRANSFER_STALL_S"


def stall_timeout(host: Host) -> float:
    """The host's `transfer_stall_timeout` if the inventory has one, else $CLUSTERCTL_TRANSFER_STALL_S, else 30 s."""
    own = getattr(host, "transfer_stall_timeout", None)
    if own:
        return float(own)
    raw = os.environ.get(STALL_ENV)
    if raw is None or not raw.strip():
        return STALL_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise UsageError(f"environment variable {STALL_ENV}={raw!r}: expected a positive number of seconds",
                         f"e.g. export {STALL_ENV}=60, or unset it for the default {STALL_TIMEOUT_S:g}")
    return value


def _sha256_prefix(path: Path, n: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = n
        while left > 0:
            chunk = f.read(min(1 << 20, left))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str
    duration: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Transport(ABC):
    """One node. Connects lazily on first use and keeps the connection for the invocation.

    `run` raises TransportError when the node cannot be reached and CommandTimeout
    when the command outlives its timeout; a non-zero exit is data, not an error.
    """

    def __init__(self, host: Host) -> None:
        self.host = host
        self.stall_timeout = stall_timeout(host)

    @abstractmethod
    def connect(self) -> None: ...

    @abstractmethod
    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult: ...

    @abstractmethod
    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o644) -> None: ...

    @abstractmethod
    def get_bytes(self, remote_path: str) -> bytes: ...

    def put_file(self, local: Path, remote_path: str, mode: int = 0o644) -> None:
        """Copy a (possibly large) file; transports stream it."""
        self.put_bytes(local.read_bytes(), remote_path, mode)

    def put_tail(self, local: Path, remote_path: str, offset: int, mode: int = 0o644) -> None:
        """Write local[offset:] into the existing remote file at `offset` (its first bytes stay)."""
        data = local.read_bytes()
        head = self.get_bytes(remote_path)[:offset]
        self.put_bytes(head + data[offset:], remote_path, mode)

    def send_file(self, local: Path, remote_path: str, mode: int = 0o644) -> int:
        """put_file that resumes: a remote file that is a verified prefix of `local` (a copy cut short by a
        stall or a lost link) gets only the missing tail. Returns the bytes sent."""
        size = local.stat().st_size
        q = shlex.quote(remote_path)
        r = self.run(f"s=$(stat -c %s -- {q} 2>/dev/null) || exit 0; echo \"$s\"; "
                     f"head -c \"$s\" -- {q} | sha256sum", timeout=max(600.0, self.host.command_timeout))
        words = r.stdout.split()
        have = int(words[0]) if r.exit_code == 0 and len(words) >= 2 and words[0].isdigit() else 0
        if 0 < have <= size and words[1] == _sha256_prefix(local, have):
            if have < size:
                self.put_tail(local, remote_path, have, mode)
            else:  # complete already (the copy was cut after its last byte, before its mode was set)
                self.run(f"chmod {mode:o} -- {q}", timeout=60)
            return size - have
        self.put_file(local, remote_path, mode)
        return size

    def get_range(self, remote_path: str, offset: int, length: int, sink: Callable[[bytes], None]) -> None:
        """Bytes [offset, offset+length) of a remote file, handed to `sink` in chunks (transports stream)."""
        sink(self.get_bytes(remote_path)[offset:offset + length])

    @property
    def peer_address(self) -> str | None:
        """The IP address actually used to reach the node (None for local nodes)."""
        return None

    def clock_sample(self) -> tuple[float, float, float]:
        """(head time before, node time, head time after) around one reading of the node's clock."""
        t0 = time.time()
        r = self.run("date +%s.%N", timeout=10)
        return t0, float(r.stdout.strip()), time.time()

    def close(self) -> None:  # noqa: B027 - optional for transports without state
        pass

    def in_workdir(self, command: str) -> str:
        """`command` run from the node's workdir, created if missing (path quoted)."""
        wd = shlex.quote(self.host.workdir)
        return f"mkdir -p -- {wd} && cd -- {wd} && {command}"

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
