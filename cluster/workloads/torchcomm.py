"""DDP's gradient compression for the PyTorch program: the communication hooks it registers (fp16,
PowerSGD with fp16 before its start step) and what each sends. Runs on the nodes next to train_torch.py."""
from __future__ import annotations

import datetime
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:  # mypy reads these as the package's modules; a node has them next to this file
    from torch._C._distributed_c10d import GradBucket
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from cluster.workloads import wlcommon

    Future = torch.futures.Future[torch.Tensor]
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import wlcommon


def setup_compression(ddp: torch.nn.Module, kind: str, world: int, backend: str, powersgd_rank: int = 2,
                      powersgd_start: int = 2, done_steps: int = 0, bucket_mb: float = 0.0,
                      max_groups: int = 8, seed: int = 0, timeout_s: float = 0.0) -> wlcommon.Compression:
    """Register the DDP communication hook for `kind` (none: DDP's own float32 all-reduce).

    PowerSGD on gloo with several buckets: torch's powerSGD_hook issues each bucket's second and third
    all-reduces (P, then Q) from future callbacks, so on one process group they interleave with the next
    buckets' first all-reduce in a different order on each rank, and gloo pairs collectives by order:
    "Received data size doesn't match expected size" (pytorch issue 58467), or a hang when both of
    gloo's worker threads block in such callbacks. Fix: each bucket's collectives go to a process group
    of their own (bucket i -> group i mod G, G <= max_groups), where they are issued in one fixed order
    on every rank; a group is reused only after the previous bucket on it has finished (the hook waits
    for it). Buckets still all-reduce while backward computes the next ones, which a single huge bucket
    (the other known workaround) would lose. NCCL orders collectives on its stream: one group. Before
    PowerSGD starts, every backend sends fp16 (_powersgd_hook)."""
    shapes = [tuple(p.shape) for p in ddp.parameters() if p.requires_grad]
    if kind == "none" or (world == 1 and not isinstance(ddp, DistributedDataParallel)):
        return wlcommon.Compression(kind if world > 1 else "none", shapes, world, powersgd_rank)
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError("gradient compression needs a DistributedDataParallel model")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return wlcommon.Compression(kind, shapes, world, powersgd_rank)
    if kind != "powersgd":
        raise ValueError(f"unknown gradient compression {kind!r}")
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                               start_powerSGD_iter=powersgd_start, use_error_feedback=True, warm_start=True,
                               random_seed=seed)
    # resumed: the first step runs uncompressed by PowerSGD (DDP rebuilds its buckets after it), then it continues
    state.iter = min(done_steps, powersgd_start - 1)
    n_groups = 0  # NCCL orders collectives on its stream: the default group
    if backend == "gloo":
        elem = next(ddp.parameters()).element_size()
        cap = int((bucket_mb or 25.0) * 2**20)
        n_groups = max(1, min(max_groups, sum(math.prod(s) for s in shapes) * elem // cap + 2))
    ddp.register_comm_hook(state, _powersgd_hook(n_groups, timeout_s))
    return wlcommon.Compression(kind, shapes, world, powersgd_rank, state)


def _powersgd_hook(n_groups: int, timeout_s: float) -> Callable[[PowerSGDState, GradBucket], Future]:
    """powerSGD_hook from its start step, fp16 before it (torch's hook would send float32: the same
    accuracy at twice the bytes, on the steps that are slow because nothing is compressed yet). With
    n_groups > 0 (gloo), bucket i's collectives on group i mod n_groups (setup_compression)."""
    from torch._C._distributed_c10d import GradBucket
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else None  # new groups don't inherit it
    groups = [dist.new_group(backend="gloo", timeout=timeout) for _ in range(n_groups)]
    inflight: dict[int, Future] = {}

    def powersgd_fp16_first_hook(state: PowerSGDState, bucket: GradBucket) -> Future:
        g = bucket.index() % n_groups if groups else -1
        if g in inflight:
            inflight[g].wait()  # the group's previous bucket has issued all its collectives
        if groups:
            state.process_group = groups[g]  # read once, at the start of powerSGD_hook
        if state.iter < state.start_powerSGD_iter:
            if bucket.is_last():  # powerSGD_hook's maybe_increase_iter (untyped): one step per last bucket
                state.iter += 1
            fut = default_hooks.fp16_compress_hook(state.process_group, bucket)
        else:
            fut = psgd.powerSGD_hook(state, bucket)  # by module attribute: tests wrap it
        if groups:
            inflight[g] = fut
        return fut

    # DDP checks the hook's annotations against the real types (this module's are strings)
    powersgd_fp16_first_hook.__annotations__ = {"state": psgd.PowerSGDState, "bucket": GradBucket,
                                                "return": torch.futures.Future[torch.Tensor]}
    return powersgd_fp16_first_hook
