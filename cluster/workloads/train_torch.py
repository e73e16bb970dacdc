"""ResNet50 with PyTorch DistributedDataParallel: the PyTorch half of the study.

Started by torchrun on every node (RANK, WORLD_SIZE, LOCAL_RANK, ... in the
environment), or alone as one process. Writes metrics-rank<R>.jsonl per rank,
summary.json and a checkpoint each epoch (rank 0) into --out; with --resume auto
(the default, which torchrun's restarts rely on) it continues from the checkpoint.
"""
from __future__ import annotations

import argparse
import datetime
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


def build_model(classes: int) -> torch.nn.Module:
    return torchvision.models.resnet50(weights=None, num_classes=classes)


def to_tensor(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    """uint8 NHWC -> normalized float NCHW (the TF program applies the same numbers in NHWC)."""
    t = torch.from_numpy(x).float().div_(255.0)
    t = (t - torch.from_numpy(mean)) / torch.from_numpy(std)
    return t.permute(0, 3, 1, 2).contiguous()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               lr: float, scaler: torch.amp.GradScaler | None = None, weight: float = 1.0) -> torch.Tensor:
    """One optimizer step; returns this rank's mean loss. DDP averages the ranks' gradients: with
    `weight` = wlcommon.loss_weight that average is the mean over the whole global batch."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device_type=x.device.type, enabled=scaler is not None):
        loss = F.cross_entropy(model(x), y)
    weighted = loss * weight if weight != 1.0 else loss
    if scaler is not None:
        scaler.scale(weighted).backward()
        scaler.step(opt)
        scaler.update()
    else:
        weighted.backward()
        opt.step()
    return loss.detach()


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
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(wlcommon.threads_per_process(a.threads, local_world))
    if world > 1:
        backend = os.environ.get("CLUSTER_BACKEND") or ("nccl" if cuda else "gloo")
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
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
    model = build_model(ds.classes).to(device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    opt = make_optimizer(model, a)
    start_epoch, step = 0, 0
    ckpt = out / "checkpoint.pt"
    if a.resume == "auto" and (world > 1 or ckpt.exists()):  # a collective when distributed
        start_epoch, step = _resume(model, opt, ckpt, rank, world)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None) \
        if world > 1 else model  # DDP broadcasts rank 0's weights and buffers at wrap time
    scaler = torch.amp.GradScaler("cuda") if amp else None

    batch = wlcommon.my_batch(a.shares, os.environ.get("CLUSTER_NODE_NAME"), a.batch, local_rank, local_world)
    batches = [batch]
    if world > 1:  # ranks come from the rendezvous: learn every rank's batch
        batches = [0] * world
        dist.all_gather_object(batches, batch)
    global_batch, weight = sum(batches), wlcommon.loss_weight(batches, rank)
    steps_per_epoch = len(ds.x_train) // global_batch
    if a.max_steps:
        steps_per_epoch = min(steps_per_epoch, a.max_steps)
    peak = wlcommon.peak_lr(a.lr, global_batch)
    metrics.start(world=world, local_rank=local_rank, device=str(device), amp=amp, dataset=ds.name,
                  synthetic=ds.synthetic, train_samples=len(ds.x_train), val_samples=len(ds.x_val),
                  batch=batch, batches=batches, global_batch=global_batch, steps_per_epoch=steps_per_epoch, epochs=a.epochs,
                  peak_lr=peak, momentum=a.momentum, weight_decay=a.weight_decay, schedule=a.schedule,
                  warmup_epochs=a.warmup_epochs, start_epoch=start_epoch, torch=torch.__version__,
                  threads=torch.get_num_threads(), loader_workers=workers)
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
        tot_loss, seen, data_s, comp_s = 0.0, 0, 0.0, 0.0
        feed = iter(wlcommon.Prefetcher(lambda i: gather(order[wlcommon.batch_slice(i, batches, rank)]),
                                        steps_per_epoch, workers))
        for i in range(steps_per_epoch):
            t0 = time.perf_counter()
            x, y = next(feed)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if cuda:
                x = x.contiguous(memory_format=torch.channels_last)
            t1 = time.perf_counter()
            lr = wlcommon.lr_at(step, steps_per_epoch, a.epochs, peak, a.warmup_epochs, a.schedule)
            loss = train_step(ddp, opt, x, y, lr, scaler, weight)
            loss_v = loss.item()  # waits for the step (and its all-reduce) to finish
            t2 = time.perf_counter()
            data_s, comp_s = data_s + t1 - t0, comp_s + t2 - t1
            tot_loss, seen = tot_loss + loss_v * len(y), seen + len(y)
            step += 1
            if step % a.log_every == 0 or i == steps_per_epoch - 1 or i == 0:  # first: the run is up
                metrics.step(epoch, step, loss_v, lr, global_batch, t0, t1, t2)
        train_loss = torch.tensor([tot_loss, seen], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(train_loss)
        ep_s = time.perf_counter() - ep_start
        val_loss, val_acc = evaluate(ddp, xva, yva, 256, world)
        tr_loss_all, tr_acc = float(train_loss[0] / train_loss[1]), _train_acc(ddp, xtr, ytr, mine, device, world)
        rec = metrics.write("epoch", epoch=epoch, step=step, train_loss=tr_loss_all, train_acc=tr_acc,
                            val_loss=val_loss, val_acc=val_acc, epoch_s=round(ep_s, 3),
                            images_per_s=round(steps_per_epoch * global_batch / ep_s, 2),
                            data_s=round(data_s, 3), compute_s=round(comp_s, 3), **wlmetrics.system_sample())
        history.append(rec)
        if rank == 0:
            _save(model, opt, epoch, step, ckpt)
    metrics.write("end", epochs_done=a.epochs - start_epoch, step=step, wall_s=round(time.time() - run_start, 3))
    if rank == 0:
        wlmetrics.write_summary(out, wlmetrics.summary("pytorch", a, world, steps_per_epoch, history,
                                                       time.time() - run_start, ds))
    metrics.close()
    if world > 1:
        dist.destroy_process_group()
    return 0


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
