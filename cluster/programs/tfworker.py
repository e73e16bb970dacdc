"""A TensorFlow worker's place in the cluster, for train_tf.py: what train_torch.py gets from torchrun and
torch.distributed. Its rank from TF_CONFIG, MultiWorkerMirroredStrategy with the coordination service
configured first, sums over the workers outside the model's all-reduce, and leaving together. Apart from
the training loop (train_tf.Trainer), which sees only the strategy.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import numpy as np
import tensorflow as tf


@dataclass
class Worker:
    """This worker's place in the cluster and its CPU budget."""

    rank: int
    world: int
    threads: int
    loaders: int  # threads preparing the next batches
    options: tf.distribute.experimental.CommunicationOptions
    strategy: tf.distribute.Strategy


def worker_info() -> tuple[int, int]:
    """(rank, world) from TF_CONFIG (worker 0 is the chief); (0, 1) without it: alone."""
    cfg = json.loads(os.environ.get("TF_CONFIG", "{}"))
    if not cfg:
        return 0, 1
    return int(cfg["task"]["index"]), len(cfg["cluster"]["worker"])


def communication_options(a: argparse.Namespace) -> tf.distribute.experimental.CommunicationOptions:
    """MWMS's CommunicationOptions from the job: implementation (AUTO is RING on CPU), bytes per pack
    (0: TensorFlow packs all gradients), and the collective timeout (a collective that has not completed
    after it raises DeadlineExceeded; TensorFlow keeps a sleeping thread per collective for that time)."""
    impl = tf.distribute.experimental.CommunicationImplementation[a.tf_implementation.upper()]
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=a.tf_bytes_per_pack, implementation=impl,
        timeout_seconds=a.collective_timeout_s if a.collective_timeout_s > 0 else None)


def make_strategy(world: int, options: tf.distribute.experimental.CommunicationOptions,
                  timeout_s: float) -> tf.distribute.Strategy:
    """MWMS with the coordination service configured by us before MWMS would with its defaults.

    The service's heartbeat timeout (TF default 10 s) sets both how long a silent worker is tolerated
    and, halved, each heartbeat RPC's own deadline and interval (tsl coordination_service_agent). On a
    link saturated by gradients a 5 s heartbeat RPC misses its deadline and the agent aborts every
    collective ("Deadline Exceeded, RPC: /tensorflow.CoordinationService/Heartbeat", issue 13). With the
    job's collective_timeout_s the heartbeat RPC gets timeout/2 (60 s by default) and a dead or frozen
    worker is declared so after `timeout_s`, which fails the others' next collective: they exit non-zero."""
    if world == 1:
        return tf.distribute.get_strategy()
    if timeout_s > 0:
        from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
        from tensorflow.python.distribute import multi_worker_util
        from tensorflow.python.eager import context

        spec = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
        jobs = [coordination_config_pb2.CoordinatedJob(name=j, num_tasks=spec.num_tasks(j))
                for j in ("chief", "worker") if j in spec.jobs]
        context.context().configure_coordination_service(
            service_type="standalone", service_leader=multi_worker_util.coordination_leader(spec),
            coordinated_jobs=jobs, heartbeat_timeout_in_ms=int(timeout_s * 1000))
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def allsum(strategy: tf.distribute.Strategy, values: np.ndarray) -> np.ndarray:
    """The sum over the workers of a small array (a collective: every worker calls it), for what the
    workers must agree on besides the gradients: their batches, the epoch's loss, their checkpoints."""
    if strategy.num_replicas_in_sync == 1:
        return values
    t = tf.constant(values, dtype=tf.float64)
    total: np.ndarray = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.identity(t)),
                                        axis=None).numpy()
    return total


def wait_for_all_workers(world: int, name: str = "clusterctl-exit") -> None:
    """Leave together: a worker that exits right after the last all-reduce can close the socket its peer
    still pulls that result's buffers from ("Collective ops is aborted by: Socket closed")."""
    if world > 1:
        from tensorflow.python.eager import context

        context.context().wait_at_barrier(name, 300_000)  # the coordination service's barrier
