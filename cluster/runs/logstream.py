"""A run's logs as they are written (`clusterctl logs -f`): each node's new lines until the run ends."""
from __future__ import annotations

import time
from typing import Callable, Iterator

from cluster.agent.runfiles import screen
from cluster.runs import records, state


def follow(record: records.RunRecord, node: str | None = None, interval: float = 1.0,
           sleep: Callable[[float], None] = time.sleep,
           unreachable: set[str] | None = None) -> Iterator[tuple[str, str]]:
    """(node, line) for every line each node's log gains, from its start; ends once a read made after the
    run stopped being active is through, so the last lines a node wrote are never lost.

    The record is refreshed (asked of the nodes and judged, as `clusterctl status` does) between reads.
    `unreachable` is kept equal to the nodes the last read could not reach."""
    offsets: dict[str, int] = {}
    held: dict[str, str] = {}  # node -> its unended line (a progress bar's drawings): its end comes later
    while True:
        got = state.logs(record, node, offsets=offsets)
        if unreachable is not None:
            unreachable.clear()
            unreachable.update(getattr(got, "unreachable", ()))
        ended = state.stop_answered(record)  # ended, or the user's stop answered (a node may stay pending)
        for name, (text, size) in got.items():
            offsets[name] = size
            lines = (held.pop(name, "") + text).split("\n")  # a carriage return redraws a line, it ends none
            rest = lines.pop()
            if "\r" in rest and not ended:  # a bar being drawn: its last whole drawing now, the rest later
                drawn, rest = rest.rsplit("\r", 1)
                lines += [drawn] if drawn.strip("\r") else []
            held[name] = rest
            for line in screen(lines + ([rest] if ended and rest else [])):  # as a terminal shows them
                yield name, line
        if ended:
            return
        record = state.refresh(record)
        sleep(interval)
