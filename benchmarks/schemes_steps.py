"""How many steps does each communication scheme need to the 1-node run's accuracy, and what does that
allow end to end? K data-parallel workers computed exactly in one process, no network.

    .venv/bin/python benchmarks/schemes_steps.py [--epochs 6] [--model resnet18] [--seed 0] [--only NAME,...]

Issue 26's question before any lab time: the room can beat its fastest PC to an accuracy only where a
scheme needs few enough steps at the larger global batch and costs little enough per step. Each worker is
a replica of the model on its shard of the epoch (train_torch.py's data order, learning-rate rule and
schedule); a step's collective is done on the replicas' tensors, as gloo would: `sync` averages the
gradients (plain DDP; rank 0's BatchNorm buffers, as DDP broadcasts them), `psgd` approximates them
with PowerSGD (rank r, error feedback and warm start, as torch's hook), `local` steps each replica alone
and averages the models every H steps (exactly, or the change since the last average with PowerSGD),
`one` is one worker at its own batch: the baseline. Every row: validation accuracy per epoch, the first
epoch at the target (the baseline's final accuracy minus 1 point), its steps against the baseline's, and
the floor that puts on the time ratio: steps ratio x (1 + the scheme's own compute per step / a step's
compute), both timed here on one thread. Communication is not counted, so a real room is slower than
the floor. Not a test; contacts nothing.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cluster" / "programs"))
import train_torch  # noqa: E402  (the training programs' own rules, as a node runs them)
import wlcommon  # noqa: E402
import wldata  # noqa: E402


@dataclass(frozen=True)
class Setup:
    name: str
    workers: int
    kind: str  # one | sync | psgd | local
    rank: int = 0  # psgd, local: PowerSGD's rank (local: 0 = exact averaging)
    period: int = 1  # local: steps between averagings


SETUPS = [Setup("one", 1, "one"), Setup("sync", 4, "sync"), Setup("psgd r4", 4, "psgd", 4),
          Setup("psgd r8", 4, "psgd", 8), Setup("psgd r16", 4, "psgd", 16), Setup("local H4", 4, "local", 0, 4),
          Setup("local H8", 4, "local", 0, 8), Setup("local H4, psgd r4", 4, "local", 4, 4)]


class PowerSGD:
    """PowerSGD over K workers' matrices (Vogels et al. 2019; torch's powerSGD_hook): P = mean_k M_k Q,
    orthogonalised, Q = mean_k M_k^T P, every worker takes P Q^T and keeps M_k - P Q^T (error feedback);
    Q is the next round's start (warm start). Vectors (biases, BatchNorm) are averaged exactly."""

    def __init__(self, shapes: list[torch.Size], workers: int, rank: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.rank = rank
        self.q = {i: torch.randn(math.prod(s[1:]), rank, generator=gen) for i, s in enumerate(shapes) if len(s) > 1}
        self.memory = [{i: torch.zeros(shapes[i][0], math.prod(shapes[i][1:])) for i in self.q}
                       for _ in range(workers)]
        self.seconds = 0.0  # its own compute, as one worker would do it (one worker's share of the products)

    def mean(self, tensors: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """tensors[k][i]: worker k's i-th tensor; returns the (approximated) mean of each i."""
        t0, k = time.perf_counter(), len(tensors)
        out = []
        for i in range(len(tensors[0])):
            if i not in self.q:
                out.append(torch.stack([t[i] for t in tensors]).mean(0))
                continue
            ms = [t[i].reshape(t[i].shape[0], -1) + self.memory[w][i] for w, t in enumerate(tensors)]
            p = torch.stack([m @ self.q[i] for m in ms]).mean(0)
            p = torch.linalg.qr(p).Q if self.rank > 1 else p / (p.norm() + 1e-8)
            self.q[i] = torch.stack([m.t() @ p for m in ms]).mean(0)
            approx = p @ self.q[i].t()
            for w, m in enumerate(ms):
                self.memory[w][i] = m - approx
            out.append(approx.reshape(tensors[0][i].shape))
        self.seconds += (time.perf_counter() - t0) / k
        return out


def train(setup: Setup, a: argparse.Namespace, data: wldata.Dataset) -> tuple[list[float], float, float, int]:
    """(validation accuracy per epoch, compute seconds per worker step, scheme seconds per step, steps per epoch)."""
    torch.manual_seed(a.seed)
    mean, std = data.normalization()

    def tensor(x: Any) -> torch.Tensor:
        t = (torch.from_numpy(x).float().div_(255.0) - torch.from_numpy(mean)) / torch.from_numpy(std)
        return t.permute(0, 3, 1, 2).contiguous()

    xv, yv, ytr = tensor(data.x_val), torch.from_numpy(data.y_val), torch.from_numpy(data.y_train)
    base = torchvision.models.get_model(a.model, weights=None, num_classes=data.classes)
    models = [copy.deepcopy(base) for _ in range(setup.workers)]
    peak = wlcommon.peak_lr(a.lr, setup.workers * a.batch)
    opts = [torch.optim.SGD(m.parameters(), lr=peak, momentum=0.9, weight_decay=5e-4) for m in models]
    n, k = len(data.x_train), setup.workers
    per_epoch = ((n - n % k) // k) // a.batch
    shapes = [p.shape for p in base.parameters()]
    psgd = PowerSGD(shapes, k, setup.rank, a.seed) if setup.rank else None
    anchor = [p.detach().clone() for p in base.parameters()]
    compute, step, accs = 0.0, 0, []
    for epoch in range(a.epochs):
        order = wlcommon.epoch_order(n, a.seed, epoch)
        shards = [order[wldata.shard(n, r, k)] for r in range(k)]
        for s in range(per_epoch):
            lr = wlcommon.lr_at(step, per_epoch, a.epochs, peak, 1.0, "cosine")
            t0 = time.perf_counter()
            for w, (m, o) in enumerate(zip(models, opts)):
                idx = shards[w][s * a.batch:(s + 1) * a.batch]
                o.zero_grad()
                torch.nn.functional.cross_entropy(m(tensor(data.x_train[idx])), ytr[idx]).backward()
            compute += (time.perf_counter() - t0) / k
            if setup.kind in ("sync", "psgd"):
                grads = [[p.grad for p in m.parameters() if p.grad is not None] for m in models]
                avg = psgd.mean(grads) if psgd else [torch.stack(g).mean(0) for g in zip(*grads)]
                for g in grads:
                    for mine, new in zip(g, avg):
                        mine.copy_(new)
                _copy_buffers(models, models[0])
            t0 = time.perf_counter()
            for o in opts:
                for group in o.param_groups:
                    group["lr"] = lr
                o.step()
            compute += (time.perf_counter() - t0) / k
            step += 1
            if setup.kind == "local" and (step % setup.period == 0 or s == per_epoch - 1):
                _average_models(models, anchor, psgd)
        if a.bn_recompute:  # as train_torch does before its evaluation (all of them through one model here)
            idx = order[:a.bn_recompute]
            train_torch.recompute_bn(models[0], tensor(data.x_train[idx]), a.batch, 1)
        accs.append(_accuracy(models[0], xv, yv))
        print(f"  {setup.name}: epoch {epoch + 1} accuracy {accs[-1]:.3f}", file=sys.stderr, flush=True)
    return accs, compute / step, (psgd.seconds / step if psgd else 0.0), per_epoch


def sent_per_step(setup: Setup, shapes: list[torch.Size]) -> float:
    """MB a worker sends per step in a ring all-reduce (2 (K-1)/K of the payload), float32."""
    if setup.workers == 1:
        return 0.0
    mats = [s for s in shapes if len(s) > 1]
    vectors = sum(math.prod(s) for s in shapes if len(s) <= 1)
    floats = (sum(setup.rank * (s[0] + math.prod(s[1:])) for s in mats) + vectors if setup.rank
              else sum(math.prod(s) for s in shapes))
    return floats * 4 * 2 * (setup.workers - 1) / setup.workers / setup.period / 1e6


def _copy_buffers(models: list[torch.nn.Module], source: torch.nn.Module) -> None:
    with torch.no_grad():
        for m in models:
            if m is not source:
                for mine, theirs in zip(m.buffers(), source.buffers()):
                    mine.copy_(theirs)


def _average_models(models: list[torch.nn.Module], anchor: list[torch.Tensor], psgd: PowerSGD | None) -> None:
    """Local SGD's averaging: every model becomes the anchor plus the mean change since it (PowerSGD's
    approximation of it with `psgd`); BatchNorm's running statistics averaged exactly."""
    with torch.no_grad():
        deltas = [[p - a for p, a in zip(m.parameters(), anchor)] for m in models]
        mean = psgd.mean(deltas) if psgd else [torch.stack(d).mean(0) for d in zip(*deltas)]
        for a, d in zip(anchor, mean):
            a.add_(d)
        for m in models:
            for p, a in zip(m.parameters(), anchor):
                p.copy_(a)
        for bufs in zip(*[list(m.buffers()) for m in models]):
            if bufs[0].is_floating_point():
                avg = torch.stack(bufs).float().mean(0).to(bufs[0].dtype)
                for b in bufs:
                    b.copy_(avg)


def _accuracy(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    m.eval()
    with torch.no_grad():
        right = sum(int((m(x[i:i + 256]).argmax(1) == y[i:i + 256]).sum()) for i in range(0, len(x), 256))
    m.train()
    return right / len(x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=6, help="of every row; the baseline's final accuracy sets the target")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--batch", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.01, help=f"for a global batch of {wlcommon.REF_BATCH}, scaled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bn-recompute", type=int, default=0,
                    help="BatchNorm's statistics recomputed from this many training samples before each evaluation "
                    "(the job setting bn_recompute); 0: the running averages")
    ap.add_argument("--only", default="", help="comma-separated row names (the baseline `one` always runs)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    data = wldata.load(a.dataset, seed=a.seed)
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    rows = [s for s in SETUPS if s.kind == "one" or not only or s.name in only]
    results = {s.name: train(s, a, data) for s in rows}
    base_accs, base_compute, _, base_per_epoch = results["one"]
    target = round(base_accs[-1] - 0.01, 4)
    base_epoch = next(i + 1 for i, x in enumerate(base_accs) if x >= target)
    base_steps = base_epoch * base_per_epoch
    print(f"{a.model} on {a.dataset}, batch {a.batch} per worker, {a.epochs} epochs, seed {a.seed}, bn_recompute "
          f"{a.bn_recompute}; target "
          f"{target:.3f} (one worker's final accuracy minus 1 point), reached by one worker at epoch {base_epoch} "
          f"({base_steps} steps)\n")
    print("| scheme | workers | global batch | accuracy by epoch | epoch at target | steps | steps / one's | "
          "scheme s / step compute | time ratio floor | MB sent per step |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    shapes = [p.shape for p in torchvision.models.get_model(a.model, weights=None, num_classes=data.classes).parameters()]
    for s in rows:
        accs, compute, extra, per_epoch = results[s.name]
        hit = next((i + 1 for i, x in enumerate(accs) if x >= target), None)
        steps = hit * per_epoch if hit else None
        ratio = steps / base_steps if steps else None
        over = extra / compute
        floor = f"{ratio * (1 + over) * compute / base_compute:.2f}x" if ratio else "not reached"
        print(f"| {s.name} | {s.workers} | {s.workers * a.batch} | {' '.join(f'{x:.3f}' for x in accs)} | "
              f"{hit or '-'} | {steps or '-'} | {'-' if ratio is None else f'{ratio:.2f}'} | {over:.2f} | {floor} | "
              f"{sent_per_step(s, shapes):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
