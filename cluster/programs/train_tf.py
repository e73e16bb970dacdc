"""ResNet50 with TensorFlow MultiWorkerMirroredStrategy: the TensorFlow half of the study.

One process per node, TF_CONFIG in the environment (worker 0 is the chief), or
alone without it. tf-keras's ResNet50 (weights=None) in a custom loop with
`strategy.run`: the same data order, shards, learning-rate schedule, L2 weight
decay and evaluation as train_torch.py, and the same metrics (docs/metrics.md).
Keras 3's model.fit fails under MWMS (DESIGN.md), hence tf-keras and this loop.

main's phases: the settings (wlcommon.parse_args), setup_worker (threads,
strategy, seeds), build_training (data, batches, Trainer, resume, start record),
train_epoch per epoch, MetricsWriter.finish (end record, summary), and leaving
together (tfworker.wait_for_all_workers).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

if TYPE_CHECKING:  # mypy reads these as the package's modules; a node has them next to this file
    from cluster.programs import tfcomm, tfworker, wlcommon, wldata, wlmetrics
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tfcomm
    import tfworker
    import wlcommon
    import wldata
    import wlmetrics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

Fn = TypeVar("Fn", bound=Callable[..., Any])


def compiled(fn: Fn) -> Fn:
    """tf.function that keeps the function's signature for mypy (TensorFlow publishes no types)."""
    return cast(Fn, tf.function(fn))


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
    out: np.ndarray = ((x.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)
    return out


class Trainer:
    """The model, optimizer and compiled steps of one worker."""

    def __init__(self, strategy: tf.distribute.Strategy, classes: int, size: int, a: argparse.Namespace,
                 global_batch: int, comm_options: tf.distribute.experimental.CommunicationOptions | None = None
                 ) -> None:
        """global_batch: samples per optimizer step, all workers and all a.accumulate micro-batches."""
        self.strategy, self.a, self.global_batch = strategy, a, global_batch
        self.accumulate = int(getattr(a, "accumulate", 1))
        self.compression = getattr(a, "grad_compression", "none")
        if self.compression not in wlcommon.COMPRESSIONS:
            raise ValueError(f"gradient compression {self.compression!r} is not implemented for TensorFlow")
        self.comm_options = comm_options
        with strategy.scope():
            self.model = build_model(classes, size)
            self.opt = keras.optimizers.SGD(learning_rate=a.lr, momentum=a.momentum)
            self.epoch = tf.Variable(-1, dtype=tf.int64, trainable=False)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False)
            # the saved epoch's validation accuracy (-1: none), so a resumed run knows whether it reached its target
            self.val_acc = tf.Variable(-1.0, dtype=tf.float64, trainable=False)
        # this worker's own (outside the strategy's scope: each worker's error differs)
        self.powersgd = (tfcomm.PowerSGD(self.model.trainable_variables, strategy.num_replicas_in_sync,
                                         int(getattr(a, "powersgd_rank", 2)), int(getattr(a, "seed", 0)),
                                         getattr(a, "powersgd_wire", "float32"))
                         if self.compression == "powersgd" else None)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        self.bn_keep = tf.Variable(0.0, dtype=tf.float64, trainable=False)  # recompute_bn's momentum, per call

    def _local_grads(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """This replica's loss and gradient for one (micro-)batch: the loss is summed over the batch and
        divided by the global batch, so the all-reduced (summed) gradient is the mean over the global
        batch, whatever each worker's share of it."""
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True)
            loss = tf.nn.compute_average_loss(self.loss_fn(y, logits), global_batch_size=self.global_batch)
        return loss, tape.gradient(loss, self.model.trainable_variables)

    def _accumulated_grads(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """k forward/backward passes, one after the other (control dependencies), summed locally."""
        k = self.accumulate
        if k == 1:
            return self._local_grads(x, y)
        b = x.shape[0] // k
        loss, grads = self._local_grads(x[:b], y[:b])
        for j in range(1, k):
            with tf.control_dependencies(grads):
                lj, gj = self._local_grads(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
            loss, grads = loss + lj, [g + h for g, h in zip(grads, gj)]
        return loss, grads

    def _apply(self, grads: list[tf.Tensor], compress: bool = False) -> None:
        """All-reduce (sum) the replicas' gradients, add the L2 weight decay, take the SGD step. PowerSGD
        (`compress`, powersgd_step) or, before its start step, fp16 (as train_torch's hook)."""
        variables = self.model.trainable_variables
        if compress and self.powersgd is not None:
            summed = self.powersgd.reduce(grads, self.comm_options)
            full = [s + self.a.weight_decay * v for s, v in zip(summed, variables)]
            self.opt.apply_gradients(zip(full, variables), skip_gradients_aggregation=True)
        elif self.compression in ("fp16", "powersgd"):
            # the all-reduce carries float16 (half the bytes), summed in float16 as the torch hook does;
            # weight decay is added after it, in full precision
            ctx = tf.distribute.get_replica_context()
            half = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [tf.cast(g, tf.float16) for g in grads],
                                  options=self.comm_options)
            full = [tf.cast(h, v.dtype) + self.a.weight_decay * v for h, v in zip(half, variables)]
            self.opt.apply_gradients(zip(full, variables), skip_gradients_aggregation=True)
        else:
            # L2 weight decay added to the gradient, as torch's SGD does (each replica adds 1/world of it)
            world = self.strategy.num_replicas_in_sync
            decayed = [g + self.a.weight_decay / world * v for g, v in zip(grads, variables)]
            self.opt.apply_gradients(zip(decayed, variables))  # all-reduces (sums) them first

    def _step(self, x: tf.Tensor, y: tf.Tensor, compress: bool) -> tf.Tensor:
        def replica(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            loss, grads = self._accumulated_grads(x, y)
            self._apply(grads, compress)
            return loss * self.global_batch / tf.cast(tf.shape(y)[0], loss.dtype)  # this replica's mean loss

        per_replica = self.strategy.run(replica, args=(x, y))
        return self.strategy.experimental_local_results(per_replica)[0]

    @compiled
    def train_step(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """One optimizer step on this worker's x, y (a.accumulate micro-batches back to back); returns
        this replica's mean loss."""
        return self._step(x, y, compress=False)

    @compiled
    def powersgd_step(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """train_step with the gradients sent by PowerSGD (tfcomm)."""
        return self._step(x, y, compress=True)

    @compiled
    def eval_sums(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        def replica(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
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

    @compiled
    def bn_forward(self, x: tf.Tensor) -> None:
        self.strategy.run(lambda x: self.model(x, training=True), args=(x,))

    def recompute_bn(self, x: np.ndarray, batch: int, max_len: int) -> None:
        """Precise BatchNorm, as train_torch.recompute_bn: every BatchNorm layer's moving mean and variance
        replaced by their plain average over this worker's `x` in batches of `batch` (forward passes in
        training mode, nothing learned: Keras's own update with momentum k/(k+1) at the k-th batch makes the
        running average a plain one), then every worker takes the mean of all workers' (reading a
        sync-on-read variable is that mean; a collective). All workers run the same calls: `max_len`, the
        longest worker's samples; an empty batch updates nothing."""
        layers = [layer for layer in self.model.layers if isinstance(layer, keras.layers.BatchNormalization)]
        if not layers:
            return
        kept = [layer.momentum for layer in layers]
        for layer in layers:
            layer.momentum = self.bn_keep  # a variable: the traced step reads the value of each call
        try:
            for k in range(-(-max_len // batch)):
                self.bn_keep.assign(k / (k + 1))
                self.bn_forward(tf.constant(x[k * batch:(k + 1) * batch]))
        finally:
            for layer, momentum in zip(layers, kept):
                layer.momentum = momentum
        with self.strategy.scope():
            stats = [v for layer in layers for v in (layer.moving_mean, layer.moving_variance)]
            means = [tf.convert_to_tensor(v) for v in stats]
            for v, m in zip(stats, means):
                v.assign(m)

    def broadcast_from(self, source: bool) -> None:
        """After the workers restored their own checkpoints (nodes don't share disks) and agreed on the
        newest: everyone takes the values of the one worker called with source=True (a collective: every
        worker calls it, exactly one as the source)."""
        opt_vars = self.opt.variables() if callable(self.opt.variables) else self.opt.variables
        variables = self.model.variables + list(opt_vars) + [self.epoch, self.step, self.val_acc]

        @compiled
        def bcast() -> Any:
            def replica() -> Any:
                ctx = tf.distribute.get_replica_context()
                mine = [tf.cast(v.read_value(), tf.float64) if source else tf.zeros(v.shape, tf.float64)
                        for v in variables]
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine)

            return self.strategy.run(replica)

        for v, val in zip(variables, bcast()):
            v.assign(tf.cast(self.strategy.experimental_local_results(val)[0], v.dtype))


@dataclass
class Training:
    """Everything the epochs need, built once by build_training."""

    a: argparse.Namespace
    worker: tfworker.Worker
    ds: wldata.Dataset
    train: tuple[np.ndarray, np.ndarray]  # normalized images, labels
    val: tuple[np.ndarray, np.ndarray]  # this worker's validation shard
    trainer: Trainer
    plan: wlcommon.BatchPlan
    comp: wlcommon.Compression
    ckpt: tf.train.Checkpoint
    metrics: wlmetrics.MetricsWriter
    start_epoch: int
    step: int  # optimizer steps done, over the run
    start_acc: float | None  # the validation accuracy of the epoch it resumed after (None: fresh, or not saved)


def refused(a: argparse.Namespace) -> str | None:
    """What this program does not accept (wlcommon.parse_args)."""
    if a.model != "resnet50":  # tf-keras's ResNet50 is this program's one model: not another silently
        return f"--model {a.model} is for train_torch.py; train_tf.py trains resnet50 (leave --model out)"
    if a.powersgd_rank < 1:
        return "--powersgd-rank must be >= 1"
    if a.accumulate < 1 or a.collective_timeout_s < 0 or a.tf_bytes_per_pack < 0:
        return "--accumulate must be >= 1, --collective-timeout-s and --tf-bytes-per-pack >= 0"
    return None


def setup_worker(a: argparse.Namespace) -> tfworker.Worker:
    """Rank from TF_CONFIG, CPU threads, the strategy (coordination service first), the seeds."""
    rank, world = tfworker.worker_info()
    if world == 1 and os.environ.get("CLUSTER_DDP_ALONE") != "1":  # (bench: the compression's own compute)
        a.grad_compression = "none"  # nothing goes on a wire
    threads = wlcommon.threads_per_process(a.threads, 1)
    loaders = wlcommon.loader_workers(a.loader_workers, bool(tf.config.list_physical_devices("GPU")), 1)
    # intra-op and inter-op pools both from `threads`, as train_torch.py does: at threads=N both frameworks get
    # the same CPU budget (left alone, the inter-op pool runs 2 threads whatever `threads` says; issue 13)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    options = tfworker.communication_options(a)
    strategy = tfworker.make_strategy(world, options, a.collective_timeout_s)
    tf.random.set_seed(a.seed)
    keras.utils.set_random_seed(a.seed)
    return tfworker.Worker(rank, world, threads, loaders, options, strategy)


def build_training(a: argparse.Namespace, w: tfworker.Worker, metrics: wlmetrics.MetricsWriter) -> Training:
    """The data, every worker's batch, the Trainer (resumed from the newest checkpoint any worker
    holds, resume_newest); writes the start record."""
    ds = wldata.open_prepared(a.data) if a.data else wldata.load(a.dataset, a.data_path, a.size, a.seed)
    mean, std = ds.normalization()
    vidx = np.arange(w.rank, len(ds.x_val), w.world)
    train = normalize(ds.x_train, mean, std), ds.y_train
    val = normalize(ds.x_val[vidx], mean, std), ds.y_val[vidx]
    batch = wlcommon.my_batch(a.shares, os.environ.get("CLUSTER_NODE_NAME"), a.batch)
    batches = [batch]
    if w.world > 1:  # learn every worker's batch
        batches = [int(b) for b in tfworker.allsum(w.strategy, np.eye(w.world)[w.rank] * batch)]
    plan = wlcommon.plan_batches(a, batch, batches, len(ds.x_train))
    tr = Trainer(w.strategy, ds.classes, a.size, a, plan.global_batch, w.options)
    shapes = [tuple(v.shape) for v in tr.model.trainable_variables]
    # PowerSGD's start step; 0 with powersgd_start_step 1: its memory from the first step (no buckets to rebuild)
    psgd_start = wlcommon.fp16_steps(a.powersgd_start_step, plan.steps_per_epoch, a.warmup_epochs, a.epochs)
    comp = wlcommon.Compression(a.grad_compression, tfcomm.torch_shapes(shapes), w.world, a.powersgd_rank,
                                tfcomm.StepCount(0, psgd_start) if a.grad_compression == "powersgd" else None,
                                from_first=psgd_start == 0, powersgd_wire=a.powersgd_wire)
    ckpt = tf.train.Checkpoint(model=tr.model, optimizer=tr.opt, epoch=tr.epoch, step=tr.step, val_acc=tr.val_acc)
    resumed = resume_newest(w, tr, ckpt, metrics.dir / "checkpoint") if a.resume == "auto" else "none"
    start_epoch, step, acc = int(tr.epoch.numpy()) + 1, int(tr.step.numpy()), float(tr.val_acc.numpy())
    wlcommon.check_continued(a, start_epoch, acc if acc >= 0 else None)
    if isinstance(comp.state, tfcomm.StepCount):
        comp.state.iter = step  # resumed: fp16 or PowerSGD as the steps done say
    device = "cpu" if not tf.config.list_physical_devices("GPU") else "gpu"
    metrics.start(**wlmetrics.run_fields(a, ds, plan, start_epoch, world=w.world, local_rank=0, device=device,
                                         amp=False, start_step=step),
                  tensorflow=tf.__version__, threads=w.threads,
                  interop_threads=tf.config.threading.get_inter_op_parallelism_threads(), loader_workers=w.loaders,
                  backend="mwms" if w.world > 1 else "none", collective_timeout_s=a.collective_timeout_s,
                  resumed_from=resumed,
                  heartbeat_timeout_s=a.collective_timeout_s if w.world > 1 and a.collective_timeout_s else None,
                  tf_implementation=a.tf_implementation, tf_bytes_per_pack=a.tf_bytes_per_pack,
                  **wlmetrics.compression_fields(comp, a, psgd_start), bn_recompute=a.bn_recompute,
                  **plan.start_fields(), **comp.volume)
    return Training(a, w, ds, train, val, tr, plan, comp, ckpt, metrics, start_epoch, step, acc if acc >= 0 else None)


def train_epoch(t: Training, epoch: int) -> float:
    """One epoch's steps, its evaluation and its record; then every worker writes the checkpoint. Returns
    the validation accuracy."""
    a, w, plan, tr = t.a, t.worker, t.plan, t.trainer
    (xtr, ytr), (xva, yva) = t.train, t.val
    order = wlcommon.epoch_order(len(xtr), a.seed, epoch)
    mine = order[wldata.shard(len(order), w.rank, w.world)]

    def gather(i: int) -> tuple[np.ndarray, np.ndarray]:
        idx = order[wlcommon.batch_slice(i, plan.step_batches, w.rank)]
        return xtr[idx], ytr[idx]

    feed = iter(wldata.Prefetcher(gather, plan.steps_per_epoch, w.loaders))

    def fetch() -> tuple[tf.Tensor, tf.Tensor]:
        xb, yb = next(feed)
        return tf.constant(xb), tf.constant(yb)

    def train(batch: tuple[tf.Tensor, tf.Tensor], lr: float) -> wlmetrics.StepOutcome:
        tr.opt.learning_rate.assign(lr)
        sent = t.comp.bytes_sent_ring()
        step = tr.train_step
        if isinstance(t.comp.state, tfcomm.StepCount):
            step = tr.powersgd_step if t.comp.compressing() else tr.train_step
            t.comp.state.iter += 1
        return wlmetrics.StepOutcome(float(step(*batch).numpy()), int(batch[1].shape[0]), sent)

    t.step, tally = wlmetrics.run_steps(t.metrics, plan, a.log_every, epoch, t.step, fetch, train)
    train_loss = tfworker.allsum(w.strategy, np.array([tally.loss_sum, tally.samples]))
    if a.bn_recompute:
        few = min(wlcommon.bn_samples(a.bn_recompute, w.world), len(mine))
        tr.recompute_bn(xtr[mine[:few]], plan.batch, few)
    val_loss, val_acc = tr.evaluate(xva, yva, max_len=-(-len(t.ds.x_val) // w.world))
    n = wlcommon.train_acc_samples(w.world)  # this worker's share of the training accuracy's sample
    _, tr_acc = tr.evaluate(xtr[mine[:n]], ytr[mine[:n]], max_len=min(n, len(mine)))
    scores = wlmetrics.EpochScores(float(train_loss[0] / train_loss[1]), tr_acc, val_loss, val_acc)
    t.metrics.epoch(epoch, t.step, tally, plan, scores, int(t.comp.volume["bytes_sent_per_step_ring"]))
    tr.epoch.assign(epoch)
    tr.step.assign(t.step)
    tr.val_acc.assign(val_acc)
    save_checkpoint(t.ckpt, t.metrics.dir / "checkpoint")
    return float(val_acc)


def main(argv: list[str] | None = None) -> int:
    a = wlcommon.parse_args(__doc__, argv, refused)
    cpu = wlmetrics.CpuMeter()
    w = setup_worker(a)
    metrics = wlmetrics.MetricsWriter(Path(a.out), w.rank, "tensorflow")
    t = build_training(a, w, metrics)
    epoch, acc = t.start_epoch, t.start_acc
    while wlcommon.trains(a, epoch, acc):
        t.plan = t.plan.lasting(max(a.epochs, epoch + 1))
        acc = train_epoch(t, epoch)
        epoch += 1
    metrics.finish(a, t.ds, w.world, t.plan, epoch - t.start_epoch, t.step, cpu, acc)
    tfworker.wait_for_all_workers(w.world)
    return 0


CKPT_SLOTS = ("ckpt-a", "ckpt-b")  # OUT/checkpoint/ckpt-?.index, .data-*; OUT/checkpoint/checkpoint names the last


def save_checkpoint(ckpt: tf.train.Checkpoint, ckpt_dir: Path) -> None:
    """Every worker writes the whole checkpoint into its own OUT/checkpoint/ (MWMS needs all of them to
    take part: reading the sync-on-read BatchNorm statistics is a collective), so every node holds every
    checkpoint and whichever nodes survive a failure can resume. TF writes a checkpoint's files in place,
    so it goes to the slot the index does not name, and only then is the index (what
    tf.train.latest_checkpoint reads) replaced atomically: a crash mid-write leaves the last one whole."""
    last = tf.train.latest_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None
    slot = CKPT_SLOTS[1] if last and Path(last).name == CKPT_SLOTS[0] else CKPT_SLOTS[0]
    ckpt.write(str(ckpt_dir / slot))
    tmp = ckpt_dir / "checkpoint.tmp"
    tmp.write_text(f'model_checkpoint_path: "{slot}"\nall_model_checkpoint_paths: "{slot}"\n')
    os.replace(tmp, ckpt_dir / "checkpoint")


def resume_newest(w: tfworker.Worker, tr: Trainer, ckpt: tf.train.Checkpoint, ckpt_dir: Path) -> str:
    """Every worker restores its own latest checkpoint, if it has one (a restart after a node died gives
    the survivors new ranks, so the chief's disk may hold an older one or none); the workers agree on one
    (wlcommon.resume_source) and everyone takes its values, unless every worker restored that same save
    point: then nothing is sent. A worker without a checkpoint joins the collectives all the same, as does
    one whose checkpoint cannot be read (readable_checkpoint): it takes the source's values. Returns where
    the values came from: "none" (a fresh start), "each" or "rank R"."""
    latest = readable_checkpoint(ckpt_dir)
    if latest:
        ckpt.read(latest).expect_partial()
    if w.world == 1:
        return "each" if latest else "none"
    with tr.strategy.scope():  # momentum slots exist only after the first apply: built (their deferred
        tr.opt.build(tr.model.trainable_variables)  # restore happens here) so that they can be sent
    mine = (int(tr.epoch.numpy()), int(tr.step.numpy())) if latest else (-1, -1)
    one = np.eye(w.world)[w.rank]  # each worker's (epoch, step) in its own places of the sum
    held = tfworker.allsum(w.strategy, np.concatenate([one * mine[0], one * mine[1]]))
    src, source = wlcommon.resume_source([(int(e), int(s)) for e, s in zip(held[:w.world], held[w.world:])])
    if source not in ("none", "each"):  # none: MWMS already gave all workers the chief's initial values
        tr.broadcast_from(source=w.rank == src)
    return source


def readable_checkpoint(ckpt_dir: Path) -> str | None:
    """The latest checkpoint in `ckpt_dir` (its prefix), every tensor of it read once before anything is
    restored from it, so a damaged one restores nothing; None where there is none, or where it cannot be
    read (wlcommon.unreadable_checkpoint: the resume takes the newest another worker holds)."""
    latest: str | None = None
    try:
        latest = tf.train.latest_checkpoint(str(ckpt_dir))
        if latest:
            reader = tf.train.load_checkpoint(latest)
            for name in reader.get_variable_to_shape_map():
                reader.get_tensor(name)
    except Exception as e:  # noqa: BLE001 - TF raises its own errors (DataLossError, ...) and the protobuf parser's
        wlcommon.unreadable_checkpoint(latest or ckpt_dir, e, "worker")
        return None
    return latest


if __name__ == "__main__":
    sys.exit(main())
