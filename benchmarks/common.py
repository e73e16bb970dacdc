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


def print_timing_table(results: dict[str, tuple[float, list[float]]], ratio_header: str,
                       ratio: Callable[[float], float], digits: int = 3) -> None:
    """One row per method: median, the ratio against the run's baseline, min and max (Markdown)."""
    w = max(len("method"), *(len(n) for n in results))
    print(f"| {'method':<{w}} | {'median s':>9} | {ratio_header:>9} | {'min s':>7} | {'max s':>7} |")
    print(f"|{'-' * (w + 2)}|{'-' * 11}|{'-' * 11}|{'-' * 9}|{'-' * 9}|")
    for name, (med, times) in results.items():
        print(f"| {name:<{w}} | {med:>9.{digits}f} | {ratio(med):>8.2f}x | {min(times):>7.{digits}f} "
              f"| {max(times):>7.{digits}f} |")
