"""Each node's figures (NodeFigures) from its folder on the head: its metrics files, the node agent's samples,
its hardware's facts and the power it drew, measured or else estimated from its hardware (docs/report.md).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Record = dict[str, Any]  # one metrics line, as the training programs wrote it (docs/metrics.md)

# Energy estimate where no power was measured (docs/report.md): an old desktop draws about
# IDLE_W doing nothing, and up to CPU_LOAD_W more with its CPU busy; a GPU without a power
# reading counts at its board power from GPU_BOARD_W (NVIDIA's specifications).
IDLE_W = 40.0
CPU_LOAD_W = 65.0
GPU_BOARD_W = {"GTX 750 Ti": 60, "GTX 950": 90, "GTX 960": 120, "GTX 970": 145, "GTX 980": 165,
               "GTX 1050 Ti": 75, "GTX 1050": 75, "GTX 1060": 120, "GTX 1070": 150, "GTX 1080 Ti": 250,
               "GTX 1080": 180, "RTX 2060": 160, "RTX 2070": 175, "RTX 2080": 215, "RTX 3060": 170,
               "RTX 3070": 220, "RTX 3080": 320, "RTX 3090": 350}
DEFAULT_GPU_W = 150.0


@dataclass
class NodeFigures:
    node: str
    ranks: list[int]
    step_s_median: float | None
    step_s_p90: float | None
    data_s_median: float | None
    images_per_s: float | None  # this node's own samples / its median step time
    cpu_percent: float | None
    gpu_power_w: float | None  # measured (NVML / nvidia-smi) mean over the run, all GPUs of the node
    watts: float
    watts_source: str  # measured | estimated
    hardware: str
    # from the node agent's samples (out/usage.jsonl), for any program: the built-in ones and a user's own
    rss_mb_peak: float | None = None
    cpu_energy_j: float | None = None  # the CPU packages' measured energy (RAPL) over the run, where readable
    exit_code: int | None = None
    usage: list[Record] = field(default_factory=list)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _jsonl(path: Path) -> list[Record]:
    """A JSON-lines file's objects; a line cut short (a stop, a crash) or not an object is passed over:
    everything before it counts."""
    out = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_metrics(node_dir: Path) -> dict[int, list[Record]]:
    """Each rank's metrics records, from the node's out/metrics-rank<N>.jsonl."""
    return {int(f.stem.removeprefix("metrics-rank")): _jsonl(f)
            for f in sorted((node_dir / "out").glob("metrics-rank*.jsonl"))}


def read_user_metrics(node_dir: Path) -> list[Record]:
    """What the program appended to $CLUSTER_METRICS, its numeric fields only."""
    return [{k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for r in _jsonl(node_dir / "out" / "user-metrics.jsonl")]


def _usage_figures(p: NodeFigures, node_dir: Path, exit_code: int | None) -> None:
    """Fill a node's figures from the node agent's samples of the run's processes (cluster/agent/usage.py),
    where the program's own metrics had none."""
    p.usage, p.exit_code = _jsonl(node_dir / "out" / "usage.jsonl"), exit_code
    cpu = [x["cpu_percent"] for x in p.usage if isinstance(x.get("cpu_percent"), (int, float))]
    if p.cpu_percent is None and cpu:
        p.cpu_percent = statistics.mean(cpu)
    rss = [x["rss_mb"] for x in p.usage if isinstance(x.get("rss_mb"), (int, float))]
    p.rss_mb_peak = max(rss) if rss else None
    joules = [x["cpu_energy_j"] for x in p.usage if isinstance(x.get("cpu_energy_j"), (int, float))]
    p.cpu_energy_j = round(sum(joules), 1) if joules else None


def _hardware(node_dir: Path) -> tuple[str, list[str]]:
    """'4 cores, 8 GiB, GTX 1050 Ti' and the GPU names, from the facts collect saved beside the node's files
    (NodeFacts.to_dict()); 'unknown' where there are none."""
    try:
        f = json.loads((node_dir / "facts.json").read_text())
    except (OSError, ValueError):
        f = None
    if not isinstance(f, dict) or not f:
        return "unknown", []
    cores = (f.get("cpu") or {}).get("usable") or 0
    ram = ((f.get("memory") or {}).get("total_mib") or 0) / 1024
    gpus = [g["name"].replace("NVIDIA ", "").replace("GeForce ", "") for g in (f.get("gpus") or {}).get("gpus", [])]
    model = ((f.get("cpu") or {}).get("model") or "").replace("(R)", "").replace("(TM)", "").strip()
    return f"{model + ', ' if model else ''}{cores} cores, {ram:.0f} GiB, {', '.join(gpus) or 'no GPU'}", gpus


def boot_id(node_dir: Path) -> str | None:
    """The node's kernel boot id from its facts (`place`): nodes with the same one are one machine."""
    try:
        place = json.loads((node_dir / "facts.json").read_text()).get("place")
    except (OSError, ValueError, AttributeError):
        return None
    return str(place["boot_id"]) if isinstance(place, dict) and place.get("boot_id") else None


def _board_watts(gpu: str) -> float:
    for model, w in sorted(GPU_BOARD_W.items(), key=lambda kv: -len(kv[0])):
        if model in gpu:
            return float(w)
    return DEFAULT_GPU_W


def _watts(cpu_percent: float, gpus: list[str], gpu_w: float | None = None) -> float:
    """A node's draw: idle, its CPU's share of CPU_LOAD_W, its GPUs' measured power, else their board power."""
    rest = IDLE_W + CPU_LOAD_W * min(1.0, cpu_percent / 100.0)
    return rest + (gpu_w if gpu_w is not None else sum(_board_watts(g) for g in gpus))


def from_metrics(node: str, by_rank: dict[int, list[Record]], node_dir: Path, batch: int, procs: int,
                 exit_code: int | None) -> tuple[NodeFigures, float]:
    """One node's step times, CPU use and power (measured, else estimated from its hardware); the watts
    unrounded, for the energy. `procs`: its training processes at a time (a node whose rank changed with
    the membership has a file per rank it held, one after the other)."""
    recs = [x for r in sorted(by_rank) for x in by_rank[r]]
    steps = [x for x in recs if x["type"] == "step"]
    step_s = [x["data_s"] + x["compute_s"] for x in steps]
    ep = [x for x in recs if x["type"] == "epoch"]
    cpu = [x["cpu_percent_node"] for x in ep if x.get("cpu_percent_node") is not None]
    power = [sum(g["power_w"] for g in x["gpus"] if g.get("power_w") is not None)
             for x in ep if x.get("gpus") and any(g.get("power_w") is not None for g in x["gpus"])]
    hw, gpus = _hardware(node_dir)
    med = median(step_s)
    watts = _watts(median(cpu) or 100.0, gpus, statistics.mean(power) if power else None)
    p = NodeFigures(
        node=node, ranks=sorted(by_rank), step_s_median=med,
        step_s_p90=sorted(step_s)[int(0.9 * (len(step_s) - 1))] if step_s else None,
        data_s_median=median([x["data_s"] for x in steps]),
        images_per_s=(batch * procs / med) if med else None, cpu_percent=median(cpu),
        gpu_power_w=statistics.mean(power) if power else None, watts=round(watts, 1),
        watts_source="measured" if power else "estimated", hardware=hw)
    _usage_figures(p, node_dir, exit_code)
    return p, watts


def from_usage(node: str, node_dir: Path, exit_code: int | None) -> tuple[NodeFigures, float]:
    """A node of a run whose program writes no training metrics (a user's own): what the node agent
    measured, and its power estimated from that CPU use and its hardware; the watts unrounded."""
    hw, gpus = _hardware(node_dir)
    p = NodeFigures(node=node, ranks=[], step_s_median=None, step_s_p90=None, data_s_median=None,
                    images_per_s=None, cpu_percent=None, gpu_power_w=None, watts=0.0,
                    watts_source="estimated", hardware=hw)
    _usage_figures(p, node_dir, exit_code)  # cpu_percent: the samples' mean, None without any
    watts = _watts(100.0 if p.cpu_percent is None else p.cpu_percent, gpus)
    p.watts = round(watts, 1)
    return p, watts
