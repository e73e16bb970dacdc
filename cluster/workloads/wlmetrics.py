"""Metrics written by the training programs: one JSONL file per rank, one summary per run.

Schema: docs/metrics.md. Records are built as dicts and written with json.dumps,
flushed per line, so a stopped or crashed run keeps everything written so far.
Every record carries `time` (wall clock, seconds since the epoch) and `mono`
(this process's monotonic clock); the `start` record pairs both with the host
name, so the head can align nodes using the clock offsets `check` measured.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
RECORD_TYPES = ("start", "step", "epoch", "end")


class MetricsWriter:
    def __init__(self, out_dir: str | Path, rank: int, framework: str) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.framework = rank, framework
        self.path = self.dir / f"metrics-rank{rank}.jsonl"
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - lives as long as the run

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert kind in RECORD_TYPES, kind
        rec = {"type": kind, "schema": SCHEMA_VERSION, "framework": self.framework, "rank": self.rank,
               "time": round(time.time(), 6), "mono": round(time.monotonic(), 6), **fields}
        self._f.write(json.dumps(rec) + "\n")
        return rec

    def start(self, **fields: Any) -> dict[str, Any]:
        return self.write("start", host=socket.gethostname(), pid=os.getpid(),
                          node=os.environ.get("CLUSTER_NODE_NAME"), run_id=os.environ.get("CLUSTER_RUN_ID"), **fields)

    def step(self, epoch: int, step: int, loss: float, lr: float, global_batch: int,
             t0: float, t1: float, t2: float, **extra: Any) -> dict[str, Any]:
        """A step record from the step's timestamps: t0 batch asked for, t1 batch ready, t2 step done."""
        return self.write("step", epoch=epoch, step=step, loss=loss, lr=lr,
                          images_per_s=round(global_batch / max(t2 - t0, 1e-9), 2),
                          data_s=round(t1 - t0, 5), compute_s=round(t2 - t1, 5), **extra)

    def close(self) -> None:
        self._f.close()


def process_cpu_s() -> float:
    """CPU seconds (user + system) of this process so far, all its threads (compute, communication,
    loaders) included."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class CpuMeter:
    """CPU use of this process over an interval: CPU seconds / wall seconds, i.e. the cores it kept busy
    on average. Shown beside throughput so a comparison of frameworks can show the budgets were equal."""

    def __init__(self) -> None:
        self.cpu0, self.wall0 = process_cpu_s(), time.perf_counter()

    def read(self) -> dict[str, float]:
        cpu, wall = process_cpu_s() - self.cpu0, time.perf_counter() - self.wall0
        return {"cpu_s_process": round(cpu, 3), "cpu_cores_process": round(cpu / wall, 3) if wall > 0 else 0.0}


def system_sample() -> dict[str, Any]:
    """CPU and RAM of this process and the node (psutil); GPUs when present (NVML, else nvidia-smi)."""
    out: dict[str, Any] = {}
    try:
        import psutil

        p = psutil.Process()
        out["cpu_percent_node"] = psutil.cpu_percent(interval=None)
        out["cpu_percent_process"] = p.cpu_percent(interval=None)
        out["ram_used_mib_node"] = round((psutil.virtual_memory().total - psutil.virtual_memory().available) / 2**20)
        out["rss_mib_process"] = round(p.memory_info().rss / 2**20)
    except ImportError:
        pass
    gpus = gpu_sample()
    if gpus:
        out["gpus"] = gpus
    return out


def gpu_sample() -> list[dict[str, Any]]:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        res = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            res.append({"index": i, "util_percent": util.gpu, "mem_used_mib": mem.used // 2**20,
                        "temp_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                        "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0})
        return res
    except Exception:  # noqa: BLE001 - no NVML: try nvidia-smi, else no GPU figures
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,temperature.gpu,power.draw",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_nvidia_smi_sample(r.stdout) if r.returncode == 0 else []


def parse_nvidia_smi_sample(text: str) -> list[dict[str, Any]]:
    def num(v: str) -> float | None:
        try:
            return float(v)
        except ValueError:  # "[N/A]" on cards without the sensor
            return None

    res = []
    for line in text.strip().splitlines():
        c = [x.strip() for x in line.split(",")]
        if len(c) == 5:
            res.append({"index": int(c[0]), "util_percent": num(c[1]), "mem_used_mib": num(c[2]),
                        "temp_c": num(c[3]), "power_w": num(c[4])})
    return res


def summary(framework: str, args: Any, world: int, steps_per_epoch: int, history: list[dict[str, Any]],
            wall_s: float, ds: Any) -> dict[str, Any]:
    """The run's summary.json from its epoch records (the same fields for both frameworks)."""
    vals = [h["val_acc"] for h in history]
    accumulate = int(getattr(args, "accumulate", 1))
    sent = [h["bytes_sent_per_step_ring"] for h in history if "bytes_sent_per_step_ring" in h]
    cores = [h["cpu_cores_process"] for h in history if "cpu_cores_process" in h]
    return {"framework": framework, "world": world, "batch": args.batch,
            "global_batch": args.batch * world * accumulate, "accumulate": accumulate,
            "grad_compression": getattr(args, "grad_compression", "none"),
            "bytes_sent_per_step_ring": round(sum(sent) / len(sent)) if sent else None,
            "cpu_cores_process": round(sum(cores) / len(cores), 3) if cores else None,
            "epochs": args.epochs, "steps_per_epoch": steps_per_epoch, "dataset": ds.name, "synthetic": ds.synthetic,
            "final_val_acc": vals[-1] if vals else None, "best_val_acc": max(vals) if vals else None,
            "epoch_s": [h["epoch_s"] for h in history], "images_per_s": [h["images_per_s"] for h in history],
            "val_acc": vals, "wall_s": round(wall_s, 3), "final_step": history[-1]["step"] if history else None}


def write_summary(out_dir: str | Path, summary: dict[str, Any]) -> Path:
    p = Path(out_dir) / "summary.json"
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, p)
    return p


# Required fields per record type (docs/metrics.md); values' types checked by `validate`.
REQUIRED: dict[str, dict[str, tuple[type, ...]]] = {
    "start": {"host": (str,), "world": (int,), "batch": (int,), "global_batch": (int,), "steps_per_epoch": (int,),
              "epochs": (int,), "peak_lr": (float, int), "dataset": (str,), "synthetic": (bool,),
              "start_epoch": (int,)},
    "step": {"epoch": (int,), "step": (int,), "loss": (float, int), "lr": (float, int),
             "images_per_s": (float, int), "data_s": (float, int), "compute_s": (float, int)},
    "epoch": {"epoch": (int,), "step": (int,), "train_loss": (float, int), "train_acc": (float, int),
              "val_loss": (float, int), "val_acc": (float, int), "epoch_s": (float, int),
              "images_per_s": (float, int), "data_s": (float, int), "compute_s": (float, int)},
    "end": {"epochs_done": (int,), "step": (int,), "wall_s": (float, int)},
}
COMMON: dict[str, tuple[type, ...]] = {"type": (str,), "schema": (int,), "framework": (str,), "rank": (int,),
                                       "time": (float,), "mono": (float, int)}


def validate(record: dict[str, Any]) -> list[str]:
    """Problems with one metrics record against the documented schema (empty: valid)."""
    kind = record.get("type")
    if kind not in REQUIRED:
        return [f"unknown type {kind!r}"]
    problems = []
    for name, types in {**COMMON, **REQUIRED[kind]}.items():
        if name not in record:
            problems.append(f"{kind}: missing {name}")
        elif not isinstance(record[name], types) or (isinstance(record[name], bool) and bool not in types):
            problems.append(f"{kind}: {name} is {type(record[name]).__name__}")
    if record.get("framework") not in ("pytorch", "tensorflow"):
        problems.append(f"{kind}: framework {record.get('framework')!r}")
    return problems
