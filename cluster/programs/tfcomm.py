"""PowerSGD for train_tf.py's custom loop: what torch's powerSGD_hook does to DDP's buckets, done to the
worker's gradients between backward and the optimizer step.

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization" (2019),
as torch implements it (error feedback, warm start, one power iteration a step): each gradient of two or
more dimensions is viewed as torch views its own (n = output channels, m = the rest) and sent as
P = M Q (n x r) and Q = M^T P (m x r), M being the gradient plus the error this worker's last
approximation left; the rest (biases, BatchNorm) is all-reduced whole. On links where the model's
all-reduce takes longer than the step (94 MB of ResNet50 on a 1 GbE room of old PCs), that is what lets
TensorFlow's workers share the gradient every step (docs/jobs.md "Communication").

The loop's gradients are each worker's share of the global-batch mean (train_tf.Trainer._local_grads), so
the all-reduced sums are the mean gradient; torch's hook averages mean gradients instead, and its error
(M - the mean approximation) is here M - the approximation / world. A worker's error and the warm-started
Q live in plain variables of this worker; neither is checkpointed (as in train_torch: a resumed run starts
them afresh)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf


def matrix_view(shape: Sequence[int]) -> tuple[int, int]:
    """(n, m) of torch's view of the same layer's gradient: Keras keeps the output channels last
    (kernel h x w x in x out, dense in x out), torch first (out x in x h x w, out x in)."""
    if len(shape) < 2:
        return (int(shape[0]) if shape else 1), 1
    return int(shape[-1]), math.prod(int(s) for s in shape[:-1])


def torch_shapes(shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The gradients' shapes as wlcommon.comm_volume and the plan count them (torch's order)."""
    return [matrix_view(s) if len(s) > 1 else tuple(int(x) for x in s) for s in shapes]


def initial_q(seed: int, index: int, m: int, r: int) -> np.ndarray:
    """Q's first value for the `index`th gradient: the same on every worker (seeded), as torch's hook
    draws it from a generator seeded alike on every rank."""
    return np.random.default_rng([seed, index]).standard_normal((m, r))


def orthonormal(x: tf.Tensor) -> tf.Tensor:
    """An orthonormal basis of x's columns (torch's hook: Gram-Schmidt; QR gives the same up to signs,
    which P Q^T does not see), without dividing by zero where a column is."""
    return tf.linalg.qr(x)[0]


@dataclass
class StepCount:
    """wlcommon.StartsLate for the TensorFlow program: fp16 until `start_powerSGD_iter`, then PowerSGD."""

    iter: int
    start_powerSGD_iter: int


class PowerSGD:
    """The compressed all-reduce of one worker's gradients (class doc); call reduce in replica context."""

    def __init__(self, variables: Sequence[tf.Variable], world: int, rank: int, seed: int,
                 wire: str = "float32", min_compression_rate: float = 2.0) -> None:
        self.world, self.wire = world, getattr(tf, wire)
        self.compressed: dict[int, tuple[int, int]] = {}  # variable index -> (n, m), torch's rule
        self.q: dict[int, tf.Variable] = {}
        self.error: dict[int, tf.Variable] = {}
        for i, v in enumerate(variables):
            n, m = matrix_view(v.shape.as_list())
            r = min(n, m, rank)
            if len(v.shape) < 2 or (n + m) * r * min_compression_rate >= n * m:
                continue
            self.compressed[i] = (n, m)
            self.q[i] = tf.Variable(initial_q(seed, i, m, r).astype(v.dtype.as_numpy_dtype), trainable=False)
            self.error[i] = tf.Variable(tf.zeros((n, m), v.dtype), trainable=False)

    def _sum(self, ctx: Any, tensors: list[tf.Tensor], options: Any) -> list[tf.Tensor]:
        """One all-reduce (sum) of the list, on the wire's dtype."""
        if not tensors:
            return []
        sent = [tf.cast(t, self.wire) for t in tensors]
        summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, sent, options=options)
        return [tf.cast(s, t.dtype) for s, t in zip(summed, tensors)]

    def reduce(self, grads: Sequence[tf.Tensor], options: Any = None) -> list[tf.Tensor]:
        """The sum over the workers of `grads`, the compressed ones as P Q^T (two all-reduces: P with the
        uncompressed tensors, then Q); updates this worker's error and Q."""
        ctx = tf.distribute.get_replica_context()
        idx = list(self.compressed)
        plain = [j for j in range(len(grads)) if j not in self.compressed]
        ms = {i: tf.transpose(tf.reshape(grads[i], (-1, self.compressed[i][0]))) + self.error[i] for i in idx}
        ps = [tf.matmul(ms[i], orthonormal(self.q[i])) for i in idx]
        first = self._sum(ctx, ps + [grads[j] for j in plain], options)
        ps = [orthonormal(p) for p in first[:len(idx)]]
        qs = self._sum(ctx, [tf.matmul(ms[i], p, transpose_a=True) for i, p in zip(idx, ps)], options)
        out = list(grads)
        for i, p, q in zip(idx, ps, qs):
            approx = tf.matmul(p, q, transpose_b=True)  # n x m: the sum of the workers' M, approximated
            self.error[i].assign(ms[i] - approx / self.world)
            self.q[i].assign(q)
            out[i] = tf.reshape(tf.transpose(approx), tf.shape(grads[i]))
        for j, summed in zip(plain, first[len(idx):]):
            out[j] = summed
        return out
