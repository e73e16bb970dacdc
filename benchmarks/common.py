"""What the benchmark scripts share: timing and the lab options."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable


def median_time(fn: Callable[[], None], repeats: int) -> tuple[float, list[float]]:
    """Median wall time of `repeats` calls, after one warm-up call (page cache, sshd's first fork)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def lab_parser(doc: str | None, name: str, subnet: str, repeats: int) -> argparse.ArgumentParser:
    """--nodes/--repeats/--name/--subnet: each benchmark's lab has its own name and subnet."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--name", default=name)
    ap.add_argument("--subnet", default=subnet)
    return ap
