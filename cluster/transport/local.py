"""Nodes on this machine, reached without SSH (inventory/local.yaml, tests, CPU-only demos)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from cluster.errors import CommandTimeout
from cluster.transport.base import CommandResult, Transport


class LocalTransport(Transport):
    def connect(self) -> None:
        Path(self.host.workdir).mkdir(parents=True, exist_ok=True)

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult:
        timeout = timeout or self.host.command_timeout
        start = time.monotonic()
        # Own session so a timeout can end the whole process group, as SSHTransport does on the node (its
        # kill after a timeout; sshd makes each command a session leader too). A process that left the group
        # (setsid: the node agent's `start`) is spared in both. No node-side bound here: the head is the node.
        proc = subprocess.Popen(  # bounded: communicate(timeout) below
            ["/bin/sh", "-c", command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=os.path.expanduser("~"),
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(stdin or b"", timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # ended just now: nothing left to kill
                pass
            try:  # a daemon that left the group may still hold our pipes open: do not wait for it
                proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise CommandTimeout(f"{self.host.name}: command still running after {timeout:g}s") from None
        return CommandResult(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"),
                             time.monotonic() - start)

    def _path(self, remote_path: str) -> Path:
        p = Path(os.path.expanduser(remote_path))
        return p if p.is_absolute() else Path(os.path.expanduser("~")) / p

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o644) -> None:
        p = self._path(remote_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        p.chmod(mode)

    def put_file(self, local: Path, remote_path: str, mode: int = 0o644) -> None:
        p = self._path(remote_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, p)
        p.chmod(mode)

    def put_tail(self, local: Path, remote_path: str, offset: int, mode: int = 0o644) -> None:
        p = self._path(remote_path)
        with open(local, "rb") as src, open(p, "r+b") as dst:
            src.seek(offset)
            dst.seek(offset)
            shutil.copyfileobj(src, dst, 1 << 20)
            dst.truncate()
        p.chmod(mode)

    def get_bytes(self, remote_path: str) -> bytes:
        return self._path(remote_path).read_bytes()
