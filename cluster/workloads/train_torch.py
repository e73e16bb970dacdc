"""ResNet50 with PyTorch DistributedDataParallel: the PyTorch half of the study.

Started by torchrun on every node (RANK, WORLD_SIZE, LOCAL_RANK, ... in the
environment), or alone as one process. Writes metrics-rank<R>.jsonl per rank,
summary.json and a checkpoint each epoch (rank 0) into --out; with --resume auto
(the default, which torchrun's restarts rely on) it continues from the checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wlcommon  # noqa: E402
import wldata  # noqa: E402
import wlmetrics  # noqa: E402


def build_model(classes: int, name: str = "resnet50") -> torch.nn.Module:
    return torchvision.models.get_model(name, weights=None, num_classes=classes)


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
    xs, ys = (x, y) if accumulate == 1 else (x.chunk(accumulate), y.chunk(accumulate))
    if accumulate > 1 and len(xs) != accumulate:
        raise ValueError(f"{len(x)} samples do not split into {accumulate} micro-batches")
    losses = []
    for j in range(accumulate):
        xj, yj = (xs, ys) if accumulate == 1 else (xs[j], ys[j])
        last = j == accumulate - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with torch.autocast(device_type=xj.device.type, enabled=scaler is not None):
                loss = F.cross_entropy(model(xj), yj)
            scale = weight / accumulate
            weighted = loss * scale if scale != 1.0 else loss
            if scaler is not None:
                scaler.scale(weighted).backward()
            else:
                weighted.backward()
        losses.append(loss.detach())
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return losses[0] if accumulate == 1 else torch.stack(losses).mean()


class Compression:
    """The gradient compression in effect on a DDP model and what it puts on the wire."""

    def __init__(self, kind: str, shapes: list[tuple[int, ...]], world: int, powersgd_rank: int,
                 state: object | None = None) -> None:
        self.kind, self.state = kind, state
        self.volume = wlcommon.comm_volume(shapes, world, kind, powersgd_rank)
        self.plain = wlcommon.comm_volume(shapes, world, "none")

    def compressing(self) -> bool:
        """Whether the next step's all-reduce is compressed (PowerSGD runs plain until its start step)."""
        if self.kind == "powersgd":
            return self.state.iter >= self.state.start_powerSGD_iter  # type: ignore[attr-defined]
        return self.kind != "none"

    def bytes_sent_ring(self) -> int:
        """Bytes this rank sends in the next step's all-reduces (ring model, wlcommon.comm_volume)."""
        return int((self.volume if self.compressing() else self.plain)["bytes_sent_per_step_ring"])


def setup_compression(ddp: torch.nn.Module, kind: str, world: int, backend: str, powersgd_rank: int = 2,
                      powersgd_start: int = 2, done_steps: int = 0, bucket_mb: float = 0.0,
                      max_groups: int = 8, seed: int = 0, timeout_s: float = 0.0) -> Compression:
    """Register the DDP communication hook for `kind` (none: DDP's own float32 all-reduce).

    PowerSGD on gloo with several buckets: torch's powerSGD_hook issues each bucket's second and third
    all-reduces (P, then Q) from future callbacks, so on one process group they interleave with the next
    buckets' first all-reduce in a different order on each rank, and gloo pairs collectives by order:
    "Received data size doesn't match expected size" (pytorch issue 58467), or a hang when both of
    gloo's worker threads block in such callbacks. Fix: each bucket's collectives go to a process group
    of their own (bucket i -> group i mod G, G <= max_groups), where they are issued in one fixed order
    on every rank; a group is reused only after the previous bucket on it has finished (the hook waits
    for it). Buckets still all-reduce while backward computes the next ones, which a single huge bucket
    (the other known workaround) would lose. NCCL orders collectives on its stream: the stock hook."""
    shapes = [tuple(p.shape) for p in ddp.parameters() if p.requires_grad]
    if kind == "none" or world == 1:
        return Compression(kind if world > 1 else "none", shapes, world, powersgd_rank)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return Compression(kind, shapes, world, powersgd_rank)
    if kind != "powersgd":
        raise ValueError(f"unknown gradient compression {kind!r}")
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                               start_powerSGD_iter=powersgd_start, use_error_feedback=True, warm_start=True,
                               random_seed=seed)
    # resumed: the first step runs plain (DDP rebuilds its buckets after it), then compression continues
    state.iter = min(done_steps, powersgd_start - 1)
    if backend != "gloo":
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return Compression(kind, shapes, world, powersgd_rank, state)
    elem = next(ddp.parameters()).element_size()
    cap = int((bucket_mb or 25.0) * 2**20)
    n_groups = max(1, min(max_groups, sum(math.prod(s) for s in shapes) * elem // cap + 2))
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s > 0 else {}  # new groups
    groups = [dist.new_group(backend="gloo", **kwargs) for _ in range(n_groups)]  # don't inherit it
    inflight: dict[int, torch.futures.Future] = {}

    def ordered_powersgd_hook(state: psgd.PowerSGDState,
                              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        g = bucket.index() % n_groups
        if g in inflight:
            inflight[g].wait()  # the group's previous bucket has issued all its collectives
        state.process_group = groups[g]  # read once, at the start of powerSGD_hook
        fut = psgd.powerSGD_hook(state, bucket)
        inflight[g] = fut
        return fut

    # DDP checks the hook's annotations against the real types (this module's are strings)
    ordered_powersgd_hook.__annotations__ = {"state": psgd.PowerSGDState, "bucket": dist.GradBucket,
                                             "return": torch.futures.Future[torch.Tensor]}
    ddp.register_comm_hook(state, ordered_powersgd_hook)
    return Compression(kind, shapes, world, powersgd_rank, state)


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    wlcommon.add_args(ap)
    a = ap.parse_args(argv)
    if a.accumulate < 1 or a.powersgd_rank < 1 or a.collective_timeout_s < 0 or a.bucket_mb < 0:
        ap.error("--accumulate and --powersgd-rank must be >= 1, --collective-timeout-s and --bucket-mb >= 0")
    cpu = wlmetrics.CpuMeter()
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
    torch.manual_seed(a.seed)
    out = Path(a.out)
    metrics = wlmetrics.MetricsWriter(out, rank, "pytorch")

    ds = wldata.open_prepared(a.data) if a.data else wldata.load(a.dataset, a.data_path, a.size, a.seed)
    mean, std = ds.normalization()
    xtr, ytr = to_tensor(ds.x_train, mean, std), torch.from_numpy(ds.y_train)
    vidx = np.arange(rank, len(ds.x_val), world)  # validation: every sample scored exactly once
    xva, yva = to_tensor(ds.x_val[vidx], mean, std).to(device), torch.from_numpy(ds.y_val[vidx]).to(device)

    workers = wlcommon.loader_workers(a.loader_workers, cuda, local_world)
    cc = torch.cuda.get_device_capability(device) if cuda else None
    amp = wlcommon.amp_wanted(a.amp, cc)
    model = build_model(ds.classes, a.model).to(device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    opt = make_optimizer(model, a)
    start_epoch, step = 0, 0
    ckpt = out / "checkpoint.pt"
    if a.resume == "auto" and (world > 1 or ckpt.exists()):  # a collective when distributed
        start_epoch, step = _resume(model, opt, ckpt, rank, world)
    # DDP broadcasts rank 0's weights and buffers at wrap time
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None,
                                                    bucket_cap_mb=a.bucket_mb or None) if world > 1 else model
    scaler = torch.amp.GradScaler("cuda") if amp else None

    batch = wlcommon.my_batch(a.shares, os.environ.get("CLUSTER_NODE_NAME"), a.batch, local_rank, local_world)
    batches = [batch]
    if world > 1:  # ranks come from the rendezvous: learn every rank's batch
        batches = [0] * world
        dist.all_gather_object(batches, batch)
    k = a.accumulate
    micro_global, weight = sum(batches), wlcommon.loss_weight(batches, rank)
    global_batch = k * micro_global  # samples per optimizer step
    steps_per_epoch = len(ds.x_train) // global_batch
    if a.max_steps:
        steps_per_epoch = min(steps_per_epoch, a.max_steps)
    peak = wlcommon.peak_lr(a.lr, global_batch)
    psgd_start = wlcommon.powersgd_start(a.powersgd_start_step, steps_per_epoch, a.warmup_epochs)
    comp = setup_compression(ddp, a.grad_compression, world, backend, a.powersgd_rank, psgd_start, step,
                             a.bucket_mb, seed=a.seed, timeout_s=a.collective_timeout_s)
    metrics.start(world=world, local_rank=local_rank, device=str(device), amp=amp, dataset=ds.name,
                  synthetic=ds.synthetic, train_samples=len(ds.x_train), val_samples=len(ds.x_val),
                  batch=batch, batches=batches, global_batch=global_batch, steps_per_epoch=steps_per_epoch, epochs=a.epochs,
                  peak_lr=peak, momentum=a.momentum, weight_decay=a.weight_decay, schedule=a.schedule,
                  warmup_epochs=a.warmup_epochs, start_epoch=start_epoch, torch=torch.__version__,
                  threads=torch.get_num_threads(), interop_threads=torch.get_num_interop_threads(),
                  loader_workers=workers, backend=backend, collective_timeout_s=a.collective_timeout_s,
                  grad_compression=comp.kind, powersgd_rank=a.powersgd_rank if comp.kind == "powersgd" else None,
                  powersgd_start_step=psgd_start if comp.kind == "powersgd" else None, accumulate=k,
                  micro_batch=batch, micro_global_batch=micro_global, lr_scaled_for_batch=global_batch,
                  bucket_mb=a.bucket_mb or 25.0, **comp.volume)
    def gather(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(idx)
        x, y = xtr[t], ytr[t]
        return (x.pin_memory(), y.pin_memory()) if cuda else (x, y)

    history = []
    run_start = time.time()
    for epoch in range(start_epoch, a.epochs):
        order = wlcommon.epoch_order(len(ds.x_train), a.seed, epoch)
        mine = order[wldata.shard(len(order), rank, world)]
        ep_start = time.perf_counter()
        tot_loss, seen, data_s, comp_s, sent = 0.0, 0, 0.0, 0.0, 0
        ep_cpu = wlmetrics.CpuMeter()
        step_batches = [k * b for b in batches]  # a rank's k micro-batches: consecutive in the order
        feed = iter(wlcommon.Prefetcher(lambda i: gather(order[wlcommon.batch_slice(i, step_batches, rank)]),
                                        steps_per_epoch, workers))
        for i in range(steps_per_epoch):
            t0 = time.perf_counter()
            x, y = next(feed)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if cuda:
                x = x.contiguous(memory_format=torch.channels_last)
            t1 = time.perf_counter()
            lr = wlcommon.lr_at(step, steps_per_epoch, a.epochs, peak, a.warmup_epochs, a.schedule)
            step_sent = comp.bytes_sent_ring()
            loss = train_step(ddp, opt, x, y, lr, scaler, weight, k)
            loss_v = loss.item()  # waits for the step (and its all-reduce) to finish
            t2 = time.perf_counter()
            data_s, comp_s = data_s + t1 - t0, comp_s + t2 - t1
            tot_loss, seen, sent = tot_loss + loss_v * len(y), seen + len(y), sent + step_sent
            step += 1
            if step % a.log_every == 0 or i == steps_per_epoch - 1 or i == 0:  # first: the run is up
                metrics.step(epoch, step, loss_v, lr, global_batch, t0, t1, t2, bytes_sent_ring=step_sent)
        ep_cpu_use = ep_cpu.read()  # the training steps' CPU use, before evaluation
        train_loss = torch.tensor([tot_loss, seen], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(train_loss)
        ep_s = time.perf_counter() - ep_start
        val_loss, val_acc = evaluate(ddp, xva, yva, 256, world)
        tr_loss_all, tr_acc = float(train_loss[0] / train_loss[1]), _train_acc(ddp, xtr, ytr, mine, device, world)
        rec = metrics.write("epoch", epoch=epoch, step=step, train_loss=tr_loss_all, train_acc=tr_acc,
                            val_loss=val_loss, val_acc=val_acc, epoch_s=round(ep_s, 3),
                            images_per_s=round(steps_per_epoch * global_batch / ep_s, 2),
                            data_s=round(data_s, 3), compute_s=round(comp_s, 3),
                            bytes_sent_per_step_ring=round(sent / max(1, steps_per_epoch)), **ep_cpu_use,
                            **wlmetrics.system_sample())
        history.append(rec)
        if rank == 0:
            _save(model, opt, epoch, step, ckpt)
    metrics.write("end", epochs_done=a.epochs - start_epoch, step=step, wall_s=round(time.time() - run_start, 3),
                  **cpu.read())
    if rank == 0:
        wlmetrics.write_summary(out, wlmetrics.summary("pytorch", a, world, steps_per_epoch, history,
                                                       time.time() - run_start, ds))
    metrics.close()
    if world > 1:
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
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s > 0 else {}
    dist.init_process_group(backend, **kwargs)


def _train_acc(model, xtr, ytr, mine, device, world) -> float:
    """Accuracy on (up to) 512 of this epoch's training samples per rank, in eval mode, all-reduced."""
    idx = torch.from_numpy(mine[:512])
    _, acc = evaluate(model, xtr[idx].to(device), ytr[idx].to(device), 256, world)
    return acc


def _save(model: torch.nn.Module, opt: torch.optim.Optimizer, epoch: int, step: int, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "step": step}, tmp)
    os.replace(tmp, path)  # a crash mid-save never leaves a half checkpoint


def _resume(model, opt, path: Path, rank: int, world: int) -> tuple[int, int]:
    """The newest checkpoint any rank holds (nodes don't share disks, and a c10d rendezvous after a
    restart may give rank 0 to another node) is read there and handed to every rank."""
    state = torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None
    src = 0
    if world > 1:
        epochs = [None] * world
        dist.all_gather_object(epochs, state["epoch"] if state else -1)
        src = max(range(world), key=lambda r: (epochs[r], -r))
        box = [state if rank == src else None]
        dist.broadcast_object_list(box, src=src)
        state = box[0]
    if state is None:
        return 0, 0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return state["epoch"] + 1, state["step"]


if __name__ == "__main__":
    sys.exit(main())
