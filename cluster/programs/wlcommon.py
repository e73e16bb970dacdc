"""What both training programs share, so the study compares frameworks, not hyperparameters."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

REF_BATCH = 64  # the global batch the base learning rate is given for
TRAIN_ACC_SAMPLES = 512  # per epoch, over all ranks: the training accuracy's sample, scored in eval mode
COMPRESSIONS = ("none", "fp16", "powersgd")  # gradient compressions (what the study's comm model prices)
LR_SCALINGS = ("linear", "sqrt")  # how the base learning rate grows with the global batch (peak_lr)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", help="prepared dataset (.npz from the head); else --dataset is loaded here")
    ap.add_argument("--dataset", default="digits", help="digits | digits-aug | cifar10 | imagefolder | synthetic")
    ap.add_argument("--data-path", help="archive or folder for cifar10 / imagefolder")
    ap.add_argument("--size", type=int, default=32, help="image side in pixels")
    ap.add_argument("--model", default="resnet50", help="torchvision.models name (train_torch.py)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="per-worker batch size")
    ap.add_argument("--shares", default="", help="uneven batches: NODE=N,NODE=N per node (`clusterctl plan`); a "
                    "node's share is split among its processes, each rank weights its loss so the gradient is "
                    "the mean over the whole global batch; empty: --batch on every worker")
    ap.add_argument("--lr", type=float, default=0.01, help=f"learning rate for a global batch of {REF_BATCH}; "
                    "scaled with the global batch as --lr-scaling says")
    ap.add_argument("--lr-scaling", default="linear", choices=list(LR_SCALINGS),
                    help="linear: --lr scaled linearly with the global batch; sqrt: linearly up to one worker's "
                    "batch (what BatchNorm normalizes over), then by the square root of the number of such "
                    "batches in a step (peak_lr)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4, help="L2, added to the gradient (as torch SGD)")
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--schedule", default="cosine", choices=["cosine", "constant"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out", help="metrics, summary and checkpoint go here")
    ap.add_argument("--resume", default="auto", choices=["auto", "no"],
                    help="auto: continue from the checkpoint in --out when there is one")
    ap.add_argument("--continues", metavar="RUN",
                    help="this run continues RUN (`clusterctl launch --continue`): its checkpoint, copied into "
                    "--out, must be there and end before --epochs")
    ap.add_argument("--target-acc", type=float, default=0.0,
                    help="end the run at the first epoch whose validation accuracy reaches this (0: train "
                    "--epochs); with --max-epochs, go on past --epochs until it does")
    ap.add_argument("--max-epochs", type=int, default=0,
                    help="with --target-acc: while short of it after --epochs, train on, one epoch at a time "
                    "with the schedule of a run that long (as `launch --continue --set epochs=E+1`), up to "
                    "this many epochs in all; 0: --epochs")
    ap.add_argument("--log-every", type=int, default=10, help="steps between step records")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps per epoch (tests)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads per process (0: cores / local processes)")
    ap.add_argument("--loader-workers", type=int, default=-1,
                    help="threads that prepare the next batches during a step; -1: from the node's cores "
                    "on GPU nodes, 0 on CPU-only nodes (whose cores do the training)")
    ap.add_argument("--amp", default="auto", choices=["auto", "on", "off"],
                    help="mixed precision; auto: only with tensor cores (compute capability >= 7.0)")
    ap.add_argument("--grad-compression", default="none", choices=list(COMPRESSIONS),
                    help="gradients on the wire: none (float32), fp16 (cast for the all-reduce and back), "
                    "powersgd (low-rank with error feedback and warm start)")
    ap.add_argument("--powersgd-rank", type=int, default=2, help="PowerSGD's matrix approximation rank")
    ap.add_argument("--powersgd-start-step", type=int, default=0,
                    help="optimizer steps of fp16 all-reduce before PowerSGD starts (>= 2); 0: after the "
                    "warm-up and after 1000 steps (torch's default), capped at half the run; 1: PowerSGD from "
                    "the first step (PyTorch: its first two without error feedback or warm start)")
    ap.add_argument("--powersgd-wire", default="float32", choices=list(POWERSGD_WIRES),
                    help="powersgd: the dtype its all-reduces send (P, Q, the uncompressed tensors); bfloat16 "
                    "halves the bytes, its matrix products stay float32")
    ap.add_argument("--bn-recompute", type=int, default=0,
                    help="before each evaluation, BatchNorm's statistics recomputed from this many of the "
                    "epoch's training samples in all (each rank passes its share, the ranks' averages are "
                    "averaged: precise BN); 0: the running averages training kept, which lag where an epoch "
                    "has few steps")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches per optimizer step: one all-reduce per ACCUMULATE batches of --batch")
    ap.add_argument("--bucket-mb", type=float, default=0.0,
                    help="DDP gradient bucket size in MiB; 0: DDP's default (25 MiB, first bucket 1 MiB)")
    ap.add_argument("--tf-implementation", default="auto", choices=["auto", "ring", "nccl"],
                    help="TensorFlow CommunicationOptions implementation (MWMS)")
    ap.add_argument("--tf-bytes-per-pack", type=int, default=0,
                    help="TensorFlow CommunicationOptions bytes_per_pack (0: TensorFlow decides)")
    ap.add_argument("--collective-timeout-s", type=float, default=120.0,
                    help="a collective that waits longer for a peer fails, so a dead or frozen peer ends the "
                    "run instead of hanging it (torch: process-group timeout; TF: collective timeout and the "
                    "coordination service's heartbeat timeout); 0: the framework's default")


def check_continued(a: argparse.Namespace, start_epoch: int, acc: float | None) -> None:
    """A continued run that would silently train from scratch, or train nothing, ends here instead (exit
    status 2, as argparse's errors): every rank reaches the same verdict, having agreed on the checkpoint
    (`acc`: the validation accuracy it was saved with, None where it has none)."""
    if a.continues is None:
        return
    problem = None
    if start_epoch == 0:
        problem = (f"--continues {a.continues}: no checkpoint of it in {a.out} on any node (was it copied? "
                   "clusterctl launch --continue copies it from the nodes that ran it)")
    elif reached(a, acc):
        problem = (f"--continues {a.continues}: its checkpoint (epoch {start_epoch}) has validation accuracy "
                   f"{acc:.4f}, already at --target-acc {a.target_acc:g}: nothing to train (--set target_acc=0 "
                   "to train its epochs, or a higher target)")
    elif not trains(a, start_epoch, None):
        problem = (f"--continues {a.continues}: its checkpoint ends epoch {start_epoch} and --epochs is "
                   f"{a.epochs}: nothing to train (--set epochs={start_epoch + 1} or more: the epochs in all, "
                   "the schedule is that of a run of that many)")
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def trains(a: argparse.Namespace, epoch: int, acc: float | None) -> bool:
    """Whether the run trains epoch `epoch` (0-based) after one that scored `acc` (None: none scored yet):
    its --epochs, ended early once --target-acc is reached; past them, while short of it, up to --max-epochs
    (docs/jobs.md "Train until an accuracy")."""
    if reached(a, acc):
        return False
    return epoch < max(int(a.epochs), int(a.max_epochs) if a.target_acc else 0)


def reached(a: argparse.Namespace, acc: float | None) -> bool:
    """Whether a validation accuracy (None: none scored yet) is at the run's --target-acc (0: none)."""
    return bool(a.target_acc) and acc is not None and acc >= a.target_acc


def resume_source(held: list[tuple[int, int]]) -> tuple[int, str]:
    """Whose checkpoint a restart resumes from, given every rank's (epoch, step) ((-1, -1): none; nodes don't
    share disks): the newest epoch's, the lowest rank's on a tie; and where the values come from: "none" (no
    rank holds one), "each" (every rank holds that same save point: nothing crosses the links) or "rank R"."""
    src = max(range(len(held)), key=lambda r: (held[r][0], -r))
    if held[src][0] < 0:
        return src, "none"
    return src, "each" if all(h == held[src] for h in held) else f"rank {src}"


def unreadable_checkpoint(name: object, e: Exception, peer: str) -> None:
    """Says on stderr (node.log) which checkpoint cannot be read (cut short by a full disk, damaged) and why:
    it counts as none, and the resume takes the newest any other `peer` holds instead of failing the restart."""
    why = " ".join(str(e).split())[:300]
    print(f"warning: checkpoint {name} cannot be read ({type(e).__name__}: {why}): counted as none, the newest "
          f"another {peer} holds is taken (none anywhere: training starts at epoch 0)", file=sys.stderr, flush=True)


def parse_args(doc: str | None, argv: list[str] | None,
               refused: Callable[[argparse.Namespace], str | None]) -> argparse.Namespace:
    """A program's settings (add_args); `refused` says what that program cannot do with them, which
    ends it as argparse's usage errors do (exit status 2)."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    add_args(ap)
    a = ap.parse_args(argv)
    problem = refused(a)
    if not problem and not (0 <= a.target_acc <= 1 and a.max_epochs >= 0):
        problem = "--target-acc must be within 0-1 (0: none), --max-epochs >= 0"
    if problem:
        ap.error(problem)
    return a


def parse_shares(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        node, _, n = item.rpartition("=")
        if not node or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--shares: expected NODE=N with N >= 1, got {item!r}")
        out[node] = int(n)
    return out


def my_batch(shares: str, node: str | None, default: int, local_rank: int = 0, local_world: int = 1) -> int:
    """This process's batch: its node's share split among the node's processes, or --batch."""
    if not shares:
        return default
    table = parse_shares(shares)
    if node not in table:
        raise SystemExit(f"--shares has no entry for this node ({node!r}): {shares}")
    base, extra = divmod(table[node], local_world)
    if base == 0:
        raise SystemExit(f"--shares: {node} has {table[node]} samples for {local_world} processes")
    return base + (1 if local_rank < extra else 0)


def batch_slice(step: int, batches: list[int], rank: int) -> slice:
    """Rank `rank`'s part of global batch number `step` within the epoch's order: global batches are
    consecutive runs of sum(batches) samples, cut in rank order."""
    start = step * sum(batches) + sum(batches[:rank])
    return slice(start, start + batches[rank])


def loss_weight(batches: list[int], rank: int) -> float:
    """DDP averages the ranks' gradients; weighting rank r's mean loss by world * b_r / B makes that
    average the mean over all B samples, whatever the shares."""
    return len(batches) * batches[rank] / sum(batches)


def peak_lr(base_lr: float, global_batch: int, scaling: str = "linear", worker_batch: float = 0.0) -> float:
    """The schedule's peak rate: `base_lr` is for a global batch of REF_BATCH. linear: scaled with the global
    batch. sqrt: linearly up to `worker_batch` (a worker's micro-batch, the samples BatchNorm normalizes
    together), then by the square root of the global batch's multiple of it. BatchNorm's statistics stay per
    worker, so on k workers the linear rule raises the rate k times over batches normalized as one worker's
    are, which can train worse than one process at the global batch (docs/performance.md). One worker (no
    accumulation) gets the same rate by either rule."""
    if scaling == "sqrt" and 0 < worker_batch < global_batch:
        return base_lr * worker_batch / REF_BATCH * math.sqrt(global_batch / worker_batch)
    return base_lr * global_batch / REF_BATCH


@dataclass(frozen=True)
class BatchPlan:
    """Samples per optimizer step, steps per epoch and the learning-rate schedule: derived the same way
    in both programs, so they train on the same batches with the same rates."""

    batch: int  # this rank's micro-batch
    batches: list[int]  # every rank's micro-batch, in rank order
    accumulate: int  # micro-batches per optimizer step
    steps_per_epoch: int
    peak_lr: float
    epochs: int
    warmup_epochs: float
    schedule: str
    lr_scaling: str = "linear"  # how peak_lr was scaled from the base rate (peak_lr())

    @property
    def micro_global(self) -> int:
        return sum(self.batches)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, all ranks and all micro-batches."""
        return self.accumulate * self.micro_global

    @property
    def step_batches(self) -> list[int]:
        """Every rank's samples per optimizer step: its k micro-batches are consecutive in the order."""
        return [self.accumulate * b for b in self.batches]

    def lasting(self, epochs: int) -> BatchPlan:
        """The plan whose schedule is that of a run of `epochs` (an epoch past --epochs: trains())."""
        return self if epochs == self.epochs else dataclasses.replace(self, epochs=epochs)

    def lr(self, step: int) -> float:
        return lr_at(step, self.steps_per_epoch, self.epochs, self.peak_lr, self.warmup_epochs, self.schedule)

    def start_fields(self) -> dict[str, Any]:
        """The plan's fields of the start record that follow the framework's own (docs/metrics.md)."""
        return {"accumulate": self.accumulate, "micro_batch": self.batch, "micro_global_batch": self.micro_global,
                "lr_scaled_for_batch": self.global_batch, "lr_scaling": self.lr_scaling}


def plan_batches(a: argparse.Namespace, batch: int, batches: list[int], train_samples: int) -> BatchPlan:
    """The plan from the job's settings and every rank's batch (learned from the others)."""
    global_batch = a.accumulate * sum(batches)
    steps_per_epoch = train_samples // global_batch
    if a.max_steps:
        steps_per_epoch = min(steps_per_epoch, a.max_steps)
    return BatchPlan(batch=batch, batches=batches, accumulate=a.accumulate, steps_per_epoch=steps_per_epoch,
                     peak_lr=peak_lr(a.lr, global_batch, a.lr_scaling, sum(batches) / len(batches)),
                     epochs=a.epochs, warmup_epochs=a.warmup_epochs, schedule=a.schedule, lr_scaling=a.lr_scaling)


def lr_at(step: int, steps_per_epoch: int, epochs: int, peak: float, warmup_epochs: float, schedule: str) -> float:
    """Linear warm-up from peak/10, then cosine to zero (or constant). `step` counts from 0 over the run."""
    total = max(1, steps_per_epoch * epochs)
    warm = int(round(warmup_epochs * steps_per_epoch))
    if step < warm:
        return peak * (0.1 + 0.9 * step / warm)
    if schedule == "constant":
        return peak
    progress = (step - warm) / max(1, total - warm)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def eval_images(train_samples: int, val_samples: int, world: int, bn_recompute: int = 0) -> int:
    """Images one rank passes through the model at an epoch's end: its share of the validation split, of
    the training accuracy's sample (train_acc_samples) and, with --bn-recompute, of BatchNorm's
    (bn_samples). What `plan` prices an epoch's evaluation by: it shrinks with more ranks."""
    shard = (train_samples - train_samples % world) // world
    return (min(train_acc_samples(world), shard) + min(bn_samples(bn_recompute, world), shard)
            + -(-val_samples // world))


def train_acc_samples(world: int) -> int:
    """Training samples one rank scores for the epoch's training accuracy: TRAIN_ACC_SAMPLES split over the
    ranks (share), so that the figure has the same sample on any number of nodes."""
    return share(TRAIN_ACC_SAMPLES, world)


def bn_samples(bn_recompute: int, world: int) -> int:
    """Training samples one rank passes for precise BatchNorm: --bn-recompute split over the ranks (share).
    The ranks' statistics are averaged, each the mean over its batches of the job's size, so n in all over W
    ranks is the same estimate as n on one node (the mean over n / batch batches). At least 2 (training-mode
    BatchNorm needs two samples; with none passed the statistics would stay reset); 0: off."""
    return 0 if bn_recompute <= 0 else max(2, share(bn_recompute, world))


def share(total: int, world: int) -> int:
    """One rank's part of an epoch-end sample of `total` (rounded up: every rank the same count, which the
    collectives at the epoch's end need), so its cost shrinks with the ranks as the training does, one
    node's unchanged."""
    return -(-total // max(1, world))


def threads_per_process(requested: int, local_processes: int) -> int:
    """Cores of this process's CPU set divided among the node's processes, so they don't oversubscribe."""
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_processes))


def loader_workers(requested: int, accelerator: bool, local_processes: int) -> int:
    """Batch-preparing threads: spare cores on a GPU node (up to 4 per process); none on a CPU-only
    node, where every core already computes (threads_per_process hands them all out)."""
    if requested >= 0:
        return requested
    if not accelerator:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores // max(1, local_processes) - 1))


def amp_wanted(mode: str, compute_capability: tuple[int, int] | None) -> bool:
    if mode == "on":
        return True
    if mode == "off" or compute_capability is None:
        return False
    return compute_capability >= (7, 0)  # a GTX 10xx runs fp16 at 1/64 of fp32


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The same shuffled order on every rank (each then takes its own shard of it)."""
    import numpy as np

    return np.random.default_rng(seed * 1000003 + epoch).permutation(n)


TORCH_POWERSGD_START = 1000  # torch's own default start_powerSGD_iter


def powersgd_start(requested: int, steps_per_epoch: int, warmup_epochs: float, epochs: int) -> int:
    """The optimizer step PowerSGD starts at: as asked; else after the learning-rate warm-up and after
    torch's own default of 1000 plain steps, capped at half the run. Its error feedback needs steps to
    catch up, which an early start on a short run does not leave it (docs/performance.md). Before it starts
    the gradients go as fp16 (PowerSGDHook). Never before step 2: DDP rebuilds its
    buckets after the first step and PowerSGD's per-bucket state must not see the old buckets."""
    if requested:
        return max(2, requested)
    warm = int(round(warmup_epochs * steps_per_epoch))
    return max(2, warm, min(TORCH_POWERSGD_START, steps_per_epoch * epochs // 2))


POWERSGD_WIRES = {"float32": 4, "bfloat16": 2}  # --powersgd-wire: bytes an element
FROM_FIRST = 1  # powersgd_start_step 1: PowerSGD from the first step (torchcomm: its first two without memory)


def fp16_steps(requested: int, steps_per_epoch: int, warmup_epochs: float, epochs: int) -> int:
    """Optimizer steps PowerSGD sends as fp16 before it starts: none when asked to start from the first."""
    return 0 if requested == FROM_FIRST else powersgd_start(requested, steps_per_epoch, warmup_epochs, epochs)


def powersgd_elements(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float = 2.0) -> int:
    """Elements PowerSGD all-reduces per step for gradients of these shapes, as torch's powerSGD_hook
    decides per tensor: a tensor viewed as n x m (n = first dimension) is sent as P (n x r) and Q (m x r)
    when (n + m) * r * min_compression_rate < n * m, with r = min(n, m, rank); else uncompressed."""
    total = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return total


def comm_volume(shapes: list[tuple[int, ...]], world: int, compression: str, powersgd_rank: int = 2,
                elem_bytes: int = 4, powersgd_wire: str = "float32") -> dict[str, float]:
    """Bytes one rank all-reduces and sends per optimizer step, exactly from the gradients' shapes.

    `allreduce_payload_bytes`: what is handed to the all-reduce(s) (float32: 4 bytes per element,
    fp16: 2, powersgd: P, Q and the uncompressed tensors in float32, or bfloat16 with that
    `powersgd_wire`). `bytes_sent_per_step_ring`: what a
    ring all-reduce sends per rank for that payload, 2 (world - 1) / world times it (reduce-scatter then
    all-gather); with PowerSGD before its start step the fp16 figure applies (Compression). Buffers DDP broadcasts
    (BatchNorm statistics) are not gradients and are not counted."""
    elements = sum(math.prod(s) for s in shapes)
    if compression == "fp16":
        payload = elements * 2
    elif compression == "powersgd":
        payload = powersgd_elements(shapes, powersgd_rank) * POWERSGD_WIRES[powersgd_wire]
    else:
        payload = elements * elem_bytes
    ring = 2.0 * (world - 1) / world if world > 1 else 0.0
    return {"grad_elements": elements, "grad_bytes": elements * elem_bytes, "allreduce_payload_bytes": payload,
            "bytes_sent_per_step_ring": round(payload * ring),
            "bytes_sent_per_step_ring_uncompressed": round(elements * elem_bytes * ring)}


class StartsLate(Protocol):
    """A compression that sends plain gradients until a step (torch's PowerSGDState)."""

    iter: int
    start_powerSGD_iter: int


class Compression:
    """The gradient compression in effect and what it puts on the wire, per optimizer step."""

    def __init__(self, kind: str, shapes: list[tuple[int, ...]], world: int, powersgd_rank: int = 2,
                 state: StartsLate | None = None, from_first: bool = False, powersgd_wire: str = "float32") -> None:
        self.kind, self.state, self.from_first = kind, state, from_first
        self.volume = comm_volume(shapes, world, kind, powersgd_rank, powersgd_wire=powersgd_wire)
        # PowerSGD before its start step: fp16 (train_torch's hook; wlcommon.powersgd_start)
        self.before_start = comm_volume(shapes, world, "fp16" if kind == "powersgd" else "none")

    def compressing(self) -> bool:
        """Whether the next step's all-reduce is this compression (PowerSGD sends fp16 until its start)."""
        if self.kind == "powersgd" and self.state is not None and not self.from_first:
            return self.state.iter >= self.state.start_powerSGD_iter
        return self.kind != "none"

    def bytes_sent_ring(self) -> int:
        """Bytes this rank sends in the next step's all-reduces (ring model, comm_volume)."""
        return int((self.volume if self.compressing() else self.before_start)["bytes_sent_per_step_ring"])
