"""Training throughput on a 2-node simulated lab: our programs vs plain loops, torch vs TF.

    .venv/bin/python benchmarks/workload.py [--steps 12] [--repeats 2]

Rows (same model, data, per-worker batch, 1 thread per process, same run):
  plain DDP loop        torchvision ResNet50 + DDP + SGD, nothing else (written here)
  train_torch.py        our PyTorch program (metrics, LR schedule, evaluation off the clock)
  plain model.fit       tf-keras ResNet50 under MultiWorkerMirroredStrategy, model.fit on numpy
  train_tf.py           our TensorFlow program
Images/s of the second epoch (the first pays graph tracing and warm-up). The nodes
use the head's .venv through the shared filesystem (the inventory explicitly reuses
that interpreter). Contacts only the lab it starts; removes it at the end.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import lab_parser  # noqa: E402
from cluster.lab import lifecycle  # noqa: E402
from cluster.inventory import loader
from cluster.nodes.fanout import Group  # noqa: E402

PY = sys.executable
WL = ROOT / "cluster" / "programs"

PLAIN_TORCH = """
import os, sys, time, json, datetime
import numpy as np, torch, torch.distributed as dist, torch.nn.functional as F, torchvision
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
rank, world = dist.get_rank(), dist.get_world_size()
d = np.load(sys.argv[1]); steps, batch = int(sys.argv[2]), int(sys.argv[3])
x = torch.from_numpy(d["x_train"]).float().div(255).permute(0, 3, 1, 2).contiguous()
y = torch.from_numpy(d["y_train"])
model = torch.nn.parallel.DistributedDataParallel(torchvision.models.resnet50(weights=None, num_classes=10))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
times = []
for epoch in range(2):
    t = time.perf_counter()
    for i in range(steps):
        j = (rank + i * world) * batch
        opt.zero_grad(); F.cross_entropy(model(x[j:j + batch]), y[j:j + batch]).backward(); opt.step()
    times.append(time.perf_counter() - t)
if rank == 0:
    print(json.dumps({"images_per_s": steps * batch * world / times[1]}))
"""

PLAIN_TF = """
import os, sys, time, json
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, tensorflow as tf, tf_keras as keras
tf.config.threading.set_intra_op_parallelism_threads(1)
strategy = tf.distribute.MultiWorkerMirroredStrategy()
d = np.load(sys.argv[1]); steps, batch = int(sys.argv[2]), int(sys.argv[3])
world = strategy.num_replicas_in_sync
x = d["x_train"].astype("float32") / 255.0; y = d["y_train"]
n = steps * batch * world
with strategy.scope():
    model = keras.applications.ResNet50(weights=None, input_shape=x.shape[1:], classes=10)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
class T(keras.callbacks.Callback):
    times = []
    def on_epoch_begin(self, e, logs=None): self.t = time.perf_counter()
    def on_epoch_end(self, e, logs=None): T.times.append(time.perf_counter() - self.t)
ds = tf.data.Dataset.from_tensor_slices((x[:n], y[:n])).batch(batch * world).repeat()
model.fit(ds, epochs=2, steps_per_epoch=steps, verbose=0, callbacks=[T()])
from tensorflow.python.eager import context
if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
    print(json.dumps({"images_per_s": n / T.times[1]}))
context.context().wait_at_barrier("bench-exit", 300000)
"""


def main() -> int:
    ap = lab_parser(__doc__, "wbench", "10.71.0.0/24", repeats=2)
    ap.add_argument("--steps", type=int, default=12, help="steps per epoch")
    ap.add_argument("--batch", type=int, default=32, help="per-worker batch")
    args = ap.parse_args()
    nodes = 2 if args.nodes == 16 else args.nodes
    tmp = Path(tempfile.mkdtemp(prefix="clusterctl-wbench-"))
    (tmp / "plain_torch.py").write_text(PLAIN_TORCH)
    (tmp / "plain_tf.py").write_text(PLAIN_TF)
    sys.path.insert(0, str(WL))
    import wldata

    wldata.save(wldata.load("digits"), tmp / "digits.npz")
    state = lifecycle.up(nodes, name=args.name, subnet=args.subnet, directory=tmp / "lab")
    try:
        inv = loader.load(state.inventory)
        master = state.nodes[0].address
        workers = json.dumps([f"{n.address}:23471" for n in state.nodes])
        rank = 'R=$(( ${HOSTNAME#node} - 1 )); cd /srv/cluster && export GLOO_SOCKET_IFNAME=eth0; '
        torchrun = f"{PY} -m torch.distributed.run --nnodes {nodes} --nproc_per_node 1 --node_rank $R " \
                   f"--master_addr {master} --master_port 29521"
        tfcfg = f"export TF_CONFIG='{{\"cluster\": {{\"worker\": {workers}}}, \"task\": {{\"type\": \"worker\", \"index\": '$R'}}}}'; "
        ours = f"--data {tmp}/digits.npz --epochs 2 --batch {args.batch} --max-steps {args.steps} --threads 1 " \
               f"--warmup-epochs 0 --resume no --log-every 1000"
        cmds = {
            "plain DDP loop": rank + f"{torchrun} {tmp}/plain_torch.py {tmp}/digits.npz {args.steps} {args.batch}",
            "train_torch.py": rank + f"rm -rf ddp; {torchrun} {WL}/train_torch.py {ours} --out ddp "
                                     "&& grep '\"type\": \"epoch\"' ddp/metrics-rank0.jsonl | tail -1",
            "plain model.fit": rank + tfcfg + f"{PY} {tmp}/plain_tf.py {tmp}/digits.npz {args.steps} {args.batch}",
            "train_tf.py": rank + tfcfg + f"rm -rf tf; {PY} {WL}/train_tf.py {ours} --out tf "
                                          "&& grep '\"type\": \"epoch\"' tf/metrics-rank0.jsonl | tail -1",
        }
        results: dict[str, list[float]] = {k: [] for k in cmds}
        with Group(inv.hosts.values()) as g:
            for _ in range(args.repeats):
                for name, cmd in cmds.items():
                    r = g.run(cmd, timeout=1800)
                    if not r.ok:
                        raise SystemExit(f"{name} failed: {json.dumps({k: v.to_dict() for k, v in r.items()})[-3000:]}")
                    line = [x for x in r["node1"].stdout.splitlines() if x.startswith("{")][-1]
                    results[name].append(json.loads(line)["images_per_s"])
    finally:
        lifecycle.down(args.name, tmp / "lab")
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nResNet50 on digits 32x32, {nodes} simulated nodes, batch {args.batch}/worker, "
          f"{args.steps} steps/epoch, median of {args.repeats}, images/s of epoch 2\n")
    print(f"| {'program':<18} | {'images/s':>9} | {'vs plain':>9} |")
    print(f"|{'-' * 20}|{'-' * 11}|{'-' * 11}|")
    for name, base in (("plain DDP loop", "plain DDP loop"), ("train_torch.py", "plain DDP loop"),
                       ("plain model.fit", "plain model.fit"), ("train_tf.py", "plain model.fit")):
        print(f"| {name:<18} | {med[name]:>9.1f} | {med[name] / med[base]:>8.3f}x |")
    print(f"\ntarget: ours within 3% of plain: torch {med['train_torch.py'] / med['plain DDP loop']:.3f}, "
          f"TF {med['train_tf.py'] / med['plain model.fit']:.3f}; "
          f"torch vs TF (ours): {med['train_torch.py'] / med['train_tf.py']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
