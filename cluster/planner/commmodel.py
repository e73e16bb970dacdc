"""What a training step costs on the wire, per communication scheme (docs/planning.md "Communication").

A scheme is the job's `grad_compression` x `powersgd_rank` x `accumulate` (PowerSGD: x `powersgd_wire`, both
weighed).
Bytes come from the model's real parameter shapes (wlcommon.comm_volume, the figure the training programs
record); time from the link bench measured (latency per all-reduce + seconds per byte each rank sends);
overlap from DDP's buckets: gradients all-reduce while backward still computes, all but the last bucket.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.runs import datasets, jobs
from cluster.errors import ClusterError
from cluster.programs import wlcommon

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket (the last layers' gradients) is 1 MiB
BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb
BACKWARD_SHARE = 2 / 3  # of the per-sample compute: backward does about twice the forward's FLOPs
LARGE_BATCH = 1024  # effective global batches above this may need more epochs for the same accuracy
FEW_STEPS = 20  # optimizer steps per epoch below this: the same epochs make fewer updates

RESNETS = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet34": ("basic", (3, 4, 6, 3)),
           "resnet50": ("bottleneck", (3, 4, 6, 3)), "resnet101": ("bottleneck", (3, 4, 23, 3)),
           "resnet152": ("bottleneck", (3, 8, 36, 3))}
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Scheme:
    """How a job's gradients cross the network: compression and micro-batches per all-reduce."""

    grad_compression: str = "none"
    powersgd_rank: int = 2
    accumulate: int = 1
    powersgd_wire: str = "float32"  # with powersgd: the dtype of its all-reduces (wlcommon.POWERSGD_WIRES)

    def label(self) -> str:
        c = (f"powersgd r{self.powersgd_rank}" + (" bf16" if self.powersgd_wire == "bfloat16" else "")
             if self.grad_compression == "powersgd" else self.grad_compression)
        return c + (f" x{self.accumulate}" if self.accumulate > 1 else "")


@dataclass(frozen=True)
class Link:
    """The network as bench measured it: a fixed cost per all-reduce and a cost per byte a rank sends."""

    latency_s: float
    per_byte_s: float


def _resnet(kind: str, blocks: tuple[int, ...], classes: int) -> list[Shape]:
    """torchvision's ResNet parameters in registration order (conv weights have no bias; BN: weight, bias)."""
    exp = 4 if kind == "bottleneck" else 1
    shapes: list[Shape] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for stage, n in enumerate(blocks):
        planes = 64 << stage
        for i in range(n):
            convs = ([(planes, inplanes, 1, 1), (planes, planes, 3, 3), (planes * exp, planes, 1, 1)]
                     if exp == 4 else [(planes, inplanes, 3, 3), (planes, planes, 3, 3)])
            for c in convs:
                shapes += [c, (c[0],), (c[0],)]
            if i == 0 and (stage > 0 or inplanes != planes * exp):
                shapes += [(planes * exp, inplanes, 1, 1), (planes * exp,), (planes * exp,)]
            inplanes = planes * exp
    return shapes + [(classes, 512 * exp), (classes,)]


def param_shapes(model: str, classes: int) -> list[Shape]:
    """The trainable parameters' shapes of torchvision's `model` with `classes` outputs: ResNets worked out
    here (no torch needed on the head), any other model built by torchvision on the meta device."""
    if model in RESNETS:
        return _resnet(*RESNETS[model], classes)
    try:
        import torch
        import torchvision  # type: ignore[import-untyped]  # publishes no type information
    except ImportError:
        raise ClusterError(f"cannot size model {model!r} without torchvision on the head",
                           "install it (pip install 'clusterctl[torch]') or plan a ResNet job") from None
    with torch.device("meta"):
        m = torchvision.models.get_model(model, weights=None, num_classes=classes)
    return [tuple(p.shape) for p in m.parameters() if p.requires_grad]


def job_model(spec: jobs.JobSpec) -> tuple[list[Shape] | None, int | None, int | None]:
    """(the job's gradient shapes, its training samples, its validation samples): its model (TensorFlow
    jobs: ResNet50, sized as torchvision's) with its prepared dataset's classes; None where any cannot be
    known here."""
    samples, val, classes = None, None, 10
    try:
        from cluster.programs import wldata

        ds = wldata.open_prepared(datasets.prepare(spec).path)
        samples, val, classes = len(ds.y_train), len(ds.y_val), int(ds.classes)
    except (ClusterError, OSError, ValueError, ImportError):
        pass
    try:
        return param_shapes(spec["model"] if spec.framework == "pytorch" else "resnet50", classes), samples, val
    except ClusterError:
        return None, samples, val


def buckets(shapes: list[Shape], bucket_mb: float = 0.0, elem_bytes: int = 4) -> list[list[Shape]]:
    """DDP's buckets in the order they become ready (reverse registration order): the first up to
    1 MiB, the others up to bucket_mb (25 MiB); a bucket closes once it reaches its cap."""
    cap = int(bucket_mb * 2**20) if bucket_mb else BUCKET_BYTES
    out: list[list[Shape]] = [[]]
    size, limit = 0, min(cap, FIRST_BUCKET_BYTES) if not bucket_mb else cap
    for s in reversed(shapes):
        out[-1].append(s)
        size += math.prod(s) * elem_bytes
        if size >= limit:
            out.append([])
            size, limit = 0, cap
    return [b for b in out if b]


def _payload(shapes: list[Shape], scheme: Scheme) -> float:
    return wlcommon.comm_volume(shapes, 2, scheme.grad_compression, scheme.powersgd_rank,
                                powersgd_wire=scheme.powersgd_wire)["allreduce_payload_bytes"]


def wire_bytes(shapes: list[Shape], scheme: Scheme, world: int) -> int:
    """Bytes each rank sends per optimizer step (ring all-reduce, 2(W-1)/W of the payload)."""
    vol = wlcommon.comm_volume(shapes, world, scheme.grad_compression, scheme.powersgd_rank,
                               powersgd_wire=scheme.powersgd_wire)
    return int(vol["bytes_sent_per_step_ring"])


@dataclass(frozen=True)
class Comm:
    """One optimizer step's communication: its total time, the part after backward ends, bytes sent."""

    total_s: float
    tail_s: float
    bytes_sent: int


def comm(shapes: list[Shape], scheme: Scheme, world: int, link: Link, bucket_mb: float = 0.0) -> Comm:
    """All-reduces per bucket (PowerSGD: 3, its uncompressed tensors, P, Q; else 1), each paying the
    latency, plus the bytes sent at the link's cost per byte. The tail is the last bucket's share."""
    if world < 2:
        return Comm(0.0, 0.0, 0)
    ring = 2 * (world - 1) / world
    calls = 3 if scheme.grad_compression == "powersgd" else 1
    times = [calls * link.latency_s + _payload(b, scheme) * ring * link.per_byte_s
             for b in buckets(shapes, bucket_mb)]
    return Comm(sum(times), times[-1], wire_bytes(shapes, scheme, world))


def exposed(c: Comm, backward_s: float, overlap: bool = True) -> float:
    """Communication time the step waits for: what does not fit under the last micro-batch's backward,
    and never less than the last bucket's (it starts when backward ends). No overlap: all of it."""
    if not overlap:
        return c.total_s
    return max(c.tail_s, c.total_s - backward_s)


def overlaps(framework: str, scheme: Scheme, powersgd_priced: bool = True) -> bool:
    """Whether the all-reduce hides under backward: DDP's buckets do, and PowerSGD's too where its own
    compute is priced (`powersgd_priced`: bench measured `powersgd_s` on every node), since its bytes travel
    while backward computes the earlier layers; TensorFlow's loop all-reduces after backward.

    Where PowerSGD's compute is not priced its all-reduces do not overlap: their full time stands in for that
    compute (docs/planning.md, "Overlap"; the measured error: docs/performance.md)."""
    if framework != "pytorch":
        return False
    return powersgd_priced or scheme.grad_compression != "powersgd"


def warnings(scheme: Scheme, global_batch: int, train_samples: int | None, base_batch: int) -> list[str]:
    """Where a scheme may cost accuracy (the plan prefers the schemes without)."""
    out = []
    if scheme.grad_compression == "powersgd" and scheme.powersgd_rank < 2:
        out.append("PowerSGD rank 1 may cost accuracy; compare the validation accuracy with an uncompressed run")
    if scheme.accumulate > 1:
        steps = train_samples // global_batch if train_samples else None
        if global_batch > max(LARGE_BATCH, base_batch):
            out.append(f"effective global batch {global_batch}: large batches may need more epochs for the "
                       "same accuracy")
        elif steps is not None and steps < FEW_STEPS:
            out.append(f"{steps} optimizer steps per epoch at global batch {global_batch}: the same epochs "
                       "make fewer updates; expect lower accuracy per epoch")
    return out


def schemes(powersgd_rank: int, accumulates: tuple[int, ...] = (1, 2, 4),
            powersgd_wires: tuple[str, ...] = ("float32",)) -> list[Scheme]:
    """Every scheme the plan weighs, the same for both frameworks: each compression with each accumulation,
    PowerSGD on each of `powersgd_wires`."""
    out = []
    for c in wlcommon.COMPRESSIONS:
        for wire in powersgd_wires if c == "powersgd" else ("float32",):
            out += [Scheme(c, powersgd_rank, k, powersgd_wire=wire) for k in accumulates]
    return out
