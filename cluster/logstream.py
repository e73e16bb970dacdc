"""A run's logs as they are written (`clusterctl logs -f`): each node's new lines until the run ends."""
from __future__ import annotations

import time
from typing import Callable, Iterator

from cluster import launch, runs


def follow(record: runs.RunRecord, node: str | None = None, interval: float = 1.0,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[str, str]]:
    """(node, line) for every line each node's log gains, from its start; ends once a read made after the
    run stopped being active is through, so the last lines a node wrote are never lost.

    The record is refreshed (asked of the nodes and judged, as `clusterctl status` does) between reads."""
    offsets: dict[str, int] = {}
    while True:
        for name, (text, size) in launch.logs(record, node, offsets=offsets).items():
            offsets[name] = size
            for line in text.splitlines():
                yield name, line
        if not record.active:
            return
        record = launch.refresh(record)
        sleep(interval)
