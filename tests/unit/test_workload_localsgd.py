"""Local SGD in the PyTorch program (grad_compression: localsgd): torch's post_localSGD hook and periodic model
averager, the bytes it records, and a checkpoint that resumes (real gloo processes on loopback, tiny models)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: E402 - installed by scripts/setup.sh; a missing torch must fail, not skip
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from tests import ranks  # noqa: E402

WL = Path(__file__).resolve().parents[2] / "cluster" / "workloads"
sys.path.insert(0, str(WL))
import torchcomm  # noqa: E402
import train_torch  # noqa: E402
import wlcommon  # noqa: E402
import wlmetrics  # noqa: E402


def tiny(classes: int = 10) -> nn.Module:
    """8x8x3 images -> logits; ~18k weights, 4 DDP buckets at a 1 KiB bucket size (test_workload_torch_comm.py)."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 32),
                         nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, classes))


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    import argparse

    return train_torch.make_optimizer(model, argparse.Namespace(lr=0.01, momentum=0.9, weight_decay=5e-4))


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def _momentum(opt: torch.optim.Optimizer) -> torch.Tensor:
    return _flat([opt.state[p]["momentum_buffer"] for g in opt.param_groups for p in g["params"]])


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)  # each rank its own batches: local steps move the ranks apart
    return [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(steps)]


def _steps(ddp: nn.Module, opt: torch.optim.Optimizer, comp: wlcommon.Compression,
           batches: list[tuple[torch.Tensor, torch.Tensor]], rec: dict[str, list] | None = None) -> None:
    """As train_torch.train_epoch steps: the bytes the step will send, the step, LocalSGD's after_step (the
    last of `batches` ends an epoch)."""
    assert isinstance(comp, torchcomm.LocalSGD)
    for i, (x, y) in enumerate(batches):
        sent = comp.bytes_sent_ring()
        train_torch.train_step(ddp, opt, x, y, lr=0.05)
        before = _flat(list(ddp.parameters()))
        sent += comp.after_step(opt, epoch_end=i == len(batches) - 1)
        if rec is not None:
            rec["sent"].append(sent)
            rec["before"].append(before)
            rec["after"].append(_flat(list(ddp.parameters())))


def _local_rank(rank: int, world: int, init: str, tmp: str, steps: int, more: int, period: int, start: int) -> None:
    """`steps` steps (one epoch), its checkpoint (train_torch._save, a file per rank as per node), `more` steps
    (a second epoch); then a fresh model resumed from the checkpoint (train_torch._resume) runs those again."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = tiny()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1 / 1024)  # several buckets
    comp = torchcomm.setup_compression(ddp, "localsgd", world, "gloo", localsgd_period=period, localsgd_start=start)
    opt = _opt(ddp)
    batches = _batches(rank, steps + more)
    rec: dict[str, list] = {"sent": [], "before": [], "after": []}
    _steps(ddp, opt, comp, batches[:steps], rec)
    rec["momentum"] = [_momentum(opt)]
    assert isinstance(comp, torchcomm.LocalSGD)
    rec["hook_iter"], rec["averager_step"], rec["volume"] = comp.hook_state.iter, comp.averager.step, comp.volume
    ckpt = Path(tmp) / f"ckpt{rank}.pt"
    train_torch._save(model, opt, 0, steps, ckpt)
    _steps(ddp, opt, comp, batches[steps:], rec)
    rec["final"] = [_flat(list(model.parameters())), _momentum(opt)]

    torch.manual_seed(1)  # another initialisation: what counts is what the checkpoint brings
    model2 = tiny()
    opt2 = _opt(model2)
    assert train_torch._resume(model2, opt2, ckpt, rank, world)[:2] == (1, steps)
    ddp2 = nn.parallel.DistributedDataParallel(model2, bucket_cap_mb=1 / 1024)
    comp2 = torchcomm.setup_compression(ddp2, "localsgd", world, "gloo", done_steps=steps, localsgd_period=period,
                                        localsgd_start=start)
    resumed: dict[str, list] = {"sent": [], "before": [], "after": []}
    _steps(ddp2, opt2, comp2, batches[steps:], resumed)
    rec["resumed"] = [_flat(list(model2.parameters())), _momentum(opt2)]
    rec["resumed_sent"] = resumed["sent"]
    torch.save(rec, f"{tmp}/local{rank}.pt")
    ranks.leave()


def test_local_sgd_steps_apart_between_averagings_averages_every_period_and_resumes(tmp_path: Path) -> None:
    """Period 4 from step 2: all-reduced gradients for steps 0-1 (equal ranks), then each rank on its own (they
    differ), the parameters averaged after steps 2, 6, 10 (equal again), at the epoch's end (step 11)
    parameters and momentum made equal; a resume from that epoch's checkpoint continues as the run did."""
    steps, more, period, start = 12, 6, 4, 2
    mp.spawn(_local_rank, args=(2, f"file://{tmp_path / 'rdzv'}", str(tmp_path), steps, more, period, start),
             nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"local{r}.pt", weights_only=False) for r in range(2))
    averaging = {2, 6, 10, 14}
    for i in range(steps + more):
        if i < start:  # DDP's all-reduce through the post_localSGD hook: the same step on both ranks
            assert torch.allclose(a["after"][i], b["after"][i], atol=1e-6), i
        elif i in averaging or i in (steps - 1, steps + more - 1):  # averaged, or an epoch's end
            assert not torch.allclose(a["before"][i], b["before"][i], atol=1e-4), i  # a local step before it
            assert torch.allclose(a["after"][i], b["after"][i], atol=1e-6), i
            mean = (a["before"][i] + b["before"][i]) / 2  # torch's averager: the plain mean of the ranks
            assert torch.allclose(a["after"][i], mean, atol=1e-6), i
        else:  # local: nothing was all-reduced, the ranks differ
            assert torch.equal(a["after"][i], a["before"][i]), i
            assert not torch.allclose(a["after"][i], b["after"][i], atol=1e-4), i
    assert torch.allclose(a["momentum"][0], b["momentum"][0], atol=1e-6)  # the epoch-end sync averaged them too
    assert a["hook_iter"] == start and a["averager_step"] == steps
    n = a["after"][0].numel()
    p = n * 4  # float32 parameters (= gradients) on two ranks: the ring sends 2 (n - 1) / n = 1 times them
    # the gradients before the start; the parameters on averaging steps; at an epoch's end (not an averaging
    # step) parameters and momentum in one all-reduce
    want = [p, p, p, 0, 0, 0, p, 0, 0, 0, p, 2 * p] + [0, 0, p, 0, 0, 2 * p]
    assert a["sent"] == b["sent"] == want
    assert a["volume"]["bytes_sent_per_step_ring"] == round(p / period)  # per step on average once it runs
    assert a["volume"]["bytes_sent_per_step_ring_uncompressed"] == p
    for r in (a, b):  # the resumed run is the run: same schedule, same parameters and momentum
        assert r["resumed_sent"] == want[steps:]
        for got, ref in zip(r["resumed"], r["final"]):
            assert torch.allclose(got, ref, rtol=0, atol=1e-6)


def test_localsgd_start_defaults_to_the_warm_up_and_the_programs_refuse_what_they_lack() -> None:
    assert wlcommon.localsgd_start(0, 22, 1.0) == 22 and wlcommon.localsgd_start(0, 22, 0.0) == 1
    assert wlcommon.localsgd_start(5, 22, 1.0) == 5
    with pytest.raises(SystemExit) as e:  # train_tf.py's parse (no local SGD there)
        wlcommon.parse_args("x", ["--grad-compression", "localsgd"], lambda a: None)
    assert e.value.code == 2
    assert wlcommon.parse_args("x", ["--grad-compression", "localsgd"], lambda a: None, local_sgd=True).localsgd_period == 8
    with pytest.raises(SystemExit):
        wlcommon.parse_args("x", ["--localsgd-period", "1"], train_torch.refused, local_sgd=True)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


def _run(outs: list[Path], epochs: int) -> None:
    """train_torch.py on two 'nodes' (a folder each), local SGD period 4 from step 2, 7 steps per epoch."""
    port, procs = _free_port(), []
    for rank, out in enumerate(outs):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": ""}
        cmd = [sys.executable, str(WL / "train_torch.py"), "--dataset", "digits", "--model", "shufflenet_v2_x0_5",
               "--size", "8", "--batch", "8", "--epochs", str(epochs), "--max-steps", "7", "--log-every", "1",
               "--threads", "1", "--schedule", "constant", "--warmup-epochs", "0", "--collective-timeout-s", "60",
               "--grad-compression", "localsgd", "--localsgd-period", "4", "--localsgd-start-step", "2",
               "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errs = []
    try:
        for pr in procs:
            errs.append(pr.communicate(timeout=300)[1])
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait(timeout=30)
    assert all(pr.returncode == 0 for pr in procs), "\n---\n".join(e[-2500:] for e in errs)


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics-rank0.jsonl").read_text().splitlines() if x.strip()]


def _ckpt(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=False)


def _same_state(a: dict, b: dict, atol: float = 0.0) -> None:
    for k in a["model"]:
        if a["model"][k].is_floating_point():
            assert torch.allclose(a["model"][k], b["model"][k], rtol=0, atol=atol), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        assert torch.allclose(sa[k]["momentum_buffer"], sb[k]["momentum_buffer"], rtol=0, atol=atol), k


def test_program_records_local_sgd_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Two train_torch.py processes, one epoch of 7 steps, then a resume for a second."""
    outs = [tmp_path / f"node{r}" for r in range(2)]
    _run(outs, 1)
    recs = _records(outs[0])
    assert all(wlmetrics.validate(r) == [] for r in recs)
    start = next(r for r in recs if r["type"] == "start")
    assert (start["grad_compression"], start["localsgd_period"], start["localsgd_start_step"]) == ("localsgd", 4, 2)
    assert start["powersgd_rank"] is None
    p = start["grad_bytes"]  # the parameters in float32; two ranks: the ring sends 1x the payload
    assert start["bytes_sent_per_step_ring"] == round(p / 4) and start["allreduce_payload_bytes"] == round(p / 4)
    # steps 0-1 gradients; the parameters averaged after steps 2 and 6; step 6 ends the epoch: the momentum too
    sent = [p, p, p, 0, 0, 0, 2 * p]
    assert [r["bytes_sent_ring"] for r in recs if r["type"] == "step"] == sent
    assert [r["bytes_sent_per_step_ring"] for r in recs if r["type"] == "epoch"] == [round(sum(sent) / 7)]
    a, b = _ckpt(outs[0]), _ckpt(outs[1])
    assert (a["epoch"], a["step"]) == (0, 7)
    _same_state(a, b)  # every node holds the same checkpoint: equal parameters and momentum

    _run(outs, 2)
    recs = _records(outs[0])
    last = [r for r in recs if r["type"] == "start"][-1]
    assert (last["start_epoch"], last["start_step"]) == (1, 7)
    # the averager's count continued: step 10 averages; step 13 ends the epoch (parameters and momentum)
    assert [r["bytes_sent_ring"] for r in recs[recs.index(last):] if r["type"] == "step"] == [0, 0, 0, p, 0, 0, 2 * p]
    c = _ckpt(outs[0])
    assert (c["epoch"], c["step"]) == (1, 14)
    _same_state(c, _ckpt(outs[1]))
    assert any(not torch.equal(c["model"][k], a["model"][k]) for k in a["model"])  # it trained on
