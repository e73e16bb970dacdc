"""The lab's processes as /proc shows them: alive or not, a process's tree, those marked as a lab's, and
ending them in bounded time (a lab's daemons and sshd run detached from whoever started them)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether `pid` runs: a process that died but is not reaped yet (a zombie) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill(pids: list[int], signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGKILL), timeout: float = 3.0) -> None:
    """Each of `signals` in turn to what is left, `timeout` apart; returns once all are gone (bounded)."""
    for sig in signals:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.05)
        if not any(alive(p) for p in pids):
            return


def marked(entry: str) -> list[int]:
    """Processes whose environment holds `entry` (NAME=value: a lab's mark), wherever they run."""
    want = entry.encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env:
            pids.append(int(name))
    return pids


def tree(root: int) -> set[int]:
    """`root` and all its descendants (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return seen
