"""Datasets for the ResNet50 study, the same arrays for PyTorch and TensorFlow, and their batches fed by threads.

Runs on the nodes (numpy, scikit-learn, Pillow; no clusterctl imports). Every
loader returns uint8 NHWC images at `size`x`size`x3 and int64 labels, split
into train/validation with a fixed seed, so both frameworks see identical data.

    digits       scikit-learn's 1797 real 8x8 digits (ships in the package: no download)
    digits-aug   the same digits, each training image in 8 variants (digits_augmented): 11,496 images an
                 epoch, validation the same 360 real digits, for runs with an epoch of CIFAR-10's order of steps
    cifar10      the CIFAR-10 python archive (cifar-10-python.tar.gz) or its extracted folder
    imagefolder  ROOT/<class>/<image>: one subfolder per class
    synthetic    random images, for throughput only (accuracy is meaningless and labelled so)
"""
from __future__ import annotations

import io
import pickle
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")
NAMES = ("digits", "digits-aug", "cifar10", "imagefolder", "synthetic")
AUG_VARIANTS = 8  # digits-aug: variants of each training digit (the original among them)
AUG_MAX_DEGREES, AUG_MAX_SHIFT = 12.0, 0.1  # rotation, translation as a fraction of the side
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray  # uint8, N x H x W x 3
    y_train: np.ndarray  # int64
    x_val: np.ndarray
    y_val: np.ndarray
    classes: int
    synthetic: bool = False

    def normalization(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and std of the training images, in [0, 1] units."""
        x = self.x_train.astype(np.float32) / 255.0
        return x.mean(axis=(0, 1, 2)), x.std(axis=(0, 1, 2)) + 1e-6


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 N x h x w x 3 -> N x size x size x 3 (bilinear, Pillow)."""
    from PIL import Image

    if images.shape[1:3] == (size, size):
        return images
    return np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.Resampling.BILINEAR)) for im in images])


Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # x_train, y_train, x_val, y_val


def _split(x: np.ndarray, y: np.ndarray, val_fraction: float, seed: int) -> Split:
    order = np.random.default_rng(seed).permutation(len(x))
    n_val = int(round(len(x) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return x[train], y[train], x[val], y[val]


def digits(size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    gray = (d.images / 16.0 * 255.0).round().astype(np.uint8)  # 0..16 -> 0..255
    x = _resize(np.repeat(gray[..., None], 3, axis=3), size)
    return Dataset("digits", *_split(x, d.target.astype(np.int64), val_fraction, seed), classes=10)


def digits_augmented(size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """digits with every training image in AUG_VARIANTS variants: itself and 7 copies each rotated by up to
    +-12 degrees and shifted by up to +-10% of the side (uniform, whole pixels, bilinear, drawn from `seed`), so an epoch
    has 8 x 1437 = 11,496 images. The split is digits' own (same seed): no variant of a validation digit is
    trained on, and validation is the 360 real digits unchanged."""
    from PIL import Image

    base = digits(size, val_fraction, seed)
    rng = np.random.default_rng([seed, 8])
    out = [base.x_train]
    for _ in range(AUG_VARIANTS - 1):
        angles = rng.uniform(-AUG_MAX_DEGREES, AUG_MAX_DEGREES, len(base.x_train))
        shifts = rng.uniform(-AUG_MAX_SHIFT, AUG_MAX_SHIFT, (len(base.x_train), 2)) * size
        out.append(np.stack([np.asarray(Image.fromarray(im).rotate(a, Image.Resampling.BILINEAR,
                                                                    translate=(int(round(dx)), int(round(dy)))))
                             for im, a, (dx, dy) in zip(base.x_train, angles, shifts)]))
    x = np.concatenate(out)
    y = np.tile(base.y_train, AUG_VARIANTS)
    return Dataset("digits-aug", x, y, base.x_val, base.y_val, classes=10)


def _cifar_batches(path: Path) -> dict[str, dict[bytes, Any]]:
    """name -> unpickled batch, from the .tar.gz archive or the extracted folder."""
    wanted = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    out: dict[str, dict[bytes, Any]] = {}
    if path.is_file():
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if name in wanted and member.isfile():
                    f = tar.extractfile(member)
                    assert f is not None
                    out[name] = pickle.load(io.BytesIO(f.read()), encoding="bytes")
    else:
        folder = path / "cifar-10-batches-py" if (path / "cifar-10-batches-py").is_dir() else path
        for name in wanted:
            if (folder / name).exists():
                with open(folder / name, "rb") as f:
                    out[name] = pickle.load(f, encoding="bytes")
    missing = [w for w in wanted if w not in out]
    if missing:
        raise FileNotFoundError(f"{path}: not a CIFAR-10 python archive or folder (missing {', '.join(missing)})")
    return out


def cifar10(path: str | Path, size: int = 32) -> Dataset:
    """The official split: data_batch_1..5 train, test_batch validates."""
    b = _cifar_batches(Path(path))

    def arrays(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        x = np.concatenate([b[n][b"data"] for n in names]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        y = np.concatenate([np.asarray(b[n][b"labels"]) for n in names]).astype(np.int64)
        return _resize(x.astype(np.uint8), size), y

    xt, yt = arrays([f"data_batch_{i}" for i in range(1, 6)])
    xv, yv = arrays(["test_batch"])
    return Dataset("cifar10", xt, yt, xv, yv, classes=10)


def imagefolder(path: str | Path, size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    from PIL import Image

    root = Path(path)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if len(classes) < 2:
        raise FileNotFoundError(f"{root}: expected one subfolder per class (at least two)")
    xs, ys = [], []
    for label, cls in enumerate(classes):
        for f in sorted((root / cls).iterdir()):
            if f.suffix.lower() in IMAGE_SUFFIXES:
                with Image.open(f) as im:
                    xs.append(np.asarray(im.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)))
                ys.append(label)
    x, y = np.stack(xs).astype(np.uint8), np.asarray(ys, dtype=np.int64)
    return Dataset("imagefolder", *_split(x, y, val_fraction, seed), classes=len(classes))


def synthetic(n: int = 2048, size: int = 32, classes: int = 10, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
    y = rng.integers(0, classes, size=n).astype(np.int64)
    return Dataset("synthetic", *_split(x, y, 0.2, seed), classes=classes, synthetic=True)


def load(name: str, path: str | None = None, size: int = 32, seed: int = 0) -> Dataset:
    if name == "digits":
        return digits(size, seed=seed)
    if name == "digits-aug":
        return digits_augmented(size, seed=seed)
    if name == "cifar10":
        if not path:
            raise ValueError("cifar10 needs the path of cifar-10-python.tar.gz or its extracted folder")
        return cifar10(path, size)
    if name == "imagefolder":
        if not path:
            raise ValueError("imagefolder needs the path of a folder with one subfolder per class")
        return imagefolder(path, size, seed=seed)
    if name == "synthetic":
        return synthetic(size=size, seed=seed)
    raise ValueError(f"unknown dataset {name!r}: one of {', '.join(NAMES)}")


def save(ds: Dataset, path: str | Path) -> None:
    """The prepared arrays, staged to nodes as one file."""
    np.savez(path, x_train=ds.x_train, y_train=ds.y_train, x_val=ds.x_val, y_val=ds.y_val,
             meta=np.asarray([ds.name, str(ds.classes), str(int(ds.synthetic))]))


def open_prepared(path: str | Path) -> Dataset:
    with np.load(path) as z:
        name, classes, synth = (str(v) for v in z["meta"])
        return Dataset(name, z["x_train"], z["y_train"], z["x_val"], z["y_val"], int(classes), synth == "1")


def shard(n: int, rank: int, world: int) -> np.ndarray:
    """Indices of this rank's share: equal sizes on every rank (the remainder is dropped), so all
    ranks take the same number of steps."""
    usable = n - n % world
    return np.arange(rank, usable, world)


class Prefetcher(Generic[T]):
    """Yields make_batch(0..n-1) in order, with up to `workers` of the next batches prepared in
    threads while the caller computes (the arrays are in memory: threads, no worker processes and
    no copies between them; numpy and torch release the GIL while gathering)."""

    def __init__(self, make_batch: Callable[[int], T], n: int, workers: int) -> None:
        self.make_batch, self.n, self.workers = make_batch, n, workers

    def __iter__(self) -> Iterator[T]:
        if self.workers <= 0:
            for i in range(self.n):
                yield self.make_batch(i)
            return
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.workers, thread_name_prefix="loader") as pool:
            pending = deque(pool.submit(self.make_batch, i) for i in range(min(self.n, self.workers)))
            nxt = len(pending)
            while pending:
                batch = pending.popleft().result()
                if nxt < self.n:
                    pending.append(pool.submit(self.make_batch, nxt))
                    nxt += 1
                yield batch
