"""The TensorFlow program's arithmetic: 2 MWMS workers on loopback == 1 process on the whole batch."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WL = Path(__file__).resolve().parents[2] / "cluster" / "programs"

pytestmark = pytest.mark.slow  # runs the TensorFlow program and its workers: left out of the quick tier

HELPER = f"""
import argparse, sys
import numpy as np
sys.path.insert(0, {str(WL)!r})
import tf_keras as keras
keras.backend.set_floatx("float64")  # the comparison sees the arithmetic, not float32 rounding
import tensorflow as tf
import tfworker, train_tf

mode, init, data, out = sys.argv[1:5]
rank, world = tfworker.worker_info()
strategy = tf.distribute.MultiWorkerMirroredStrategy() if world > 1 else tf.distribute.get_strategy()
a = argparse.Namespace(lr=0.01, momentum=0.9, weight_decay=5e-4)
tr = train_tf.Trainer(strategy, 10, 32, a, global_batch=8)
if mode == "init":
    np.savez(init, *tr.model.get_weights())
    sys.exit(0)
# BN statistics are per worker in MWMS (as in DDP): hold BN in inference mode for the comparison
for layer in tr.model.layers:
    if isinstance(layer, keras.layers.BatchNormalization):
        layer.trainable = False
with np.load(init) as w:
    tr.model.set_weights([w[f"arr_{{i}}"] for i in range(len(w.files))])
import wlcommon
split = [int(b) for b in sys.argv[5].split(",")][:world] if world > 1 else [8]
with np.load(data) as d:
    part = wlcommon.batch_slice(0, split, rank)  # this worker's share of the 8 samples
    x, y = d["x"][part], d["y"][part]
for _ in range(2):  # two steps: the momentum slots are exercised too
    tr.opt.learning_rate.assign(0.01)
    tr.train_step(tf.constant(x), tf.constant(y))
weights = tr.model.get_weights()  # on every worker: reading BN's sync-on-read variables is a collective
if rank == 0:
    np.savez(out, *weights)
tfworker.wait_for_all_workers(world)
"""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run(helper: Path, args: list[str], tf_config: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TF_CONFIG", None)
    if tf_config:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return subprocess.Popen([sys.executable, str(helper), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _ok(p: subprocess.Popen) -> None:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]


def test_mwms_step_on_two_workers_equals_one_step_on_the_concatenated_batch(tmp_path: Path) -> None:
    """Shares of 3 and 5 of the 8 samples: an even split would hide a worker's share weighed wrongly."""
    split = "3,5"
    helper = tmp_path / "helper.py"
    helper.write_text(HELPER)
    init, data = tmp_path / "init.npz", tmp_path / "data.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.standard_normal((8, 32, 32, 3)), y=rng.integers(0, 10, 8))
    _ok(_run(helper, ["init", str(init), str(data), "-", split]))
    _ok(_run(helper, ["train", str(init), str(data), str(tmp_path / "single.npz"), split]))
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = [_run(helper, ["train", str(init), str(data), str(tmp_path / "mwms.npz"), split],
                  {"cluster": cluster, "task": {"type": "worker", "index": i}}) for i in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, "\n---\n".join(e[-2500:] for _, e in results)
    with np.load(init) as w0, np.load(tmp_path / "single.npz") as s, np.load(tmp_path / "mwms.npz") as m:
        moved = 0
        for k in w0.files:
            d_single, d_mwms = s[k] - w0[k], m[k] - w0[k]
            scale = np.abs(d_single).max()
            assert np.abs(d_mwms - d_single).max() <= 1e-9 * scale + 1e-12, k
            moved += int(scale > 0)
    assert moved > 100  # the steps really changed the weights


def _tf_program(out: Path, wait: bool = True, *extra: str):
    cmd = [sys.executable, str(WL / "train_tf.py"), "--dataset", "digits", "--epochs", "2", "--batch", "32",
           "--max-steps", "3", "--log-every", "1", "--threads", "1", "--out", str(out), *extra]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TF_CONFIG", None)
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def test_tf_resume_after_a_stop_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    import signal
    import time

    bn = ("--bn-recompute", "64")  # BatchNorm recomputed before each evaluation: saved, resumed, training unmoved
    whole = _tf_program(tmp_path / "whole", True, *bn)
    assert whole.returncode == 0, whole.stderr[-2000:]
    p = _tf_program(tmp_path / "stopped", False, *bn)
    marker = tmp_path / "stopped" / "checkpoint" / "checkpoint"
    deadline = time.monotonic() + 600
    while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # let the chief finish writing epoch 0's files
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    again = _tf_program(tmp_path / "stopped", True, *bn)
    assert again.returncode == 0, again.stderr[-2000:]

    def records(d: Path) -> list[dict]:
        return [json.loads(x) for x in (d / "metrics-rank0.jsonl").read_text().splitlines()]

    a, b = records(tmp_path / "whole"), records(tmp_path / "stopped")
    assert [r["start_epoch"] for r in b if r["type"] == "start"] == [0, 1]
    assert {r["bn_recompute"] for r in a + b if r["type"] == "start"} == {64}
    last_a = [r for r in a if r["type"] == "epoch"][-1]
    last_b = [r for r in b if r["type"] == "epoch"][-1]
    assert (last_a["epoch"], last_a["step"]) == (last_b["epoch"], last_b["step"]) == (1, 6)
    resumed = b[max(i for i, r in enumerate(b) if r["type"] == "start"):]  # the killed run may have logged
    assert [r["lr"] for r in a if r["type"] == "step" and r["epoch"] == 1] == \
           [r["lr"] for r in resumed if r["type"] == "step" and r["epoch"] == 1]  # part of epoch 1 already
    assert abs(last_a["train_loss"] - last_b["train_loss"]) < 1e-4 * max(1.0, abs(last_a["train_loss"]))


def test_a_checkpoint_goes_to_the_slot_the_index_does_not_name(tmp_path: Path) -> None:
    """TF writes a checkpoint's files in place: a save cut short must leave the last whole one named by the
    index. Two saves use both slots; a torn slot that the index does not name is never read."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2] / "cluster" / "programs")!r})
from pathlib import Path
import tensorflow as tf
import train_tf
d = Path({str(tmp_path)!r}) / "checkpoint"
v = tf.Variable(1.0)
ck = tf.train.Checkpoint(v=v)
train_tf.save_checkpoint(ck, d)
first = tf.train.latest_checkpoint(str(d))
v.assign(2.0)
train_tf.save_checkpoint(ck, d)
second = tf.train.latest_checkpoint(str(d))
for f in d.glob(Path(first).name + ".*"):
    f.write_bytes(b"torn")  # the next save, cut short, would leave this
v.assign(0.0)
ck.read(tf.train.latest_checkpoint(str(d))).expect_partial()
print(Path(first).name, Path(second).name, float(v.numpy()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-3:] == ["ckpt-a", "ckpt-b", "2.0"]


BN_HELPER = f"""
import argparse, sys
import numpy as np
sys.path.insert(0, {str(WL)!r})
import tf_keras as keras
keras.backend.set_floatx("float64")
import tensorflow as tf
import tfworker, train_tf

data, out = sys.argv[1:3]
rank, world = tfworker.worker_info()
strategy = tf.distribute.MultiWorkerMirroredStrategy() if world > 1 else tf.distribute.get_strategy()
tf.keras.utils.set_random_seed(0)
keras.utils.set_random_seed(0)
tr = train_tf.Trainer(strategy, 10, 32, argparse.Namespace(lr=0.01, momentum=0.9, weight_decay=5e-4), global_batch=8)
with np.load(data) as d:
    x = d["x"][rank * 8 // world:(rank + 1) * 8 // world]
conv1 = keras.Model(tr.model.inputs, tr.model.get_layer("conv1_conv").output)
by_hand = np.mean([conv1(x[i:i + 2], training=True).numpy().mean(axis=(0, 1, 2)) for i in range(0, len(x), 2)], axis=0)
trainable = [w.numpy() for w in tr.model.trainable_weights]
tr.recompute_bn(x, 2, len(x))
assert tr.model.get_layer("conv1_bn").momentum == 0.9  # restored
assert all(np.array_equal(a, w.numpy()) for a, w in zip(trainable, tr.model.trainable_weights))  # nothing learned
bn = tr.model.get_layer("conv1_bn")
stats = [np.asarray(tf.convert_to_tensor(v)) for l in tr.model.layers
         if isinstance(l, keras.layers.BatchNormalization) for v in (l.moving_mean, l.moving_variance)]
if rank == 0:
    np.savez(out, by_hand=by_hand, *stats)
tfworker.wait_for_all_workers(world)
"""


def test_tf_recompute_bn_is_the_plain_average_and_two_workers_match_one(tmp_path: Path) -> None:
    """Precise BatchNorm in the TensorFlow program: on one process the first layer's moving mean is the plain
    average of its 4 batches' means (worked out by hand from the conv's output); on 2 MWMS workers with 2
    batches each, every BatchNorm statistic equals the one process's (the workers' mean of their averages)."""
    helper = tmp_path / "bn.py"
    helper.write_text(BN_HELPER)
    data = tmp_path / "data.npz"
    np.savez(data, x=np.random.default_rng(1).standard_normal((8, 32, 32, 3)) * 2 + 0.5)
    _ok(_run(helper, [str(data), str(tmp_path / "one.npz")]))
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = [_run(helper, [str(data), str(tmp_path / "two.npz")], {"cluster": cluster, "task": {"type": "worker",
                                                                                               "index": i}})
             for i in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, "\n---\n".join(e[-2500:] for _, e in results)
    with np.load(tmp_path / "one.npz") as one, np.load(tmp_path / "two.npz") as two:
        assert np.allclose(one["arr_0"], one["by_hand"], rtol=1e-9, atol=1e-12)  # conv1_bn's moving mean
        stats = [k for k in one.files if k.startswith("arr_")]
        assert len(stats) == 2 * 53
        for k in stats:
            assert np.allclose(one[k], two[k], rtol=1e-9, atol=1e-12), k


def test_tf_trains_on_to_its_target_with_a_continued_runs_schedule_and_ends_there(tmp_path: Path) -> None:
    """As train_torch.py (wlcommon.trains): short of --target-acc after --epochs, one more epoch at the rates
    of a 2-epoch run's second, then the end; restarted, the checkpoint says the run is done. A reachable
    target ends the run at the first epoch that reaches it."""
    from cluster.programs import wlcommon

    def records(d: Path) -> list[dict]:
        return [json.loads(x) for x in (d / "metrics-rank0.jsonl").read_text().splitlines()]

    on = ("--epochs", "1", "--target-acc", "1.0", "--max-epochs", "2")
    r = _tf_program(tmp_path / "on", True, *on)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = records(tmp_path / "on")
    start = recs[0]
    assert (start["epochs"], start["target_acc"], start["max_epochs"], start["steps_per_epoch"]) == (1, 1.0, 2, 3)
    assert [x["epoch"] for x in recs if x["type"] == "epoch"] == [0, 1]
    want = [wlcommon.lr_at(s, 3, 2, start["peak_lr"], start["warmup_epochs"], start["schedule"]) for s in (3, 4, 5)]
    assert [x["lr"] for x in recs if x["type"] == "step" and x["epoch"] == 1] == pytest.approx(want, rel=1e-9)
    assert (recs[-1]["epochs_done"], recs[-1]["target_reached"]) == (2, False)
    again = _tf_program(tmp_path / "on", True, *on)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (records(tmp_path / "on")[-1]["epochs_done"], records(tmp_path / "on")[-1]["target_reached"]) == (0, False)
    hit = _tf_program(tmp_path / "hit", True, "--target-acc", "0.01", "--accumulate", "2", "--lr-scaling", "sqrt")
    assert hit.returncode == 0, hit.stderr[-2000:]
    recs = records(tmp_path / "hit")
    assert [x["epoch"] for x in recs if x["type"] == "epoch"] == [0]
    # sqrt: 2 micro-batches of 32 a step give the rate of 32 x sqrt(2), not of 64
    assert (recs[0]["lr_scaling"], recs[0]["global_batch"]) == ("sqrt", 64)
    assert recs[0]["peak_lr"] == pytest.approx(0.01 * 32 / 64 * 2 ** 0.5, rel=1e-12)
    assert (recs[-1]["epochs_done"], recs[-1]["target_reached"]) == (1, True)
