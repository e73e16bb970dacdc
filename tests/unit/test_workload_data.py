"""Dataset loaders on data the tests write in the real formats; the metrics schema."""
from __future__ import annotations

import io
import json
import pickle
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

WL = Path(__file__).resolve().parents[2] / "cluster" / "programs"
sys.path.insert(0, str(WL))
import wldata  # noqa: E402
import wlmetrics  # noqa: E402


def _cifar_batch(n: int, seed: int) -> tuple[dict, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n)
    # the real layout: bytes keys, rows of 3072 = R plane, G plane, B plane (each 32x32 row-major)
    batch = {b"batch_label": b"x", b"labels": [int(v) for v in labels],
             b"data": images.transpose(0, 3, 1, 2).reshape(n, 3072), b"filenames": [b"f"] * n}
    return batch, images, labels


def test_cifar10_archive_in_the_real_python_layout(tmp_path: Path) -> None:
    archive = tmp_path / "cifar-10-python.tar.gz"
    expected = {}
    with tarfile.open(archive, "w:gz") as tar:
        for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
            batch, images, labels = _cifar_batch(4, i)
            expected[name] = (images, labels)
            blob = pickle.dumps(batch, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    ds = wldata.load("cifar10", str(archive))
    assert ds.x_train.shape == (20, 32, 32, 3) and ds.x_val.shape == (4, 32, 32, 3) and ds.classes == 10
    assert np.array_equal(ds.x_train[:4], expected["data_batch_1"][0])  # planes put back as HWC, exactly
    assert np.array_equal(ds.x_val, expected["test_batch"][0]) and np.array_equal(ds.y_val, expected["test_batch"][1])
    # the extracted folder gives the same arrays
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    folder = wldata.load("cifar10", str(tmp_path / "x"))
    assert np.array_equal(folder.x_train, ds.x_train) and np.array_equal(folder.y_train, ds.y_train)
    with pytest.raises(FileNotFoundError, match="missing data_batch_1"):
        wldata.load("cifar10", str(tmp_path))


def test_imagefolder_on_generated_images(tmp_path: Path) -> None:
    colours = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}
    for cls, rgb in colours.items():
        (tmp_path / cls).mkdir()
        for i in range(5):
            Image.new("RGB", (20 + i, 17), rgb).save(tmp_path / cls / f"{i}.png")
    (tmp_path / "red" / "notes.txt").write_text("not an image")
    ds = wldata.load("imagefolder", str(tmp_path), size=16)
    assert ds.classes == 3 and len(ds.x_train) + len(ds.x_val) == 15 and len(ds.x_val) == 3
    x = np.concatenate([ds.x_train, ds.x_val])
    y = np.concatenate([ds.y_train, ds.y_val])
    assert x.shape[1:] == (16, 16, 3)
    sorted_rgb = [colours[c] for c in sorted(colours)]  # labels follow sorted class names
    for img, label in zip(x, y):
        assert tuple(img[8, 8]) == sorted_rgb[label]


def test_digits_split_is_fixed_and_shards_are_equal() -> None:
    a, b = wldata.load("digits"), wldata.load("digits")
    assert np.array_equal(a.y_val, b.y_val) and a.x_train.shape[1:] == (32, 32, 3)
    assert len(a.x_train) + len(a.x_val) == 1797
    shards = [wldata.shard(len(a.x_train), r, 3) for r in range(3)]
    assert len({len(s) for s in shards}) == 1 and not set(shards[0]) & set(shards[1])


def test_digits_aug_is_eight_variants_of_the_training_digits_and_validates_on_the_real_ones() -> None:
    base, aug = wldata.load("digits", size=32), wldata.load("digits-aug", size=32)
    assert len(aug.x_train) == 8 * len(base.x_train) >= 10_000 and aug.x_train.dtype == np.uint8
    assert np.array_equal(aug.x_train[:len(base.x_train)], base.x_train)  # the originals first
    assert np.array_equal(np.tile(base.y_train, 8), aug.y_train)
    assert np.array_equal(aug.x_val, base.x_val) and np.array_equal(aug.y_val, base.y_val)
    variant = aug.x_train[len(base.x_train):2 * len(base.x_train)].astype(int)
    changed = np.abs(variant - base.x_train.astype(int)).mean(axis=(1, 2, 3))
    assert (changed > 0).mean() > 0.95  # rotated and shifted, not copies
    # mean brightness kept within a few levels: the digit moved, it was not cut off the image
    assert abs(variant.mean() - base.x_train.mean()) < 0.15 * base.x_train.mean()
    again = wldata.load("digits-aug", size=32)
    assert np.array_equal(again.x_train, aug.x_train)  # the same seed, the same images on every node


def test_metrics_schema_validates_real_records(tmp_path: Path) -> None:
    w = wlmetrics.MetricsWriter(tmp_path, 0, "pytorch")
    w.start(world=2, batch=32, global_batch=64, steps_per_epoch=22, epochs=1, peak_lr=0.01, dataset="digits",
            synthetic=False, start_epoch=0)
    w.write("step", epoch=0, step=1, loss=2.3, lr=0.001, images_per_s=80.0, data_s=0.001, compute_s=0.7)
    w.close()
    recs = [json.loads(line) for line in (tmp_path / "metrics-rank0.jsonl").read_text().splitlines()]
    assert [wlmetrics.validate(r) for r in recs] == [[], []]
    assert wlmetrics.validate({**recs[1], "loss": "2.3"}) == ["step: loss is str"]
    assert "step: missing lr" in wlmetrics.validate({k: v for k, v in recs[1].items() if k != "lr"})


def test_nvidia_smi_sample_parser() -> None:
    text = "0, 97, 3811, 71, 74.52\n1, 0, 0, 35, [N/A]\n"
    assert wlmetrics.parse_nvidia_smi_sample(text) == [
        {"index": 0, "util_percent": 97.0, "mem_used_mib": 3811.0, "temp_c": 71.0, "power_w": 74.52},
        {"index": 1, "util_percent": 0.0, "mem_used_mib": 0.0, "temp_c": 35.0, "power_w": None}]


def test_prefetcher_yields_every_batch_once_in_order() -> None:
    import threading

    seen_threads = set()

    def make(i: int) -> int:
        seen_threads.add(threading.current_thread().name)
        return i * i

    for workers in (0, 1, 3, 10):
        assert list(wldata.Prefetcher(make, 7, workers)) == [i * i for i in range(7)]
    assert any(t.startswith("loader") for t in seen_threads)
    assert list(wldata.Prefetcher(make, 0, 2)) == []


def test_loader_workers_leave_cpu_nodes_cores_to_compute() -> None:
    import wlcommon

    assert wlcommon.loader_workers(-1, accelerator=False, local_processes=1) == 0
    assert 1 <= wlcommon.loader_workers(-1, accelerator=True, local_processes=2) <= 4
    assert wlcommon.loader_workers(3, accelerator=False, local_processes=1) == 3


def test_the_step_loop_times_every_step_and_logs_the_first_every_nth_and_the_last(tmp_path: Path) -> None:
    """wlmetrics.run_steps: the per-step bookkeeping both training programs share."""
    import argparse

    import wlcommon

    a = argparse.Namespace(accumulate=2, max_steps=5, lr=0.01, epochs=2, warmup_epochs=1.0, schedule="cosine",
                           lr_scaling="linear")
    plan = wlcommon.plan_batches(a, 3, [3, 5], train_samples=100)  # 16 samples a step: 6 steps, capped at 5
    assert (plan.global_batch, plan.steps_per_epoch, plan.step_batches) == (16, 5, [6, 10])
    assert plan.peak_lr == wlcommon.peak_lr(0.01, 16) == 0.01 * 16 / 64
    a.lr_scaling = "sqrt"  # a worker's mean micro-batch is 4: 4 x sqrt(16 / 4)
    sqrt = wlcommon.plan_batches(a, 3, [3, 5], train_samples=100)
    assert (sqrt.peak_lr, sqrt.start_fields()["lr_scaling"]) == (pytest.approx(0.01 * 4 / 64 * 2), "sqrt")
    w = wlmetrics.MetricsWriter(tmp_path, 0, "pytorch")
    batches, seen = iter(range(100)), []

    def train(batch: int, lr: float) -> wlmetrics.StepOutcome:
        seen.append((batch, lr))
        return wlmetrics.StepOutcome(loss=float(batch), samples=6, bytes_sent=10 * batch)

    step, tally = wlmetrics.run_steps(w, plan, 2, epoch=1, step=5, fetch=lambda: next(batches), train=train)
    assert step == 10 and [b for b, _ in seen] == [0, 1, 2, 3, 4]
    assert [lr for _, lr in seen] == [plan.lr(s) for s in range(5, 10)]  # the rate of the step about to run
    assert (tally.samples, tally.loss_sum, tally.bytes_sent, tally.mean_bytes_sent(5)) == (30, 60.0, 100, 20)
    assert tally.elapsed_s >= tally.data_s + tally.compute_s > 0 and "cpu_cores_process" in tally.cpu_use
    ds = wldata.synthetic(n=20, size=4)
    w.epoch(1, step, tally, plan, wlmetrics.EpochScores(2.0, 0.5, 2.1, 0.4), tally.mean_bytes_sent(5))
    w.finish(argparse.Namespace(**vars(a), batch=3, grad_compression="none", target_acc=0.0), ds, 2, plan, 1, step,
             wlmetrics.CpuMeter())
    recs = [json.loads(line) for line in w.path.read_text().splitlines()]
    steps = [r for r in recs if r["type"] == "step"]
    assert [r["step"] for r in steps] == [6, 8, 10]  # the first, every 2nd, the last
    assert [r["bytes_sent_ring"] for r in steps] == [0, 20, 40]
    assert [r["type"] for r in recs] == ["step"] * 3 + ["epoch", "end"]
    assert all(wlmetrics.validate(r) == [] for r in recs)
    assert (recs[3]["train_loss"], recs[3]["val_acc"], recs[3]["bytes_sent_per_step_ring"]) == (2.0, 0.4, 20)
    assert (recs[4]["epochs_done"], recs[4]["step"]) == (1, 10)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["final_val_acc"], summary["final_step"], summary["steps_per_epoch"]) == (0.4, 10, 5)
