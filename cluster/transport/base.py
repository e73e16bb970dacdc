"""The runner core every transport implements: run a shell command, move bytes."""
from __future__ import annotations

import shlex
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cluster.inventory import Host


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
