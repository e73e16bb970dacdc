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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

if TYPE_CHECKING:
    import argparse

    from cluster.programs.wlcommon import BatchPlan, Compression
    from cluster.programs.wldata import Dataset

B = TypeVar("B")

SCHEMA_VERSION = 1
RECORD_TYPES = ("start", "step", "epoch", "end")


class MetricsWriter:
    def __init__(self, out_dir: str | Path, rank: int, framework: str) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.framework = rank, framework
        self.path = self.dir / f"metrics-rank{rank}.jsonl"
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - lives as long as the run
        self.history: list[dict[str, Any]] = []  # the epoch records, for the summary
        self.run_start = time.time()  # wall clock at the start record: the end record's wall_s counts from it

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert kind in RECORD_TYPES, kind
        rec = {"type": kind, "schema": SCHEMA_VERSION, "framework": self.framework, "rank": self.rank,
               "time": round(time.time(), 6), "mono": round(time.monotonic(), 6), **fields}
        self._f.write(json.dumps(rec) + "\n")
        return rec

    def start(self, **fields: Any) -> dict[str, Any]:
        rec = self.write("start", host=socket.gethostname(), pid=os.getpid(),
                         node=os.environ.get("CLUSTER_NODE_NAME"), run_id=os.environ.get("CLUSTER_RUN_ID"), **fields)
        self.run_start = time.time()
        return rec

    def step(self, epoch: int, step: int, loss: float, lr: float, global_batch: int,
             t0: float, t1: float, t2: float, **extra: Any) -> dict[str, Any]:
        """A step record from the step's timestamps: t0 batch asked for, t1 batch ready, t2 step done."""
        return self.write("step", epoch=epoch, step=step, loss=loss, lr=lr,
                          images_per_s=round(global_batch / max(t2 - t0, 1e-9), 2),
                          data_s=round(t1 - t0, 5), compute_s=round(t2 - t1, 5), **extra)

    def epoch(self, epoch: int, step: int, tally: EpochTally, plan: BatchPlan, scores: EpochScores,
              bytes_sent_per_step: int) -> dict[str, Any]:
        """The epoch record: its scores, then the tally of its training steps, then the node's load."""
        rec = self.write("epoch", epoch=epoch, step=step, train_loss=scores.train_loss, train_acc=scores.train_acc,
                         val_loss=scores.val_loss, val_acc=scores.val_acc, epoch_s=round(tally.elapsed_s, 3),
                         images_per_s=round(plan.steps_per_epoch * plan.global_batch / tally.elapsed_s, 2),
                         data_s=round(tally.data_s, 3), compute_s=round(tally.compute_s, 3),
                         bytes_sent_per_step_ring=bytes_sent_per_step, **tally.cpu_use, **system_sample())
        self.history.append(rec)
        return rec

    def finish(self, a: argparse.Namespace, ds: Dataset, world: int, plan: BatchPlan, epochs_done: int, step: int,
               cpu: CpuMeter, acc: float | None = None) -> None:
        """The end record (`cpu`: the whole process's use; `acc`: the last epoch's validation accuracy, for
        the target); rank 0 also writes summary.json. Closes the file."""
        self.write("end", epochs_done=epochs_done, step=step, wall_s=round(time.time() - self.run_start, 3),
                   **end_fields(a, acc), **cpu.read())
        if self.rank == 0:
            write_summary(self.dir, summary(self.framework, a, world, plan.steps_per_epoch, self.history,
                                            time.time() - self.run_start, ds))
        self.close()

    def close(self) -> None:
        self._f.close()


def end_fields(a: argparse.Namespace, acc: float | None) -> dict[str, Any]:
    """What the end record says of the target (docs/metrics.md): nothing where the run had none."""
    if not a.target_acc:
        return {}
    return {"target_acc": a.target_acc, "target_reached": acc is not None and acc >= a.target_acc}


def run_fields(a: argparse.Namespace, ds: Dataset, plan: BatchPlan, start_epoch: int, *, world: int,
               local_rank: int, device: str, amp: bool, start_step: int = 0) -> dict[str, Any]:
    """The start record's fields both programs write first, in their order (docs/metrics.md).

    `period`: CLUSTER_PERIOD, which the head sets in the launch script of a run it restarted after a
    node died (1, absent, for the run's first start); `start_step`: the optimizer steps done before
    this start (0 when fresh), as `start_epoch` the epochs."""
    return {"world": world, "local_rank": local_rank, "device": device, "amp": amp, "dataset": ds.name,
            "synthetic": ds.synthetic, "train_samples": len(ds.x_train), "val_samples": len(ds.x_val),
            "batch": plan.batch, "batches": plan.batches, "global_batch": plan.global_batch,
            "steps_per_epoch": plan.steps_per_epoch, "epochs": a.epochs,
            **({"target_acc": a.target_acc, "max_epochs": max(a.epochs, a.max_epochs)} if a.target_acc else {}),
            "peak_lr": plan.peak_lr,
            "momentum": a.momentum, "weight_decay": a.weight_decay, "schedule": a.schedule,
            "warmup_epochs": a.warmup_epochs, "start_epoch": start_epoch, "start_step": start_step,
            "period": int(os.environ.get("CLUSTER_PERIOD") or 1)}


def compression_fields(comp: Compression, a: argparse.Namespace, psgd_start: int) -> dict[str, Any]:
    """The start record's gradient compression (docs/metrics.md): PowerSGD's settings only where it runs."""
    psgd = comp.kind == "powersgd"
    return {"grad_compression": comp.kind, "powersgd_rank": a.powersgd_rank if psgd else None,
            "powersgd_start_step": psgd_start if psgd else None,
            "powersgd_from_first": comp.from_first if psgd else None,
            "powersgd_wire": a.powersgd_wire if psgd else None}


class StepOutcome(NamedTuple):
    """What one optimizer step reports back to the step loop."""

    loss: float  # this rank's mean loss (the step has finished: reading it waited for the all-reduce)
    samples: int  # samples this rank computed in the step
    bytes_sent: int  # what this rank sent in the step's all-reduces (ring model)


class EpochScores(NamedTuple):
    train_loss: float  # over all ranks' training samples of the epoch
    train_acc: float  # on up to 512 of each rank's training samples, after the epoch
    val_loss: float
    val_acc: float


class EpochTally:
    """The per-step bookkeeping of one epoch, kept the same way by both programs: time waiting for
    data vs computing, the loss summed over samples, bytes sent, and the steps' CPU use (taken when
    the steps end, so evaluation is not counted)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.cpu = CpuMeter()
        self.loss_sum, self.samples, self.bytes_sent = 0.0, 0, 0
        self.data_s, self.compute_s, self.elapsed_s = 0.0, 0.0, 0.0
        self.cpu_use: dict[str, float] = {}

    def add(self, asked: float, ready: float, done: float, outcome: StepOutcome) -> None:
        """One step: batch asked for at `asked`, ready at `ready`, step done at `done` (perf_counter)."""
        self.data_s, self.compute_s = self.data_s + ready - asked, self.compute_s + done - ready
        self.loss_sum += outcome.loss * outcome.samples
        self.samples += outcome.samples
        self.bytes_sent += outcome.bytes_sent

    def stop(self) -> None:
        self.elapsed_s = time.perf_counter() - self.started
        self.cpu_use = self.cpu.read()

    def mean_bytes_sent(self, steps: int) -> int:
        return round(self.bytes_sent / max(1, steps))


def run_steps(metrics: MetricsWriter, plan: BatchPlan, log_every: int, epoch: int, step: int,
              fetch: Callable[[], B], train: Callable[[B, float], StepOutcome]) -> tuple[int, EpochTally]:
    """One epoch's optimizer steps, timed: `fetch` gives the next batch (on the device), `train` runs a
    step on it at a learning rate. Logs a step record every `log_every` steps, the first (the run is
    up) and the last; returns the step count after the epoch and its tally (stopped)."""
    tally = EpochTally()
    for i in range(plan.steps_per_epoch):
        t0 = time.perf_counter()
        batch = fetch()
        t1 = time.perf_counter()
        lr = plan.lr(step)
        outcome = train(batch, lr)
        t2 = time.perf_counter()
        tally.add(t0, t1, t2, outcome)
        step += 1
        if step % log_every == 0 or i == plan.steps_per_epoch - 1 or i == 0:
            metrics.step(epoch, step, outcome.loss, lr, plan.global_batch, t0, t1, t2,
                         bytes_sent_ring=outcome.bytes_sent)
    tally.stop()
    return step, tally


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

    res: list[dict[str, Any]] = []
    for line in text.strip().splitlines():
        c = [x.strip() for x in line.split(",")]
        if len(c) == 5:
            res.append({"index": int(c[0]), "util_percent": num(c[1]), "mem_used_mib": num(c[2]),
                        "temp_c": num(c[3]), "power_w": num(c[4])})
    return res


def summary(framework: str, args: argparse.Namespace, world: int, steps_per_epoch: int,
            history: list[dict[str, Any]], wall_s: float, ds: Dataset) -> dict[str, Any]:
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
    problems: list[str] = []
    for name, types in {**COMMON, **REQUIRED[kind]}.items():
        if name not in record:
            problems.append(f"{kind}: missing {name}")
        elif not isinstance(record[name], types) or (isinstance(record[name], bool) and bool not in types):
            problems.append(f"{kind}: {name} is {type(record[name]).__name__}")
    if record.get("framework") not in ("pytorch", "tensorflow"):
        problems.append(f"{kind}: framework {record.get('framework')!r}")
    return problems
