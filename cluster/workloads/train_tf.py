"""ResNet50 with TensorFlow MultiWorkerMirroredStrategy: the TensorFlow half of the study.

One process per node, TF_CONFIG in the environment (worker 0 is the chief), or
alone without it. tf-keras's ResNet50 (weights=None) in a custom loop with
`strategy.run`: the same data order, shards, learning-rate schedule, L2 weight
decay and evaluation as train_torch.py, and the same metrics (docs/metrics.md).
Keras 3's model.fit fails under MWMS (DESIGN.md), hence tf-keras and this loop.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wlcommon  # noqa: E402
import wldata  # noqa: E402
import wlmetrics  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402


def worker_info() -> tuple[int, int]:
    cfg = json.loads(os.environ.get("TF_CONFIG", "{}"))
    if not cfg:
        return 0, 1
    return int(cfg["task"]["index"]), len(cfg["cluster"]["worker"])


def build_model(classes: int, size: int) -> keras.Model:
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=classes,
                                        classifier_activation=None)  # logits, as torchvision's
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            # torch's BN keeps 90% of its running statistics per step (momentum 0.1), Keras's default 99%:
            # with 0.99 a short run evaluates with statistics still near their initial values.
            layer.momentum = 0.9
    return model


def normalize(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    return ((x.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)


class Trainer:
    """The model, optimizer and compiled steps of one worker."""

    def __init__(self, strategy: tf.distribute.Strategy, classes: int, size: int, a: argparse.Namespace,
                 global_batch: int, comm_options: tf.distribute.experimental.CommunicationOptions | None = None
                 ) -> None:
        """global_batch: samples per optimizer step, all workers and all a.accumulate micro-batches."""
        self.strategy, self.a, self.global_batch = strategy, a, global_batch
        self.accumulate = int(getattr(a, "accumulate", 1))
        self.compression = getattr(a, "grad_compression", "none")
        if self.compression not in ("none", "fp16"):
            raise ValueError(f"gradient compression {self.compression!r} is not implemented for TensorFlow")
        self.comm_options = comm_options
        with strategy.scope():
            self.model = build_model(classes, size)
            self.opt = keras.optimizers.SGD(learning_rate=a.lr, momentum=a.momentum)
            self.epoch = tf.Variable(-1, dtype=tf.int64, trainable=False)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def _local_grads(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """This replica's loss and gradient for one (micro-)batch: the loss is summed over the batch and
        divided by the global batch, so the all-reduced (summed) gradient is the mean over the global
        batch, whatever each worker's share of it."""
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True)
            loss = tf.nn.compute_average_loss(self.loss_fn(y, logits), global_batch_size=self.global_batch)
        return loss, tape.gradient(loss, self.model.trainable_variables)

    @tf.function
    def train_step(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """One optimizer step on this worker's x, y (a.accumulate micro-batches back to back); returns
        this replica's mean loss."""
        def replica(x, y):
            variables = self.model.trainable_variables
            world = self.strategy.num_replicas_in_sync
            k = self.accumulate
            if k == 1:
                loss, grads = self._local_grads(x, y)
            else:  # k forward/backward passes, one after the other (control dependencies), summed locally
                b = x.shape[0] // k
                loss, grads = None, None
                for j in range(k):
                    with tf.control_dependencies(grads or []):
                        lj, gj = self._local_grads(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
                    loss = lj if loss is None else loss + lj
                    grads = gj if grads is None else [g + h for g, h in zip(grads, gj)]
            if self.compression == "fp16":
                # the all-reduce carries float16 (half the bytes), summed in float16 as the torch hook does;
                # weight decay is added after it, in full precision
                ctx = tf.distribute.get_replica_context()
                half = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [tf.cast(g, tf.float16) for g in grads],
                                      options=self.comm_options)
                grads = [tf.cast(h, v.dtype) + self.a.weight_decay * v for h, v in zip(half, variables)]
                self.opt.apply_gradients(zip(grads, variables), skip_gradients_aggregation=True)
            else:
                # L2 weight decay added to the gradient, as torch's SGD does (each replica adds 1/world of it)
                grads = [g + self.a.weight_decay / world * v for g, v in zip(grads, variables)]
                self.opt.apply_gradients(zip(grads, variables))  # all-reduces (sums) them first
            return loss * self.global_batch / tf.cast(tf.shape(y)[0], loss.dtype)  # this replica's mean loss

        per_replica = self.strategy.run(replica, args=(x, y))
        return self.strategy.experimental_local_results(per_replica)[0]

    @tf.function
    def eval_sums(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        def replica(x, y):
            logits = self.model(x, training=False)
            loss = tf.reduce_sum(self.loss_fn(y, logits))
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
            return tf.stack([loss, correct, tf.cast(tf.shape(y)[0], tf.float32)])

        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(replica, args=(x, y)), axis=None)

    def evaluate(self, x: np.ndarray, y: np.ndarray, max_len: int, batch: int = 256) -> tuple[float, float]:
        """Each worker scores its share; all run ceil(max_len / batch) collective steps, even if empty."""
        sums = np.zeros(3)
        for i in range(-(-max_len // batch)):
            xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
            sums += self.eval_sums(tf.constant(xb), tf.constant(yb)).numpy()
        return float(sums[0] / sums[2]), float(sums[1] / sums[2])

    def broadcast_from_chief(self, chief: bool) -> None:
        """After the chief restored a checkpoint (nodes don't share disks): everyone takes its values."""
        opt_vars = self.opt.variables() if callable(self.opt.variables) else self.opt.variables
        variables = self.model.variables + list(opt_vars) + [self.epoch, self.step]

        @tf.function
        def bcast():
            def replica():
                ctx = tf.distribute.get_replica_context()
                mine = [tf.cast(v.read_value(), tf.float64) if chief else tf.zeros(v.shape, tf.float64)
                        for v in variables]
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine)

            return self.strategy.run(replica)

        for v, val in zip(variables, bcast()):
            v.assign(tf.cast(self.strategy.experimental_local_results(val)[0], v.dtype))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    wlcommon.add_args(ap)
    a = ap.parse_args(argv)
    if a.grad_compression == "powersgd":
        ap.error("--grad-compression powersgd is implemented for PyTorch only (DDP communication hooks); "
                 "use fp16 with TensorFlow")
    if a.accumulate < 1 or a.collective_timeout_s < 0 or a.tf_bytes_per_pack < 0:
        ap.error("--accumulate must be >= 1, --collective-timeout-s and --tf-bytes-per-pack >= 0")
    cpu = wlmetrics.CpuMeter()
    rank, world = worker_info()
    if world == 1:
        a.grad_compression = "none"  # nothing goes on a wire
    threads = wlcommon.threads_per_process(a.threads, 1)
    workers = wlcommon.loader_workers(a.loader_workers, bool(tf.config.list_physical_devices("GPU")), 1)
    set_threads(threads)
    options = communication_options(a)
    strategy = make_strategy(world, options, a.collective_timeout_s)
    tf.random.set_seed(a.seed)
    keras.utils.set_random_seed(a.seed)
    out = Path(a.out)
    metrics = wlmetrics.MetricsWriter(out, rank, "tensorflow")

    ds = wldata.open_prepared(a.data) if a.data else wldata.load(a.dataset, a.data_path, a.size, a.seed)
    mean, std = ds.normalization()
    xtr, ytr = normalize(ds.x_train, mean, std), ds.y_train
    vidx = np.arange(rank, len(ds.x_val), world)
    xva, yva = normalize(ds.x_val[vidx], mean, std), ds.y_val[vidx]

    batch = wlcommon.my_batch(a.shares, os.environ.get("CLUSTER_NODE_NAME"), a.batch)
    batches = [int(b) for b in _allsum(strategy, np.eye(world)[rank] * batch)] if world > 1 else [batch]
    k = a.accumulate
    micro_global = sum(batches)
    global_batch = k * micro_global  # samples per optimizer step
    steps_per_epoch = len(ds.x_train) // global_batch
    if a.max_steps:
        steps_per_epoch = min(steps_per_epoch, a.max_steps)
    peak = wlcommon.peak_lr(a.lr, global_batch)
    tr = Trainer(strategy, ds.classes, a.size, a, global_batch, options)
    volume = wlcommon.comm_volume([tuple(v.shape) for v in tr.model.trainable_variables], world, a.grad_compression)
    ckpt_dir = out / "checkpoint"
    ckpt = tf.train.Checkpoint(model=tr.model, optimizer=tr.opt, epoch=tr.epoch, step=tr.step)
    if a.resume == "auto":
        latest = tf.train.latest_checkpoint(str(ckpt_dir)) if rank == 0 else None
        if latest:
            ckpt.read(latest).expect_partial()
        if world > 1:
            _build_optimizer_slots(tr)
            tr.broadcast_from_chief(chief=rank == 0)
    start_epoch, step = int(tr.epoch.numpy()) + 1, int(tr.step.numpy())
    metrics.start(world=world, local_rank=0, device="cpu" if not tf.config.list_physical_devices("GPU") else "gpu",
                  amp=False, dataset=ds.name, synthetic=ds.synthetic, train_samples=len(ds.x_train),
                  val_samples=len(ds.x_val), batch=batch, batches=batches, global_batch=global_batch,
                  steps_per_epoch=steps_per_epoch, epochs=a.epochs, peak_lr=peak, momentum=a.momentum,
                  weight_decay=a.weight_decay, schedule=a.schedule, warmup_epochs=a.warmup_epochs,
                  start_epoch=start_epoch, tensorflow=tf.__version__, threads=threads,
                  interop_threads=tf.config.threading.get_inter_op_parallelism_threads(), loader_workers=workers,
                  backend="mwms" if world > 1 else "none", collective_timeout_s=a.collective_timeout_s,
                  heartbeat_timeout_s=a.collective_timeout_s if world > 1 and a.collective_timeout_s else None,
                  tf_implementation=a.tf_implementation, tf_bytes_per_pack=a.tf_bytes_per_pack,
                  grad_compression=a.grad_compression, accumulate=k, micro_batch=batch,
                  micro_global_batch=micro_global, lr_scaled_for_batch=global_batch, **volume)
    history = []
    run_start = time.time()
    for epoch in range(start_epoch, a.epochs):
        order = wlcommon.epoch_order(len(xtr), a.seed, epoch)
        mine = order[wldata.shard(len(order), rank, world)]
        ep_start = time.perf_counter()
        tot_loss, seen, data_s, comp_s = 0.0, 0, 0.0, 0.0
        ep_cpu = wlmetrics.CpuMeter()
        step_batches = [k * b for b in batches]  # a worker's k micro-batches: consecutive in the order
        feed = iter(wlcommon.Prefetcher(lambda i: (xtr[order[wlcommon.batch_slice(i, step_batches, rank)]],
                                                   ytr[order[wlcommon.batch_slice(i, step_batches, rank)]]),
                                        steps_per_epoch, workers))
        for i in range(steps_per_epoch):
            t0 = time.perf_counter()
            xb, yb = next(feed)
            x, y = tf.constant(xb), tf.constant(yb)
            t1 = time.perf_counter()
            lr = wlcommon.lr_at(step, steps_per_epoch, a.epochs, peak, a.warmup_epochs, a.schedule)
            tr.opt.learning_rate.assign(lr)
            loss_v = float(tr.train_step(x, y).numpy())
            t2 = time.perf_counter()
            data_s, comp_s = data_s + t1 - t0, comp_s + t2 - t1
            tot_loss, seen = tot_loss + loss_v * len(yb), seen + len(yb)
            step += 1
            if step % a.log_every == 0 or i == steps_per_epoch - 1 or i == 0:  # first: the run is up
                metrics.step(epoch, step, loss_v, lr, global_batch, t0, t1, t2,
                             bytes_sent_ring=volume["bytes_sent_per_step_ring"])
        ep_s = time.perf_counter() - ep_start
        ep_cpu_use = ep_cpu.read()  # the training steps' CPU use, before evaluation
        train_loss = _allsum(strategy, np.array([tot_loss, seen]))
        val_loss, val_acc = tr.evaluate(xva, yva, max_len=-(-len(ds.x_val) // world))
        _, tr_acc = tr.evaluate(xtr[mine[:512]], ytr[mine[:512]], max_len=min(512, len(mine)))
        rec = metrics.write("epoch", epoch=epoch, step=step, train_loss=float(train_loss[0] / train_loss[1]),
                            train_acc=tr_acc, val_loss=val_loss, val_acc=val_acc, epoch_s=round(ep_s, 3),
                            images_per_s=round(steps_per_epoch * global_batch / ep_s, 2),
                            data_s=round(data_s, 3), compute_s=round(comp_s, 3),
                            bytes_sent_per_step_ring=volume["bytes_sent_per_step_ring"], **ep_cpu_use,
                            **wlmetrics.system_sample())
        history.append(rec)
        tr.epoch.assign(epoch)
        tr.step.assign(step)
        # every worker writes (MWMS collectives); only the chief's copy is kept
        target = ckpt_dir if rank == 0 else out / f".checkpoint-worker{rank}"
        ckpt.write(str(target / "ckpt"))
        if rank == 0:
            (ckpt_dir / "checkpoint").write_text('model_checkpoint_path: "ckpt"\n')
    metrics.write("end", epochs_done=a.epochs - start_epoch, step=step, wall_s=round(time.time() - run_start, 3),
                  **cpu.read())
    if rank == 0:
        wlmetrics.write_summary(out, wlmetrics.summary("tensorflow", a, world, steps_per_epoch, history,
                                                       time.time() - run_start, ds))
    metrics.close()
    wait_for_all_workers(world)
    return 0


def set_threads(threads: int) -> None:
    """Intra-op and inter-op pools both from `threads`, as train_torch.py does: at threads=N both
    frameworks get the same CPU budget (this program used to run 2 inter-op threads whatever
    `threads` said, ~1.2 cores at threads=1; issue 13)."""
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)


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


def wait_for_all_workers(world: int, name: str = "clusterctl-exit") -> None:
    """Leave together: a worker that exits right after the last all-reduce can close the socket its peer
    still pulls that result's buffers from ("Collective ops is aborted by: Socket closed")."""
    if world > 1:
        from tensorflow.python.eager import context

        context.context().wait_at_barrier(name, 300_000)  # the coordination service's barrier


def _allsum(strategy: tf.distribute.Strategy, values: np.ndarray) -> np.ndarray:
    if strategy.num_replicas_in_sync == 1:
        return values
    t = tf.constant(values, dtype=tf.float64)
    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.identity(t)), axis=None).numpy()


def _build_optimizer_slots(tr: Trainer) -> None:
    """Momentum slots exist only after the first apply; create them (zero update) before broadcasting."""
    with tr.strategy.scope():
        tr.opt.build(tr.model.trainable_variables)


if __name__ == "__main__":
    sys.exit(main())
