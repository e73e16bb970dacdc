"""The gradient noise probe (`--noise-probe`, what bench measures for `plan --target-acc`): the estimator on
gradients of a known noise scale, and the PyTorch program's records (a real ResNet18 on digits)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

WL = Path(__file__).resolve().parents[2] / "cluster" / "workloads"
sys.path.insert(0, str(WL))
import wlcommon  # noqa: E402
import wlmetrics  # noqa: E402


def _records(g: np.ndarray, sigma: float, b: int, k: int, steps: int, seed: int) -> list[dict[str, float]]:
    """What the probe records when every sample's gradient is G plus Gaussian noise of `sigma` per
    coordinate: tr(Sigma) = dims x sigma^2, so B_simple = dims sigma^2 / |G|^2."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        micro = g + rng.normal(0.0, sigma, (k, b, g.size)).mean(axis=1)  # k gradients of b samples
        out.append({"step": s, "b_small": b, "b_big": k * b, "g2_small": float((micro ** 2).sum(axis=1).mean()),
                    "g2_big": float((micro.mean(axis=0) ** 2).sum())})
    return out


def test_the_estimator_finds_a_known_noise_scale_within_a_few_percent() -> None:
    g = np.full(1000, 0.1)  # |G|^2 = 10
    for sigma, want in ((1.0, 100.0), (3.0, 900.0)):  # tr(Sigma) = 1000 sigma^2
        got = wlcommon.noise_scale(_records(g, sigma, 32, 4, 40, seed=int(sigma)))
        assert got is not None and abs(got - want) / want < 0.1, (sigma, got)
    assert wlcommon.noise_scale([]) is None
    # no signal above the noise: no scale rather than a wild one
    flat = [{"step": 0, "b_small": 8, "b_big": 32, "g2_small": 1.0, "g2_big": 0.25}]  # |G|^2 = 0 exactly
    assert wlcommon.noise_scale(flat) is None


def test_the_program_records_each_probe_step_at_the_same_weights(tmp_path: Path) -> None:
    out = tmp_path / "probe"
    r = subprocess.run([sys.executable, str(WL / "train_torch.py"), "--dataset", "digits", "--model", "resnet18",
                        "--size", "16", "--batch", "8", "--noise-probe", "4", "--max-steps", "3", "--threads", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (out / "metrics-rank0.jsonl").read_text().splitlines()]
    assert all(wlmetrics.validate(x) == [] for x in recs)
    noise = [x for x in recs if x["type"] == "noise"]
    assert [x["step"] for x in noise] == [0, 1, 2] and not [x for x in recs if x["type"] in ("step", "epoch")]
    for x in noise:  # the mean of 4 gradients is never longer than their mean length (convexity)
        assert (x["b_small"], x["b_big"]) == (8, 32) and 0 < x["g2_big"] <= x["g2_small"]
    refused = subprocess.run([sys.executable, str(WL / "train_torch.py"), "--noise-probe", "1"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "--noise-probe needs K >= 2" in refused.stderr
