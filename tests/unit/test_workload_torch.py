"""The PyTorch training program: DDP arithmetic, resume, metrics (real torch, gloo on loopback)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


import pytest
import torch  # noqa: E402 - installed by scripts/setup.sh; a missing torch must fail, not skip
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tests import ranks  # noqa: E402

WL = Path(__file__).resolve().parents[2] / "cluster" / "programs"
sys.path.insert(0, str(WL))
import train_torch  # noqa: E402
import wlcommon  # noqa: E402

pytestmark = pytest.mark.slow  # runs the PyTorch program and its ranks: left out of the quick tier


def _frozen_bn(model: torch.nn.Module) -> torch.nn.Module:
    # Batch statistics are per rank in DDP (no SyncBatchNorm on CPU), so the comparison holds BN in
    # eval mode: what is compared is the gradient averaging, loss scaling and optimizer step.
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()
    return model


def _args():
    import argparse

    return argparse.Namespace(lr=0.01, momentum=0.9, weight_decay=5e-4)


def _rank(rank: int, world: int, init: str, state: str, x: str, out: str, split: tuple[int, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = _frozen_bn(train_torch.build_model(10)).double()
    model.load_state_dict(torch.load(state))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = train_torch.make_optimizer(ddp, _args())
    data = torch.load(x)
    part = wlcommon.batch_slice(0, list(split), rank)  # this rank's share of the 8 samples
    for _ in range(2):  # two steps: momentum buffers are exercised too
        train_torch.train_step(ddp, opt, data["x"][part], data["y"][part], lr=0.01,
                               weight=wlcommon.loss_weight(list(split), rank))
    if rank == 0:
        torch.save(model.state_dict(), out)
    ranks.leave()


@pytest.mark.parametrize("split", [(4, 4), (3, 5)], ids=["even", "uneven"])
def test_ddp_step_on_two_ranks_equals_one_step_on_the_concatenated_batch(tmp_path: Path, split) -> None:
    # float64 so that the comparison sees the arithmetic, not float32 rounding through 50 layers
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = _frozen_bn(train_torch.build_model(10)).double()
    torch.save(model.state_dict(), tmp_path / "init.pt")
    x, y = torch.randn(8, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (8,))
    torch.save({"x": x, "y": y}, tmp_path / "data.pt")
    opt = train_torch.make_optimizer(model, _args())
    for _ in range(2):
        train_torch.train_step(model, opt, x, y, lr=0.01)
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rdzv'}", str(tmp_path / "init.pt"), str(tmp_path / "data.pt"),
                          str(tmp_path / "ddp.pt"), split), nprocs=2, join=True)
    ddp = torch.load(tmp_path / "ddp.pt")
    init = torch.load(tmp_path / "init.pt")
    moved = 0
    for k, v in model.state_dict().items():
        if not v.is_floating_point():
            continue
        d_single, d_ddp = v - init[k], ddp[k] - init[k]  # what the two steps changed
        scale = d_single.abs().max().item()
        assert (d_ddp - d_single).abs().max().item() <= 1e-9 * scale + 1e-12, k
        moved += int(scale > 0)
    assert moved > 100  # the steps really changed the weights


def run_program(out: Path, *extra: str, wait: bool = True,
                env: dict[str, str] | None = None) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, str(WL / "train_torch.py"), "--dataset", "digits", "--epochs", "2", "--batch", "32",
           "--max-steps", "4", "--log-every", "2", "--threads", "1", "--out", str(out), *extra]
    full_env = {**os.environ, **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=full_env)


def test_ddp_alone_runs_the_powersgd_hook_on_one_process(tmp_path: Path) -> None:
    """What bench uses to price PowerSGD's compute: CLUSTER_DDP_ALONE=1 wraps the lone process in DDP over a
    one-rank gloo group and registers the hook; nothing crosses a network. Without it, alone means no DDP."""
    psgd = ["--grad-compression", "powersgd", "--powersgd-start-step", "2", "--epochs", "1"]
    r = run_program(tmp_path / "alone", *psgd, "--powersgd-wire", "bfloat16", env={"CLUSTER_DDP_ALONE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "alone" / "metrics-rank0.jsonl").read_text().splitlines()]
    start = next(x for x in recs if x["type"] == "start")
    assert (start["world"], start["backend"], start["grad_compression"], start["powersgd_rank"],
            start["powersgd_wire"]) == (1, "gloo", "powersgd", 2, "bfloat16")
    assert len([x for x in recs if x["type"] == "step"]) >= 2  # it trained
    plain = run_program(tmp_path / "plain", *psgd)
    assert plain.returncode == 0, plain.stderr[-2000:]
    start = next(json.loads(x) for x in (tmp_path / "plain" / "metrics-rank0.jsonl").read_text().splitlines()
                 if '"start"' in x)
    assert (start["backend"], start["grad_compression"]) == ("none", "none")


def test_resume_after_a_stop_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    whole = run_program(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    p = run_program(tmp_path / "stopped", wait=False)
    ckpt = tmp_path / "stopped" / "checkpoint.pt"
    deadline = time.monotonic() + 300
    while not ckpt.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)  # stopped hard during epoch 1
    p.wait()
    assert torch.load(ckpt, weights_only=False)["epoch"] == 0
    again = run_program(tmp_path / "stopped")
    assert again.returncode == 0, again.stderr[-2000:]
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)
    b = torch.load(ckpt, weights_only=False)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (1, 8)
    for k in a["model"]:
        assert torch.allclose(a["model"][k].float(), b["model"][k].float(), atol=1e-5), k
    recs = [json.loads(line) for line in (tmp_path / "stopped" / "metrics-rank0.jsonl").read_text().splitlines()]
    import wlmetrics

    assert all(wlmetrics.validate(r) == [] for r in recs)  # docs/metrics.md's schema
    starts = [r for r in recs if r["type"] == "start"]
    assert [s["start_epoch"] for s in starts] == [0, 1]  # what the stopped run wrote is kept, then continued
    lrs_whole = [r["lr"] for r in map(json.loads, (tmp_path / "whole" / "metrics-rank0.jsonl").read_text().splitlines())
                 if r["type"] == "step" and r["epoch"] == 1]
    resumed = recs[max(i for i, r in enumerate(recs) if r["type"] == "start"):]  # the killed run may have
    assert lrs_whole == [r["lr"] for r in resumed if r["type"] == "step" and r["epoch"] == 1]  # logged epoch 1 too


def test_loader_threads_feed_the_same_batches_as_direct_indexing(tmp_path: Path) -> None:
    """--loader-workers 2 prepares batches ahead in threads; the run must be the same run."""
    runs = {w: run_program(tmp_path / f"w{w}", "--loader-workers", str(w), "--epochs", "1") for w in (0, 2)}
    losses = {}
    for w, r in runs.items():
        assert r.returncode == 0, r.stderr[-2000:]
        recs = [json.loads(x) for x in (tmp_path / f"w{w}" / "metrics-rank0.jsonl").read_text().splitlines()]
        assert next(x for x in recs if x["type"] == "start")["loader_workers"] == w
        losses[w] = [x["loss"] for x in recs if x["type"] == "step"]
    assert losses[0] == losses[2] and len(losses[0]) >= 2


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3)).double()


def _batch_stats(model: torch.nn.Module, x: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """By hand: the mean over the batches of each batch's channel mean and unbiased variance at the BN input."""
    with torch.no_grad():
        feats = [model[0](x[i:i + batch]) for i in range(0, len(x), batch)]
    means = torch.stack([f.mean(dim=(0, 2, 3)) for f in feats])
    var = torch.stack([f.var(dim=(0, 2, 3), unbiased=True) for f in feats])
    return means.mean(0), var.mean(0)


def test_recompute_bn_replaces_the_running_averages_with_the_batches_plain_average() -> None:
    """Precise BN on one rank: after training steps left running averages behind, the statistics are the
    plain mean of the given batches' (the momentum is restored, nothing else of the model moves); a trailing
    single sample is not fed (training-mode BatchNorm needs two)."""
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(8, 3, 8, 8, dtype=torch.float64) * 3 + 1),
                                          torch.randint(0, 3, (8,))).backward()
        opt.step()
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    x = torch.randn(33, 3, 8, 8, dtype=torch.float64)
    mean, var = _batch_stats(model, x[:32], 8)
    bn = model[1]
    assert not torch.allclose(bn.running_mean, mean)  # the averages training left differ
    model.eval()
    train_torch.recompute_bn(model, x, 8, world=1)
    assert torch.allclose(bn.running_mean, mean, atol=1e-12) and torch.allclose(bn.running_var, var, atol=1e-12)
    assert bn.momentum == 0.1 and not model.training  # restored
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def _bn_rank(rank: int, world: int, init: str, x: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = _bn_model()
    data = torch.load(x)
    train_torch.recompute_bn(model, data[rank * 16:(rank + 1) * 16], 8, world)
    torch.save({"mean": model[1].running_mean, "var": model[1].running_var}, f"{out}.{rank}")
    ranks.leave()


def test_recompute_bn_averages_the_ranks_statistics(tmp_path: Path) -> None:
    """Two gloo ranks, each on its own 16 samples: both end with the mean of their statistics, which is the
    plain average over all four batches of 8."""
    x = torch.randn(32, 3, 8, 8, dtype=torch.float64)
    torch.save(x, tmp_path / "x.pt")
    mp.spawn(_bn_rank, args=(2, f"file://{tmp_path / 'rdzv'}", str(tmp_path / "x.pt"), str(tmp_path / "bn")),
             nprocs=2, join=True)
    mean, var = _batch_stats(_bn_model(), x, 8)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"bn.{rank}")
        assert torch.allclose(got["mean"], mean, atol=1e-12) and torch.allclose(got["var"], var, atol=1e-12)


def test_the_program_recomputes_batchnorm_before_each_evaluation(tmp_path: Path) -> None:
    r = run_program(tmp_path / "bn", "--model", "resnet18", "--bn-recompute", "64", "--epochs", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "bn" / "metrics-rank0.jsonl").read_text().splitlines()]
    assert recs[0]["bn_recompute"] == 64 and any(x["type"] == "epoch" for x in recs)
    bad = run_program(tmp_path / "neg", "--bn-recompute", "-1")
    assert bad.returncode != 0 and "--bn-recompute must be >= 0" in bad.stderr


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics-rank0.jsonl").read_text().splitlines()]


def test_a_run_trains_on_to_its_target_with_a_continued_runs_schedule_and_ends_there(tmp_path: Path) -> None:
    """--target-acc with --max-epochs: short of the target after --epochs it trains on, each epoch with the
    schedule of a run that long (the rates of a 2-epoch run's second epoch), then ends; restarted in its
    folder it trains nothing more. A reachable target ends the run at the first epoch that reaches it, and a
    restart knows from the checkpoint that it did."""
    r18 = ("--model", "resnet18")
    whole = run_program(tmp_path / "whole", *r18)  # 2 epochs
    assert whole.returncode == 0, whole.stderr[-2000:]
    on = run_program(tmp_path / "on", *r18, "--epochs", "1", "--target-acc", "1.0", "--max-epochs", "2")
    assert on.returncode == 0, on.stderr[-2000:]
    recs = _records(tmp_path / "on")
    import wlmetrics

    assert all(wlmetrics.validate(x) == [] for x in recs)
    assert (recs[0]["epochs"], recs[0]["target_acc"], recs[0]["max_epochs"]) == (1, 1.0, 2)
    assert [x["epoch"] for x in recs if x["type"] == "epoch"] == [0, 1]
    assert [x["lr"] for x in recs if x["type"] == "step" and x["epoch"] == 1] == \
           [x["lr"] for x in _records(tmp_path / "whole") if x["type"] == "step" and x["epoch"] == 1]
    end = recs[-1]
    assert (end["type"], end["epochs_done"], end["target_reached"]) == ("end", 2, False)
    again = run_program(tmp_path / "on", *r18, "--epochs", "1", "--target-acc", "1.0", "--max-epochs", "2")
    assert again.returncode == 0, again.stderr[-2000:]
    assert (_records(tmp_path / "on")[-1]["epochs_done"], len([x for x in _records(tmp_path / "on")
                                                                if x["type"] == "epoch"])) == (0, 2)

    early = ("--epochs", "3", "--target-acc", "0.01", "--accumulate", "2", "--lr-scaling", "sqrt")
    hit = run_program(tmp_path / "hit", *r18, *early)
    assert hit.returncode == 0, hit.stderr[-2000:]
    recs = _records(tmp_path / "hit")
    assert [x["epoch"] for x in recs if x["type"] == "epoch"] == [0]
    start = recs[0]  # sqrt: the rate of one micro-batch x sqrt(2), not of both; the steps follow it
    assert (start["lr_scaling"], start["peak_lr"]) == ("sqrt", pytest.approx(0.01 * 32 / 64 * 2 ** 0.5, rel=1e-12))
    first = next(x for x in recs if x["type"] == "step")
    assert first["lr"] == pytest.approx(start["peak_lr"] / 10, rel=1e-12)  # the warm-up's first step
    assert (recs[-1]["epochs_done"], recs[-1]["target_reached"]) == (1, True)
    assert torch.load(tmp_path / "hit" / "checkpoint.pt", weights_only=False)["val_acc"] >= 0.01
    again = run_program(tmp_path / "hit", *r18, *early)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (_records(tmp_path / "hit")[-1]["epochs_done"], _records(tmp_path / "hit")[-1]["target_reached"]) == \
           (0, True)
    bad = run_program(tmp_path / "bad", "--target-acc", "1.5")
    assert bad.returncode == 2 and "--target-acc must be within 0-1" in bad.stderr
