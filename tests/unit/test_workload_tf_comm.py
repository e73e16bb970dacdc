"""fp16 all-reduce, PowerSGD and gradient accumulation in the TensorFlow program: 2 MWMS workers on
loopback.

The Trainer of train_tf.py runs a tiny Keras model here (build_model replaced) in float64, so the
comparisons see the arithmetic and the runs take seconds, not minutes.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_workload_tf import _free_ports, _run

WL = Path(__file__).resolve().parents[2] / "cluster" / "programs"

pytestmark = pytest.mark.slow  # runs the TensorFlow program's workers: left out of the quick tier

HELPER = f"""
import argparse, sys
import numpy as np
sys.path.insert(0, {str(WL)!r})
import tf_keras as keras
keras.backend.set_floatx("float64")
import tensorflow as tf
import tfworker, train_tf, wlcommon


def tiny(classes, size):
    return keras.Sequential([keras.layers.Input((size, size, 3)),
                             keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(classes)])


train_tf.build_model = tiny
mode, init, data, out, split, k, comp = sys.argv[1:8]
psgd_rank, wire = (int(sys.argv[8]), sys.argv[9]) if len(sys.argv) > 9 else (1, "float32")
split, k = [int(b) for b in split.split(",")], int(k)
rank, world = tfworker.worker_info()
a = argparse.Namespace(lr=0.01, momentum=0.9, weight_decay=5e-4, accumulate=k if world > 1 else 1,
                       grad_compression=comp, tf_implementation="ring", tf_bytes_per_pack=0,
                       collective_timeout_s=60.0, seed=0, powersgd_rank=psgd_rank, powersgd_wire=wire)
options = tfworker.communication_options(a)
strategy = tfworker.make_strategy(world, options, a.collective_timeout_s)
n = k * sum(split)  # samples per optimizer step
tr = train_tf.Trainer(strategy, 10, 8, a, global_batch=n, comm_options=options)
if mode == "init":
    np.savez(init, *tr.model.get_weights())
    sys.exit(0)
with np.load(init) as w:
    tr.model.set_weights([w[f"arr_{{i}}"] for i in range(len(w.files))])
with np.load(data) as d:
    x, y = d["x"], d["y"]
variables = tr.model.trainable_variables
import ml_dtypes
NP_WIRE = {{"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}}[wire]


def wire_sum(parts):  # what the all-reduce of two workers returns: their sum on the wire's dtype
    return (parts[0].astype(NP_WIRE) + parts[1].astype(NP_WIRE)).astype(np.float64)


def qr(m):
    return np.linalg.qr(m)[0]


if mode == "psgdref":  # by hand, in numpy: PowerSGD as torch's hook does it, for two workers
    mats = {{}}  # variable index -> (n, m, r): torch's view (output channels first) and rule
    for i, v in enumerate(variables):
        if len(v.shape) > 1:
            n, m_ = v.shape[-1], int(np.prod(v.shape[:-1]))
            r = min(n, m_, psgd_rank)
            if (n + m_) * r * 2 < n * m_:
                mats[i] = (n, m_, r)
    qs = {{i: np.random.default_rng([0, i]).standard_normal((m_, r)) for i, (n, m_, r) in mats.items()}}
    errs = [{{i: np.zeros((n, m_)) for i, (n, m_, r) in mats.items()}} for _ in split]
for step in range(2):  # two steps: the momentum slots are exercised too
    tr.opt.learning_rate.assign(0.01)
    if mode == "fp16ref":  # by hand: each worker's gradient, cast to float16, summed in float16
        total = None
        for r in range(len(split)):
            part = wlcommon.batch_slice(step, split, r)
            _, g = tr._local_grads(tf.constant(x[part]), tf.constant(y[part]))
            h = [tf.cast(tf.cast(gi, tf.float16), tf.float64) for gi in g]  # exact in float64
            total = h if total is None else [s + t for s, t in zip(total, h)]
        grads = [tf.cast(tf.cast(s, tf.float16), tf.float64) + 5e-4 * v for s, v in zip(total, variables)]
        tr.opt.apply_gradients(zip(grads, variables))
    elif mode == "psgdref":
        gs = []
        for r in range(len(split)):
            part = wlcommon.batch_slice(step, split, r)
            gs.append([g.numpy() for g in tr._local_grads(tf.constant(x[part]), tf.constant(y[part]))[1]])
        grads = []
        for i, v in enumerate(variables):
            if i not in mats:
                grads.append(wire_sum([g[i] for g in gs]))
                continue
            n = mats[i][0]
            ms = [g[i].reshape(-1, n).T + e[i] for g, e in zip(gs, errs)]
            p = qr(wire_sum([mw @ qr(qs[i]) for mw in ms]))
            qs[i] = wire_sum([mw.T @ p for mw in ms])
            approx = p @ qs[i].T
            for e, mw in zip(errs, ms):
                e[i] = mw - approx / 2
            grads.append(approx.T.reshape(v.shape))
        tr.opt.apply_gradients(zip([tf.constant(g) + 5e-4 * v for g, v in zip(grads, variables)], variables))
    elif world > 1:
        part = wlcommon.batch_slice(step, [k * b for b in split], rank)  # as the program feeds it
        (tr.powersgd_step if comp == "powersgd" else tr.train_step)(tf.constant(x[part]), tf.constant(y[part]))
    else:
        tr.train_step(tf.constant(x[step * n:(step + 1) * n]), tf.constant(y[step * n:(step + 1) * n]))
weights = tr.model.get_weights()
if rank == 0:
    np.savez(out, *weights)
tfworker.wait_for_all_workers(world)
"""




def _ok(*procs: subprocess.Popen) -> None:
    results = [p.communicate(timeout=600) for p in procs]
    for p in procs:
        assert p.returncode == 0, "\n---\n".join(e[-2500:] for _, e in results)


def _two_workers(helper: Path, args: list[str]) -> None:
    cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(2)]}
    _ok(*[_run(helper, args, {"cluster": cluster, "task": {"type": "worker", "index": i}}) for i in range(2)])


def _setup(tmp: Path, samples: int) -> tuple[Path, Path, Path]:
    helper = tmp / "helper.py"
    helper.write_text(HELPER)
    init, data = tmp / "init.npz", tmp / "data.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.standard_normal((samples, 8, 8, 3)), y=rng.integers(0, 10, samples))
    _ok(_run(helper, ["init", str(init), str(data), "-", "4,4", "1", "none"]))
    return helper, init, data


def _delta(init: Path, a: Path, b: Path) -> tuple[float, int]:
    """Largest difference between the two runs' weight changes, relative to the change; layers moved."""
    worst, moved = 0.0, 0
    with np.load(init) as w0, np.load(a) as s, np.load(b) as m:
        for key in w0.files:
            d_a, d_b = s[key] - w0[key], m[key] - w0[key]
            scale = np.abs(d_a).max()
            moved += int(scale > 0)
            worst = max(worst, float(np.abs(d_b - d_a).max() / max(scale, 1e-300)))
    return worst, moved


def test_tf_fp16_step_on_two_workers_equals_a_step_with_the_fp16_rounded_sum(tmp_path: Path) -> None:
    helper, init, data = _setup(tmp_path, 16)
    _ok(_run(helper, ["fp16ref", str(init), str(data), str(tmp_path / "ref.npz"), "4,4", "1", "fp16"]),
        _run(helper, ["train", str(init), str(data), str(tmp_path / "plain.npz"), "4,4", "1", "none"]))
    _two_workers(helper, ["train", str(init), str(data), str(tmp_path / "mwms.npz"), "4,4", "1", "fp16"])
    worst, moved = _delta(init, tmp_path / "ref.npz", tmp_path / "mwms.npz")
    assert moved == 6  # every kernel and bias changed
    assert worst <= 1e-9
    rounding, _ = _delta(init, tmp_path / "plain.npz", tmp_path / "mwms.npz")
    assert rounding > 1e-6  # and float16 really was on the wire: it differs from the float32 step


@pytest.mark.parametrize("split", ["2,2", "1,3"], ids=["even", "uneven"])
def test_tf_accumulated_micro_batches_on_two_workers_equal_one_step_on_the_concatenated_batch(
        tmp_path: Path, split: str) -> None:
    helper, init, data = _setup(tmp_path, 16)  # two steps of 2 workers x 2 micro-batches (8 samples)
    _ok(_run(helper, ["train", str(init), str(data), str(tmp_path / "single.npz"), split, "2", "none"]))
    _two_workers(helper, ["train", str(init), str(data), str(tmp_path / "mwms.npz"), split, "2", "none"])
    worst, moved = _delta(init, tmp_path / "single.npz", tmp_path / "mwms.npz")
    assert moved == 6
    assert worst <= 1e-9


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_tf_powersgd_on_two_workers_equals_torchs_algorithm_done_by_hand(tmp_path: Path, wire: str) -> None:
    """Two PowerSGD steps (rank 1: every kernel compressed, the biases not) on two MWMS workers against the
    algorithm of torch's hook in numpy on each worker's gradient (error feedback and warm start carried into
    the second step, the sums on the wire's dtype); and it is not the plain all-reduce's step."""
    helper, init, data = _setup(tmp_path, 16)
    ref, plain, mwms = (tmp_path / f"{n}.npz" for n in ("ref", "plain", "mwms"))
    _ok(_run(helper, ["psgdref", str(init), str(data), str(ref), "4,4", "1", "none", "1", wire]),
        _run(helper, ["train", str(init), str(data), str(plain), "4,4", "1", "none"]))
    _two_workers(helper, ["train", str(init), str(data), str(mwms), "4,4", "1", "powersgd", "1", wire])
    worst, moved = _delta(init, ref, mwms)
    assert moved == 6
    assert worst <= 1e-6
    compressed, _ = _delta(init, plain, mwms)
    assert compressed > 1e-2  # a rank-1 approximation, not the full gradient


@pytest.mark.parametrize(("args", "says"), [
    (["--grad-compression", "powersgd", "--powersgd-rank", "0"], "--powersgd-rank must be >= 1"),
    (["--model", "resnet18"], "--model resnet18 is for train_torch.py; train_tf.py trains resnet50"),
], ids=["powersgd-rank", "another-model"])
def test_tf_program_refuses_what_it_cannot_do_with_a_clear_message(tmp_path: Path, args: list[str],
                                                                   says: str) -> None:
    r = subprocess.run([sys.executable, str(WL / "train_tf.py"), *args, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2
    assert says in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())  # refused before it wrote anything
