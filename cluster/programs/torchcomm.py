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

    from cluster.programs import wlcommon

    Future = torch.futures.Future[torch.Tensor]
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import wlcommon


def setup_compression(ddp: torch.nn.Module, kind: str, world: int, backend: str, powersgd_rank: int = 2,
                      powersgd_start: int = 2, done_steps: int = 0, bucket_mb: float = 0.0,
                      max_groups: int = 8, seed: int = 0, timeout_s: float = 0.0, powersgd_from_first: bool = False,
                      powersgd_wire: str = "float32") -> wlcommon.Compression:
    """Register the DDP communication hook for `kind` (none: DDP's own float32 all-reduce). `done_steps`:
    the optimizer steps a resumed run has done.

    PowerSGD on gloo with several buckets: torch's powerSGD_hook issues each bucket's second and third
    all-reduces (P, then Q) from future callbacks, so on one process group they interleave with the next
    buckets' first all-reduce in a different order on each rank, and gloo pairs collectives by order:
    "Received data size doesn't match expected size" (pytorch issue 58467), or a hang when both of
    gloo's worker threads block in such callbacks. Fix: each bucket's collectives go to a process group
    of their own (bucket i -> group i mod G, G <= max_groups), where they are issued in one fixed order
    on every rank; a group is reused only after the previous bucket on it has finished (the hook waits
    for it). Buckets still all-reduce while backward computes the next ones, which a single huge bucket
    (the other known workaround) would lose. NCCL orders collectives on its stream: one group. Before
    PowerSGD starts, every backend sends fp16 (_powersgd_hook); `powersgd_from_first`: PowerSGD instead,
    without memory (below). `powersgd_wire` bfloat16: PowerSGD's all-reduces in bfloat16 (WireCast)."""
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
    # From the first step: the steps before the start (DDP rebuilds its buckets after the first, and the
    # error feedback and warm start memories are per bucket) go through PowerSGD with a state that keeps
    # nothing (torch allows start 0 without either): rank-r updates, the same on every rank, at PowerSGD's
    # bytes, where fp16 would cost a full all-reduce each.
    def first() -> PowerSGDState:
        return psgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=0,
                                  use_error_feedback=False, warm_start=False, random_seed=seed)

    if powersgd_wire != "float32":
        WireCast.install(psgd, getattr(torch, powersgd_wire), next(ddp.parameters()).device)
    n_groups = 0  # NCCL orders collectives on its stream: the default group
    if backend == "gloo":
        elem = next(ddp.parameters()).element_size()
        cap = int((bucket_mb or 25.0) * 2**20)
        n_groups = max(1, min(max_groups, sum(math.prod(s) for s in shapes) * elem // cap + 2))
    ddp.register_comm_hook(state, _powersgd_hook(n_groups, timeout_s, first if powersgd_from_first else None))
    return wlcommon.Compression(kind, shapes, world, powersgd_rank, state, from_first=powersgd_from_first,
                                powersgd_wire=powersgd_wire)


class WireCast:
    """torch.distributed as torch's powerSGD_hook sees it, but its all-reduces cast to a narrower dtype on
    the wire and back: P, Q and the uncompressed tensors cross the network in bfloat16 (half the bytes),
    while the hook's products, orthogonalisation and error feedback stay float32 (bfloat16 keeps float32's
    range, so no gradient underflows as in fp16; its 8-bit mantissa is far finer than the rank-r
    approximation the hook sends). The hook calls `dist.all_reduce(t, group=..., async_op=True)` and reads
    `.get_future()`'s value as [t]: this gives it the same, `t` holding the sum. Installed in place of the
    hook module's `dist` for the process (a training program uses one wire); refused where that module
    does not call through a `dist` (another torch): a run would otherwise send float32 while recording
    bfloat16; and on a GPU where torch cannot make a bfloat16 tensor. Before Ampere (a GTX 10xx) torch
    emulates bfloat16 (torch.cuda.is_bf16_supported), which is all a cast needs, and NCCL builds its
    bfloat16 all-reduce for every architecture from CUDA 11 (NVIDIA/nccl src/device/generate.py)."""

    def __init__(self, real: object, dtype: torch.dtype) -> None:
        self.real, self.dtype = real, dtype

    @classmethod
    def install(cls, module: object, dtype: torch.dtype, device: torch.device | None = None) -> WireCast:
        if (device is not None and device.type == "cuda" and dtype == torch.bfloat16
                and not torch.cuda.is_bf16_supported(including_emulation=True)):
            raise RuntimeError(f"{device} cannot hold bfloat16 tensors (torch {torch.__version__}): "
                               "powersgd_wire bfloat16 cannot run here; set powersgd_wire=float32")
        real = getattr(module, "dist", None)
        if isinstance(real, WireCast):
            real = real.real
        if real is not dist:
            raise RuntimeError(f"this torch ({torch.__version__})'s powerSGD_hook does not all-reduce through "
                               "torch.distributed: powersgd_wire cannot narrow its bytes; leave it float32")
        wire = cls(real, dtype)
        setattr(module, "dist", wire)
        return wire

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None, async_op: bool = False) -> _Sent:
        work = dist.all_reduce(tensor.to(self.dtype), op, group=group, async_op=True)
        sent = _Sent(work.get_future().then(lambda f: [tensor.copy_(f.value()[0])]))
        if not async_op:
            sent.wait()
        return sent


class _Sent:
    """What WireCast.all_reduce returns: the work's future, whose value is the caller's own tensor."""

    def __init__(self, fut: torch.futures.Future[list[torch.Tensor]]) -> None:
        self.fut = fut

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self.fut

    def wait(self) -> bool:
        self.fut.wait()
        return True


def _powersgd_hook(n_groups: int, timeout_s: float,
                   first: Callable[[], PowerSGDState] | None = None) -> Callable[[PowerSGDState, GradBucket], Future]:
    """powerSGD_hook from its start step, fp16 before it (torch's hook would send float32: the same
    accuracy at twice the bytes, on the steps that are slow because nothing is compressed yet), or with
    `first` (it makes a state without memory) PowerSGD before it too: a state per group, since a state
    without warm start clears its P and Q memories when a bucket ends, under the buckets still in flight
    on other groups. With n_groups > 0 (gloo), bucket i's collectives on group i mod n_groups
    (setup_compression)."""
    from torch._C._distributed_c10d import GradBucket
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else None  # new groups don't inherit it
    groups = [dist.new_group(backend="gloo", timeout=timeout) for _ in range(n_groups)]
    inflight: dict[int, Future] = {}
    memoryless: dict[int, PowerSGDState] = {}

    def powersgd_fp16_first_hook(state: PowerSGDState, bucket: GradBucket) -> Future:
        g = bucket.index() % n_groups if groups else -1
        if g in inflight:
            inflight[g].wait()  # the group's previous bucket has issued all its collectives
        if groups:
            state.process_group = groups[g]  # read once, at the start of powerSGD_hook
        if state.iter < state.start_powerSGD_iter:
            if bucket.is_last():  # powerSGD_hook's maybe_increase_iter (untyped): one step per last bucket
                state.iter += 1
            if first is not None:
                if g not in memoryless:  # the same order of groups, so of seeds, on every rank
                    memoryless[g] = first()
                once = memoryless[g]
                once.process_group = state.process_group
                fut = psgd.powerSGD_hook(once, bucket)
            else:
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
