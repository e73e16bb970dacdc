"""What does PowerSGD's own compute add to a step, and can it be made cheaper? One process, a world of 1.

    .venv/bin/python benchmarks/powersgd_cost.py [--steps 20] [--cpus 1,2] [--batch 32] [--rank 4]

Issue 26: on the emulated room bench measures PowerSGD's compute at 72-91% of a half-core node's step, a
quarter of the plan's pick's step. Here ResNet18 at 32 px (digits' size), batch --batch, one torch thread,
steps timed in turn (each variant's step after the others', so a change in load hits all alike):
`no DDP` (the baseline, as train_torch runs one node), `DDP` (world of 1 on gloo: the reducer's copies),
`PowerSGD` (torch's powerSGD_hook, error feedback and warm start, as train_torch registers it),
`PowerSGD, error in place` (the same hook with the error-feedback buffers kept and reused rather than
allocated each step) and `PowerSGD, same shapes batched` (torch's batch_tensors_with_same_shape). Run on
--cpus CPUs (a process each, its affinity set before it starts): on one CPU the hook's callbacks on gloo's thread cannot
run beside backward, as on a half-core node. Not a test; contacts nothing (a FileStore, no port).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch._C._distributed_c10d import FileStore, GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP


_ERR: dict[int, torch.Tensor] = {}  # per bucket (one model uses this hook)
_COPY: dict[int, torch.Tensor] = {}


def _in_place_error(state: Any, bucket: Any) -> Any:
    """powerSGD_hook without its error feedback, which this does with buffers allocated once per bucket."""
    err, copy = _ERR, _COPY
    b, t = bucket.index(), bucket.buffer()
    if b in err and err[b].numel() == t.numel():
        t.add_(err[b])
        copy[b].copy_(t)
    else:  # the first step, or DDP rebuilt its buckets
        err[b], copy[b] = torch.zeros_like(t), t.clone()

    def after(fut: Any) -> torch.Tensor:
        out: torch.Tensor = fut.value()
        torch.sub(copy[b], out, out=err[b])
        return out
    return psgd.powerSGD_hook(state, bucket).then(after)


# DDP checks a hook's annotations against the real types (this module's are strings)
_in_place_error.__annotations__ = {"state": psgd.PowerSGDState, "bucket": GradBucket,
                                   "return": torch.futures.Future[torch.Tensor]}


def variants(rank: int) -> dict[str, Callable[[torch.nn.Module], torch.nn.Module]]:
    def hooked(hook: Callable[..., Any], **kw: Any) -> Callable[[torch.nn.Module], torch.nn.Module]:
        def wrap(m: torch.nn.Module) -> torch.nn.Module:
            d = DDP(m)
            d.register_comm_hook(psgd.PowerSGDState(None, rank, start_powerSGD_iter=2, warm_start=True, **kw), hook)
            return d
        return wrap
    return {"no DDP": lambda m: m, "DDP": DDP,
            "PowerSGD": hooked(psgd.powerSGD_hook, use_error_feedback=True),
            "PowerSGD, error in place": hooked(_in_place_error, use_error_feedback=False),
            "PowerSGD, same shapes batched": hooked(psgd.powerSGD_hook, use_error_feedback=True,
                                                    batch_tensors_with_same_shape=True)}


def measure(steps: int, batch: int, rank: int) -> dict[str, float]:
    """Median step seconds per variant, the steps taken in turn; the first 5 of each not counted."""
    models = {}
    for name, wrap in variants(rank).items():
        torch.manual_seed(0)
        m = wrap(torchvision.models.resnet18(num_classes=10))
        models[name] = (m, torch.optim.SGD(m.parameters(), lr=0.01))
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    times: dict[str, list[float]] = {k: [] for k in models}
    for i in range(steps + 5):
        for name, (m, opt) in models.items():
            t = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            if i >= 5:
                times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def rows(n: int, steps: int, batch: int, rank: int) -> None:
    """This process's table rows (it runs on n CPUs, set before it started so gloo's threads have them too)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            med = measure(steps, batch, rank)
        finally:
            dist.destroy_process_group()
    base = med["no DDP"]
    for name, s in med.items():
        print(f"| {n} | {name} | {s * 1000:.1f} | {(s - base) * 1000:+.1f} | {(s - base) / base:+.0%} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpus", default="1,2", help="CPU counts to run on, one process each")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--on", type=int, help=argparse.SUPPRESS)  # a child process on this many CPUs
    a = ap.parse_args()
    if a.on:
        rows(a.on, a.steps, a.batch, a.rank)
        return 0
    print(f"ResNet18, 32 px, batch {a.batch}, PowerSGD rank {a.rank}, 1 torch thread, median of {a.steps} "
          "steps\n\n| CPUs | variant | step ms | added ms | added / no DDP's step |\n|---:|---|---:|---:|---:|",
          flush=True)
    allowed = sorted(os.sched_getaffinity(0))
    for n in (int(c) for c in a.cpus.split(",")):
        if n > len(allowed):
            print(f"| {n} | (this machine lets the process use {len(allowed)}) | | | |")
            continue
        args = ["--on", str(n), "--steps", str(a.steps), "--batch", str(a.batch), "--rank", str(a.rank)]
        subprocess.run([sys.executable, __file__, *args], check=True, timeout=1800,
                       preexec_fn=lambda n=n: os.sched_setaffinity(0, allowed[:n]))  # type: ignore[misc]
    return 0


if __name__ == "__main__":
    sys.exit(main())
