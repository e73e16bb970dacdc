"""ResNet50 with PyTorch DistributedDataParallel: the PyTorch half of the study.

Started by torchrun on every node (RANK, WORLD_SIZE, LOCAL_RANK, ... in the
environment), or alone as one process. Writes metrics-rank<R>.jsonl per rank,
summary.json (rank 0) and a checkpoint each epoch (LOCAL_RANK 0 of every node:
nodes don't share --out, and a restart may give any node any rank) into --out;
with --resume auto (the default, which torchrun's and the head's restarts rely
on) it continues from the newest checkpoint any rank holds.

main's phases: the settings (wlcommon.parse_args), setup_process (device,
threads, process group), load_data, build_training (model, optimizer, resume,
DDP, batches, compression, start record), train_epoch per epoch, and
MetricsWriter.finish (end record, summary).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision  # type: ignore[import-untyped]  # publishes no type information
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:  # mypy reads these as the package's modules; a node has them next to this file
    from cluster.programs import torchcomm, wlcommon, wldata, wlmetrics
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torchcomm
    import wlcommon
    import wldata
    import wlmetrics


def build_model(classes: int, name: str = "resnet50") -> torch.nn.Module:
    model: torch.nn.Module = torchvision.models.get_model(name, weights=None, num_classes=classes)
    return model


def to_tensor(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    """uint8 NHWC -> normalized float NCHW (the TF program applies the same numbers in NHWC)."""
    t = torch.from_numpy(x).float().div_(255.0)
    t = (t - torch.from_numpy(mean)) / torch.from_numpy(std)
    return t.permute(0, 3, 1, 2).contiguous()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               lr: float, scaler: torch.amp.GradScaler | None = None, weight: float = 1.0,
               accumulate: int = 1) -> torch.Tensor:
    """One optimizer step; returns this rank's mean loss. DDP averages the ranks' gradients: with
    `weight` = wlcommon.loss_weight that average is the mean over the whole global batch.

    accumulate = k: x holds k micro-batches back to back; each is forward/backward on its own (the
    memory of one micro-batch), gradients add up locally under DDP's no_sync, and only the last
    backward all-reduces: one all-reduce per optimizer step, the gradient of the mean over all k."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    xs, ys = ((x,), (y,)) if accumulate == 1 else (x.chunk(accumulate), y.chunk(accumulate))
    if accumulate > 1 and len(xs) != accumulate:
        raise ValueError(f"{len(x)} samples do not split into {accumulate} micro-batches")
    losses = []
    for j, (xj, yj) in enumerate(zip(xs, ys)):
        sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if isinstance(model, DistributedDataParallel) and j < accumulate - 1:
            sync = model.no_sync()  # gradients add up locally; the last backward all-reduces
        with sync:
            with torch.autocast(device_type=xj.device.type, enabled=scaler is not None):
                loss = F.cross_entropy(model(xj), yj)
            scale = weight / accumulate
            weighted = loss * scale if scale != 1.0 else loss
            torch.autograd.backward(scaler.scale(weighted) if scaler is not None else weighted)
        losses.append(loss.detach())
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return losses[0] if accumulate == 1 else torch.stack(losses).mean()


def make_optimizer(model: torch.nn.Module, a: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay)


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int,
             world: int) -> tuple[float, float]:
    """Loss and accuracy over the whole validation split: each rank scores its shard, sums are all-reduced."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(x), batch):
            out = model(x[i:i + batch])
            sums[0] += F.cross_entropy(out, y[i:i + batch], reduction="sum").item()
            sums[1] += (out.argmax(1) == y[i:i + batch]).sum().item()
            sums[2] += len(out)
    if world > 1:
        dist.all_reduce(sums)
    model.train()
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])


def recompute_bn(model: torch.nn.Module, x: torch.Tensor, batch: int, world: int) -> None:
    """Precise BatchNorm (Wu and Johnson, "Rethinking 'Batch' in BatchNorm", 2021): every BatchNorm layer's
    running mean and variance replaced by their plain average over `x` in batches of the training's own
    size (the model in training mode, nothing learned), then averaged over the ranks. Why: the running
    averages training keeps (momentum 0.1) lag the weights where an epoch has few steps, so an evaluation
    with them measures the statistics, not the model (docs/performance.md). The checkpoint saved after the
    evaluation keeps them."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not layers or len(x) == 0:
        return
    momenta = [m.momentum for m in layers]
    for m in layers:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches below
    was = model.training
    model.train()
    with torch.no_grad():
        size = max(2, batch)  # training-mode BatchNorm needs two samples a batch
        for chunk in (x[i:i + size] for i in range(0, len(x), size)):
            if len(chunk) > 1:
                model(chunk)
    for m, momentum in zip(layers, momenta):
        m.momentum = momentum
    model.train(was)
    if world > 1:
        stats = [t for m in layers for t in (m.running_mean, m.running_var) if t is not None]
        flat = torch.cat([t.reshape(-1) for t in stats])
        dist.all_reduce(flat)
        flat /= world
        for t in stats:
            t.copy_(flat[:t.numel()].view_as(t))
            flat = flat[t.numel():]


@dataclass
class Proc:
    """Where this process stands: its ranks (torchrun's environment), its device, its backend."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device
    backend: str  # "none" when alone (and not CLUSTER_DDP_ALONE)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def distributed(self) -> bool:
        return self.backend != "none"


@dataclass
class Data:
    """The dataset and its tensors: training on the CPU, this rank's validation shard on the device."""

    ds: wldata.Dataset
    xtr: torch.Tensor
    ytr: torch.Tensor
    xva: torch.Tensor
    yva: torch.Tensor


@dataclass
class Training:
    """Everything the epochs need, built once by build_training."""

    a: argparse.Namespace
    proc: Proc
    data: Data
    model: torch.nn.Module  # the bare model: what the checkpoint holds
    ddp: torch.nn.Module  # what trains: the DDP wrapper, or the model itself when alone
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    plan: wlcommon.BatchPlan
    weight: float  # this rank's loss weight (wlcommon.loss_weight)
    comp: wlcommon.Compression
    workers: int  # loader threads
    metrics: wlmetrics.MetricsWriter
    ckpt: Path
    start_epoch: int
    step: int  # optimizer steps done, over the run
    start_acc: float | None  # the validation accuracy of the epoch it resumed after (None: fresh, or not saved)


def refused(a: argparse.Namespace) -> str | None:
    """What this program does not accept (wlcommon.parse_args)."""
    if a.accumulate < 1 or a.powersgd_rank < 1 or a.collective_timeout_s < 0 or a.bucket_mb < 0:
        return "--accumulate and --powersgd-rank must be >= 1, --collective-timeout-s and --bucket-mb >= 0"
    if a.bn_recompute < 0:
        return "--bn-recompute must be >= 0 (samples in all; 0: off)"
    return None


def setup_process(a: argparse.Namespace) -> Proc:
    """Ranks from the environment, the device, CPU threads, and the process group when distributed."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        set_threads(wlcommon.threads_per_process(a.threads, local_world))
    backend = "none"
    if world > 1:
        backend = os.environ.get("CLUSTER_BACKEND") or ("nccl" if cuda else "gloo")
        init_distributed(backend, a.collective_timeout_s)
    elif os.environ.get("CLUSTER_DDP_ALONE") == "1":  # bench: DDP and its gradient compression on one process
        backend = "gloo"  # (all-reduces of one rank move nothing: what is left is their compute cost)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0,  # type: ignore[attr-defined]
                                world_size=1)  # (documented; torch.distributed does not re-export it for mypy)
    torch.manual_seed(a.seed)
    return Proc(rank, world, local_rank, local_world, device, backend)


def load_data(a: argparse.Namespace, proc: Proc) -> Data:
    ds = wldata.open_prepared(a.data) if a.data else wldata.load(a.dataset, a.data_path, a.size, a.seed)
    mean, std = ds.normalization()
    xtr, ytr = to_tensor(ds.x_train, mean, std), torch.from_numpy(ds.y_train)
    vidx = np.arange(proc.rank, len(ds.x_val), proc.world)  # validation: every sample scored exactly once
    xva = to_tensor(ds.x_val[vidx], mean, std).to(proc.device)
    return Data(ds, xtr, ytr, xva, torch.from_numpy(ds.y_val[vidx]).to(proc.device))


def build_training(a: argparse.Namespace, proc: Proc, data: Data, metrics: wlmetrics.MetricsWriter) -> Training:
    """Model and optimizer (resumed from the newest checkpoint), DDP, every rank's batch, the gradient
    compression; writes the start record."""
    workers = wlcommon.loader_workers(a.loader_workers, proc.cuda, proc.local_world)
    amp = wlcommon.amp_wanted(a.amp, torch.cuda.get_device_capability(proc.device) if proc.cuda else None)
    model = build_model(data.ds.classes, a.model).to(proc.device)
    if proc.cuda:
        model = model.to(memory_format=torch.channels_last)
    opt = make_optimizer(model, a)
    start_epoch, step, acc, resumed = 0, 0, None, "none"
    ckpt = metrics.dir / "checkpoint.pt"
    if a.resume == "auto" and (proc.world > 1 or ckpt.exists()):  # a collective when distributed
        start_epoch, step, acc, resumed = _resume(model, opt, ckpt, proc.rank, proc.world)
    wlcommon.check_continued(a, start_epoch, acc)
    # DDP broadcasts rank 0's weights and buffers at wrap time, unless every rank holds them already
    synced = proc.distributed and same_weights(model, proc.world)
    ddp = DistributedDataParallel(model, device_ids=[proc.local_rank] if proc.cuda else None,
                                  bucket_cap_mb=a.bucket_mb or None, init_sync=not synced) if proc.distributed else model
    batch = wlcommon.my_batch(a.shares, os.environ.get("CLUSTER_NODE_NAME"), a.batch, proc.local_rank,
                              proc.local_world)
    batches = [batch]
    if proc.world > 1:  # ranks come from the rendezvous: learn every rank's batch
        batches = [0] * proc.world
        dist.all_gather_object(batches, batch)
    plan = wlcommon.plan_batches(a, batch, batches, len(data.ds.x_train))
    psgd_start = wlcommon.powersgd_start(a.powersgd_start_step, plan.steps_per_epoch, a.warmup_epochs, a.epochs)
    comp = torchcomm.setup_compression(ddp, a.grad_compression, proc.world, proc.backend, a.powersgd_rank, psgd_start,
                             step, a.bucket_mb, seed=a.seed, timeout_s=a.collective_timeout_s,
                             powersgd_from_first=a.powersgd_start_step == wlcommon.FROM_FIRST,
                             powersgd_wire=a.powersgd_wire)
    metrics.start(**wlmetrics.run_fields(a, data.ds, plan, start_epoch, world=proc.world, local_rank=proc.local_rank,
                                         device=str(proc.device), amp=amp, start_step=step),
                  torch=torch.__version__, threads=torch.get_num_threads(),
                  interop_threads=torch.get_num_interop_threads(), loader_workers=workers, backend=proc.backend,
                  resumed_from=resumed, weights_sent=proc.distributed and not synced,
                  collective_timeout_s=a.collective_timeout_s, **wlmetrics.compression_fields(comp, a, psgd_start),
                  **plan.start_fields(), bucket_mb=a.bucket_mb or 25.0, bn_recompute=a.bn_recompute, **comp.volume)
    return Training(a, proc, data, model, ddp, opt, torch.amp.GradScaler("cuda") if amp else None, plan,
                    wlcommon.loss_weight(batches, proc.rank), comp, workers, metrics, ckpt, start_epoch, step, acc)


def train_epoch(t: Training, epoch: int) -> float:
    """One epoch's steps, its evaluation and its record (returns its validation accuracy); then LOCAL_RANK 0
    of every node saves the checkpoint (all ranks hold the same model and optimizer state after the step's
    all-reduce)."""
    a, proc, data, plan = t.a, t.proc, t.data, t.plan
    order = wlcommon.epoch_order(len(data.xtr), a.seed, epoch)
    mine = order[wldata.shard(len(order), proc.rank, proc.world)]

    def gather(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(order[wlcommon.batch_slice(i, plan.step_batches, proc.rank)])
        x, y = data.xtr[idx], data.ytr[idx]
        return (x.pin_memory(), y.pin_memory()) if proc.cuda else (x, y)

    feed = iter(wldata.Prefetcher(gather, plan.steps_per_epoch, t.workers))

    def fetch() -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(feed)
        x, y = x.to(proc.device, non_blocking=True), y.to(proc.device, non_blocking=True)
        return (x.contiguous(memory_format=torch.channels_last), y) if proc.cuda else (x, y)

    def train(batch: tuple[torch.Tensor, torch.Tensor], lr: float) -> wlmetrics.StepOutcome:
        x, y = batch
        sent = t.comp.bytes_sent_ring()
        loss = train_step(t.ddp, t.opt, x, y, lr, t.scaler, t.weight, plan.accumulate)
        return wlmetrics.StepOutcome(loss.item(), len(y), sent)  # item(): waits for the step and its all-reduce

    t.step, tally = wlmetrics.run_steps(t.metrics, plan, a.log_every, epoch, t.step, fetch, train)
    train_loss = torch.tensor([tally.loss_sum, tally.samples], dtype=torch.float64)
    if proc.world > 1:
        dist.all_reduce(train_loss)
    if a.bn_recompute:
        idx = torch.from_numpy(mine[:wlcommon.bn_samples(a.bn_recompute, proc.world)])
        recompute_bn(t.model, data.xtr[idx].to(proc.device), plan.batch, proc.world)
    val_loss, val_acc = evaluate(t.ddp, data.xva, data.yva, 256, proc.world)
    scores = wlmetrics.EpochScores(float(train_loss[0] / train_loss[1]), _train_acc(t, mine), val_loss, val_acc)
    t.metrics.epoch(epoch, t.step, tally, plan, scores, tally.mean_bytes_sent(plan.steps_per_epoch))
    if proc.local_rank == 0:  # each node's own disk: whichever node survives a failure can resume
        _save(t.model, t.opt, epoch, t.step, t.ckpt, val_acc)
    return val_acc


def main(argv: list[str] | None = None) -> int:
    a = wlcommon.parse_args(__doc__, argv, refused)
    cpu = wlmetrics.CpuMeter()
    proc = setup_process(a)
    metrics = wlmetrics.MetricsWriter(Path(a.out), proc.rank, "pytorch")
    t = build_training(a, proc, load_data(a, proc), metrics)
    epoch, acc = t.start_epoch, t.start_acc
    while wlcommon.trains(a, epoch, acc):
        t.plan = t.plan.lasting(max(a.epochs, epoch + 1))
        acc = train_epoch(t, epoch)
        epoch += 1
    metrics.finish(a, t.data.ds, proc.world, t.plan, epoch - t.start_epoch, t.step, cpu, acc)
    if proc.distributed:
        dist.destroy_process_group()
    return 0


def set_threads(threads: int) -> None:
    """Intra-op and inter-op pools both from `threads`, as train_tf.py does, so at threads=N the two
    frameworks get the same CPU budget. The inter-op pool can only be sized before it first runs."""
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already started (a second main() in one process): keep its size
        pass


def init_distributed(backend: str, timeout_s: float) -> None:
    """The default process group, with a collective timeout: a collective that waits longer than
    timeout_s for a peer (dead, frozen, cut off) raises instead of hanging, so the process exits
    non-zero and torchrun / the launcher see the failure. NCCL only enforces it from its watchdog
    thread with async error handling on (TearDown: the watchdog aborts the communicator and ends the
    process); torchrun sets that, a process started by hand would not."""
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else None)


def _train_acc(t: Training, mine: np.ndarray) -> float:
    """Accuracy on (up to) TRAIN_ACC_SAMPLES of this epoch's training samples, each rank scoring its share
    of them (wlcommon.train_acc_samples) in eval mode, all-reduced."""
    idx = torch.from_numpy(mine[:wlcommon.train_acc_samples(t.proc.world)])
    dev = t.proc.device
    _, acc = evaluate(t.ddp, t.data.xtr[idx].to(dev), t.data.ytr[idx].to(dev), 256, t.proc.world)
    return acc


def _save(model: torch.nn.Module, opt: torch.optim.Optimizer, epoch: int, step: int, path: Path,
          val_acc: float | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "step": step,
                "val_acc": val_acc}, tmp)
    os.replace(tmp, path)  # a crash mid-save never leaves a half checkpoint


def _resume(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path, rank: int,
            world: int) -> tuple[int, int, float | None, str]:
    """The newest checkpoint any rank holds (nodes don't share disks, and a c10d rendezvous or the head's
    restart after a node died may give rank 0 to another node), read by every rank: (start epoch, step,
    the validation accuracy it saved (None in a checkpoint older than that), where it came from: "none",
    "each" or "rank R").

    Every rank joins the all-gather, with or without a file: its (epoch, step); the source is
    wlcommon.resume_source's (the ranks of one node read the same file). Where every rank holds that same
    save point (every node saves each epoch: a restart of the same nodes, a `launch --continue`), each reads
    its own; else the source's is handed to every rank (model and momentum: 90 MB for ResNet18, 38 s to 3
    peers on a 57 Mbit/s link). A file that cannot be read (_read_checkpoint) counts as none: that rank
    receives the source's. No readable file anywhere: a fresh start (0, 0) on every rank."""
    state = _read_checkpoint(path)
    source = "none" if state is None else "each"
    if world > 1:
        held: list[tuple[int, int]] = [(-1, -1)] * world
        dist.all_gather_object(held, (int(state["epoch"]), int(state["step"])) if state else (-1, -1))
        src, source = wlcommon.resume_source(held)
        if source == "none":
            state = None
        elif source != "each":
            box = [state if rank == src else None]
            dist.broadcast_object_list(box, src=src)
            state = box[0]
    if state is None:
        return 0, 0, None, source
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    acc = state.get("val_acc")
    return int(state["epoch"]) + 1, int(state["step"]), None if acc is None else float(acc), source


def _read_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at `path`; None where there is none, or where it cannot be read (damaged, not a
    checkpoint of this program: wlcommon.unreadable_checkpoint says why, the resume takes another rank's)."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(state, dict) or not {"model", "optimizer", "epoch", "step"} <= state.keys():
            raise ValueError("it holds no model, optimizer, epoch and step")
    except Exception as e:  # noqa: BLE001 - torch.load raises whatever pickle, zipfile or the storage raise
        wlcommon.unreadable_checkpoint(path, e, "rank")
        return None
    return state


def same_weights(model: torch.nn.Module, world: int) -> bool:
    """Whether every rank holds the same parameters and buffers (the same seed builds the same model on the
    identical environments provision verified; every rank resumed the same checkpoint): a digest of each
    compared, 64 bytes a rank, where DDP would broadcast rank 0's whole model (45 MB for ResNet18: 20 s to 3
    peers on a 57 Mbit/s link). Different digests: DDP's broadcast, as always."""
    h = hashlib.sha256()
    for t in [*model.parameters(), *model.buffers()]:
        h.update(repr((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    digests: list[str] = [""] * world
    dist.all_gather_object(digests, h.hexdigest())
    return len(set(digests)) == 1


if __name__ == "__main__":
    sys.exit(main())
