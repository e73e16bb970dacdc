"""Progress per byte of a distribution (cluster/relay/distribute.py): how much of its files each node holds, while they move.

Why polled: a node receives either from a peer (relaynode.py's fetch, which writes only verified pieces into
`.NAME.part`) or from the head (SFTP into the same `.NAME.part`); in both cases the size of that file is the
node's counter, so one `stat` per node and second tells the head how far every node is, whoever sends.
The poll is one short command over a second SSH connection of its own: a poll that is slow or fails must
never touch the connection that carries the node's files (a transport drops its connection when sshd does
not answer in time, and with it a copy in flight). A poll that fails only stops the polling of that node;
its distribution goes on and reports by itself.
"""
from __future__ import annotations

import shlex
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable

from cluster.errors import ClusterError
from cluster.relay.routes import Item, parse_sizes
from cluster.transport import Transport

POLL_S = 1.0  # a poll costs a shell and a stat on the node: ~8 commands a second for a room of 8


@dataclass(frozen=True)
class NodeProgress:
    """One node's distribution at one moment: what provision's progress line shows."""

    node: str
    total: int  # bytes it receives this run
    have: int  # of those, on the node now (pieces from peers are verified; the head's copy when whole)
    files_done: int
    files: int
    source: str  # where its current files come from: "head", a peer's name, or "" between batches
    state: str  # waiting | receiving | done | failed

    def line(self) -> str:
        frm = f" from {self.source}" if self.source and self.state == "receiving" else ""
        return (f"{self.have / 2**20:.0f}/{self.total / 2**20:.0f} MiB{frm} "
                f"({self.files_done}/{self.files} files, {self.state})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ProgressFn = Callable[[str, int], None]  # (node, bytes newly on it): what provision's on_bytes takes
StatusFn = Callable[[NodeProgress], None]


@dataclass
class _Node:
    total: int
    files: int
    done: int = 0  # bytes of finished batches
    files_done: int = 0
    reported: int = 0  # the `have` last reported (never goes back)
    batch: tuple[Item, ...] = ()
    source: str = ""
    state: str = "waiting"


class Tracker:
    """Counters of a run's nodes: the run marks batches begun and done, a thread polls the rest."""

    def __init__(self, connect: Callable[[str], Transport], dest: dict[str, str],
                 totals: dict[str, tuple[int, int]], progress: ProgressFn | None = None,
                 status: StatusFn | None = None, interval: float = POLL_S) -> None:
        self.connect, self.dest, self.interval = connect, dest, interval
        self.transports: dict[str, Transport] = {}  # the poll's own, made on first use
        self.progress, self.status = progress, status
        self.nodes = {n: _Node(b, k) for n, (b, k) in totals.items()}
        self.lock = threading.Lock()  # counters and callbacks: one caller at a time
        self.unpolled: set[str] = set()  # nodes whose poll failed once: left to the run's own reports
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self.progress is not None or self.status is not None

    def begin(self, node: str, batch: list[Item], source: str) -> None:
        with self.lock:
            s = self.nodes[node]
            s.batch, s.source, s.state = tuple(batch), source, "receiving"
            self._report(node, s.reported)

    def done(self, node: str, batch: list[Item]) -> None:
        with self.lock:
            s = self.nodes[node]
            s.done += sum(i.size for i in batch)
            s.files_done += len(batch)
            s.batch, s.source = (), ""
            self._report(node, s.done)

    def finish(self, node: str, ok: bool) -> None:
        with self.lock:
            s = self.nodes[node]
            s.state, s.batch, s.source = ("done" if ok else "failed"), (), ""
            self._report(node, s.reported)

    def snapshot(self, node: str) -> NodeProgress:
        s = self.nodes[node]
        return NodeProgress(node, s.total, s.reported, s.files_done, s.files, s.source, s.state)

    def _report(self, node: str, have: int) -> None:
        """Called with the lock held: the new bytes to `progress`, the whole state to `status`."""
        s = self.nodes[node]
        have = min(have, s.total)
        if have > s.reported:
            if self.progress:
                self.progress(node, have - s.reported)
            s.reported = have
        if self.status:
            self.status(self.snapshot(node))

    def poll_once(self) -> None:
        """Each receiving node's `.part` and finished files of its current batch, by size."""
        for node, s in self.nodes.items():
            with self.lock:
                if s.state != "receiving" or not s.batch or node in self.unpolled:
                    continue
                done, batch = s.done, s.batch
            names = [n for i in batch for n in (f".{i.name}.part", i.name)]
            cmd = (f"cd -- {shlex.quote(self.dest[node])} 2>/dev/null && stat -c '%s %n' -- "
                   f"{' '.join(shlex.quote(n) for n in names)} 2>/dev/null; true")
            try:
                t = self.transports.get(node) or self.transports.setdefault(node, self.connect(node))
                sizes = parse_sizes(t.run(cmd, timeout=10).stdout)
            except (ClusterError, OSError):  # lost, timed out: the run reports the node by itself
                self.unpolled.add(node)
                continue
            have = sum(min(i.size, max(sizes.get(i.name, 0), sizes.get(f".{i.name}.part", 0))) for i in batch)
            with self.lock:
                self._report(node, done + have)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll_once()

    def __enter__(self) -> Tracker:
        if self.active:
            self._thread = threading.Thread(target=self._loop, name="relay-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)  # bounded: a poll's connect and command each have a timeout
        for t in self.transports.values():
            t.close()
