"""Runs on a node (standard library only, Python 3.8+): what a run's processes use, sampled by the node
agent's session leader every SAMPLE_S into the run's out/usage.jsonl, for any program (the user's own
too, which imports nothing of clusterctl).

One JSON line per sample: the time, how many processes, their CPU use (percent of one core, summed:
two busy cores are 200), their resident memory, and where the node has them the GPUs' utilisation, memory
and power (`nvidia-smi`, one query per sample, bounded) and the CPU packages' energy since the last sample
(RAPL, /sys/class/powercap: measured joules, not an estimate).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    Doc = dict[str, Any]

SAMPLE_S = 5.0
FILE = "usage.jsonl"
GPU_QUERY = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,power.draw", "--format=csv,noheader,nounits"]
POWERCAP = Path("/sys/class/powercap")


def _number(text: str) -> float | None:
    """A field of nvidia-smi's CSV: a number, or None for [N/A] / N/A / [Not Supported] (GeForce cards
    often do not report power)."""
    try:
        return float(text.strip())
    except ValueError:
        return None


def parse_gpus(text: str) -> list[Doc]:
    """nvidia-smi's answer to GPU_QUERY, one GPU a line: `37, 1234, 45.12`."""
    out = []
    for line in text.splitlines():
        parts = line.split(",")
        if len(parts) != 3:
            continue
        util, mem, power = (_number(p) for p in parts)
        out.append({"util_percent": util, "mem_mb": mem, "power_w": power})
    return out


def gpus() -> list[Doc] | None:
    """The node's GPUs now, or None without nvidia-smi (or when it does not answer in 5 s)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        r = subprocess.run(GPU_QUERY, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_gpus(r.stdout) if r.returncode == 0 else None


def rapl_packages(root: Path = POWERCAP) -> dict[str, tuple[int, int]]:
    """Each CPU package's energy counter (microjoules) and its wrap-around range; {} where RAPL is absent or
    unreadable (it is root-only on recent kernels). Zones `intel-rapl:N` only: their subzones are parts of them."""
    out = {}
    for zone in sorted(root.glob("intel-rapl:*")) if root.is_dir() else []:
        if zone.name.count(":") != 1:
            continue
        try:
            energy = int((zone / "energy_uj").read_text())
            wrap = int((zone / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            continue
        out[zone.name] = (energy, wrap)
    return out


def _proc(pid: int) -> tuple[int, int] | None:
    """(utime + stime in clock ticks, resident pages) of a live process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12]), int(fields[21])


class Sampler:
    """Samples `processes()` (the run's pids) on each `sample()` call, appending one line to `out`."""

    def __init__(self, out: Path, processes: Callable[[], list[int]], rapl_root: Path = POWERCAP) -> None:
        self.out, self.processes, self.rapl_root = out, processes, rapl_root
        self.tick = os.sysconf("SC_CLK_TCK")
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.last: tuple[float, dict[int, int], dict[str, tuple[int, int]]] | None = None
        self.nvidia = shutil.which("nvidia-smi") is not None

    def sample(self) -> Doc:
        now = time.time()
        seen = {p: v for p in self.processes() for v in [_proc(p)] if v is not None}
        ticks = {p: v[0] for p, v in seen.items()}
        rapl = rapl_packages(self.rapl_root)
        doc: Doc = {"t": round(now, 3), "procs": len(seen),
                    "rss_mb": round(sum(v[1] for v in seen.values()) * self.page / 2**20, 1)}
        if self.last is not None:
            t0, before, rapl0 = self.last
            dt = max(now - t0, 1e-3)
            used = sum(t - before.get(p, 0) for p, t in ticks.items())  # a new process: all of its time is new
            doc["cpu_percent"] = round(100.0 * used / self.tick / dt, 1)
            joules = [((e - rapl0[z][0]) % w if w else e - rapl0[z][0]) / 1e6 for z, (e, w) in rapl.items() if z in rapl0]
            if joules:
                doc["cpu_energy_j"] = round(sum(joules), 3)
        if self.nvidia:
            doc["gpus"] = gpus()
        self.last = (now, ticks, rapl)
        with open(self.out, "a") as f:
            f.write(json.dumps(doc) + "\n")
        return doc
