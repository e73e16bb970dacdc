"""Resuming after a node died: every node holds every checkpoint, and a restart with new ranks (or fewer
workers) continues from the newest checkpoint any worker holds.

Real processes on loopback, one --out folder per process as if each were a node with its own disk (the head
restarts the survivors with the same folders but new ranks, and CLUSTER_PERIOD counting the restarts).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: E402 - installed by scripts/setup.sh; a missing torch must fail, not skip
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from tests import ranks  # noqa: E402
from tests.unit.test_workload_tf import _free_ports  # noqa: E402 - its TF workers' ports, as test_workload_tf_comm

WL = Path(__file__).resolve().parents[2] / "cluster" / "programs"
sys.path.insert(0, str(WL))
import train_torch  # noqa: E402
import wlmetrics  # noqa: E402

pytestmark = pytest.mark.slow  # runs the training programs: left out of the quick tier


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _last_start(path: Path) -> dict:
    return [r for r in _records(path) if r["type"] == "start"][-1]


def _wait_all(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    """Each process's stderr, once all of them ended with exit code 0."""
    errs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            errs.append(err)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(e[-2500:] for e in errs)
    return errs


# ---------------------------------------------------------------- PyTorch


def _torch_procs(outs: list[Path], epochs: int, period: int = 1, seeds: list[int] | None = None) -> list[subprocess.Popen]:
    """One train_torch.py per folder, rank = its position in `outs`, each alone on its 'node' (`seeds`: each
    rank's --seed, default 0)."""
    port = _free_ports(1)[0]
    procs = []
    for rank, out in enumerate(outs):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(outs)), "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "CUDA_VISIBLE_DEVICES": "", "CLUSTER_PERIOD": str(period)}
        cmd = [sys.executable, str(WL / "train_torch.py"), "--dataset", "digits", "--model", "mobilenet_v3_small",
               "--size", "8", "--batch", "8", "--epochs", str(epochs), "--max-steps", "2", "--log-every", "1",
               "--threads", "1", "--collective-timeout-s", "60", "--out", str(out),
               "--seed", str(seeds[rank] if seeds else 0)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _ckpt(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=False)


def _same_state(a: dict, b: dict) -> None:
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for i in sa:
        assert torch.equal(sa[i]["momentum_buffer"], sb[i]["momentum_buffer"]), i


@pytest.fixture(scope="module")
def torch_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two 'nodes' (n0 rank 0, n1 rank 1) after a 2-epoch run: both hold the same checkpoint."""
    root = tmp_path_factory.mktemp("torch-nodes")
    _wait_all(_torch_procs([root / "n0", root / "n1"], epochs=2))
    return root


def _copy_nodes(src: Path, dst: Path) -> tuple[Path, Path]:
    shutil.copytree(src, dst)
    return dst / "n0", dst / "n1"


def test_every_node_saves_the_checkpoint_and_the_survivors_resume_with_swapped_ranks(
        torch_nodes: Path, tmp_path: Path) -> None:
    n0, n1 = _copy_nodes(torch_nodes, tmp_path / "run")
    _same_state(_ckpt(n0), _ckpt(n1))  # LOCAL_RANK 0 of each node wrote the whole state
    assert (_ckpt(n1)["epoch"], _ckpt(n1)["step"]) == (1, 4)
    (n0 / "checkpoint.pt").unlink()  # the disk that was rank 0's lost it
    _wait_all(_torch_procs([n1, n0], epochs=3, period=2))  # restarted: n1 is rank 0 now, n0 rank 1
    for out, rank in ((n1, 0), (n0, 1)):
        start = _last_start(out / f"metrics-rank{rank}.jsonl")
        assert wlmetrics.validate(start) == []
        assert (start["world"], start["start_epoch"], start["start_step"], start["period"]) == (2, 2, 4, 2)
        assert (start["resumed_from"], start["weights_sent"]) == ("rank 0", False)  # n1's file, then the same
        epochs = [r for r in _records(out / f"metrics-rank{rank}.jsonl") if r["type"] == "epoch"]
        assert [(r["epoch"], r["step"]) for r in epochs] == [(2, 6)]  # only the epoch that was left
    _same_state(_ckpt(n0), _ckpt(n1))  # n0 took n1's model and optimizer state, and saved again
    assert (_ckpt(n0)["epoch"], _ckpt(n0)["step"]) == (2, 6)
    first = _last_start(torch_nodes / "n0" / "metrics-rank0.jsonl")
    assert (first["start_epoch"], first["start_step"], first["period"]) == (0, 0, 1)  # a fresh first start
    assert (first["resumed_from"], first["weights_sent"]) == ("none", False)  # the same seed: the same weights


def test_a_restart_where_every_node_holds_the_checkpoint_sends_nothing(torch_nodes: Path, tmp_path: Path) -> None:
    """The same nodes again (an elastic restart, a `launch --continue`): each reads its own checkpoint and DDP
    broadcasts no weights; they go on from the same state."""
    n0, n1 = _copy_nodes(torch_nodes, tmp_path / "run")
    _wait_all(_torch_procs([n0, n1], epochs=3, period=2))
    for out, rank in ((n0, 0), (n1, 1)):
        start = _last_start(out / f"metrics-rank{rank}.jsonl")
        assert (start["start_epoch"], start["resumed_from"], start["weights_sent"]) == (2, "each", False)
    _same_state(_ckpt(n0), _ckpt(n1))
    assert (_ckpt(n0)["epoch"], _ckpt(n0)["step"]) == (2, 6)


def test_ranks_that_built_different_weights_get_rank_0s(tmp_path: Path) -> None:
    """A digest that differs (here: each rank its own seed) leaves the sync to DDP: rank 0's weights, sent."""
    n0, n1 = tmp_path / "n0", tmp_path / "n1"
    _wait_all(_torch_procs([n0, n1], epochs=1, seeds=[0, 1]))
    for out, rank in ((n0, 0), (n1, 1)):
        assert _last_start(out / f"metrics-rank{rank}.jsonl")["weights_sent"] is True
    _same_state(_ckpt(n0), _ckpt(n1))  # one model after the broadcast, whatever each rank built


def test_a_lone_survivor_resumes_in_a_smaller_world(torch_nodes: Path, tmp_path: Path) -> None:
    _, n1 = _copy_nodes(torch_nodes, tmp_path / "run")
    _wait_all(_torch_procs([n1], epochs=3, period=3))  # 2 -> 1 process, the folder that was rank 1
    start = _last_start(n1 / "metrics-rank0.jsonl")
    assert wlmetrics.validate(start) == []
    assert (start["world"], start["start_epoch"], start["start_step"], start["period"]) == (1, 2, 4, 3)
    assert start["backend"] == "none" and start["global_batch"] == 8  # one worker's batch now
    # the steps per epoch are --max-steps' 2 either way: the alone epoch continues the step count
    assert (_ckpt(n1)["epoch"], _ckpt(n1)["step"]) == (2, 6)


# (each rank's checkpoint epoch, -1: no file; the rank whose checkpoint everyone must take, None: a fresh start,
# "each": every rank holds the same save point (epoch and step), so each reads its own and nothing is sent: their
# weights differ here (e + rank / 10) only to show that none came from another rank)
RESUME_CASES = [([-1, 3, 1], 1), ([2, -1, 5], 2), ([-1, 4, 4], 1), ([-1, -1, -1], None), ([6, 6, -1], 0),
                ([7, 7, 7], "each")]


def _resume_rank(rank: int, world: int, init: str, tmp: str) -> None:
    """train_torch._resume on a tiny model, case after case in one process group: rank r's file holds
    epoch e = epochs[r] with every weight and momentum = e and step 10 e + r."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = []
    for case, (epochs, src) in enumerate(RESUME_CASES):
        same = src == "each"
        path = Path(tmp) / f"case{case}" / f"r{rank}" / "checkpoint.pt"
        if epochs[rank] >= 0:
            model = nn.Linear(3, 2)
            opt = train_torch.make_optimizer(model, _tiny_args())
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()  # creates the momentum buffers
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(epochs[rank] + (rank / 10 if same else 0))
                for s in opt.state.values():
                    s["momentum_buffer"].fill_(epochs[rank] + (rank / 10 if same else 0))
            path.parent.mkdir(parents=True, exist_ok=True)
            train_torch._save(model, opt, epochs[rank], 10 * epochs[rank] + (0 if same else rank), path,
                              val_acc=epochs[rank] / 10)
        fresh = nn.Linear(3, 2)
        fresh_opt = train_torch.make_optimizer(fresh, _tiny_args())
        got = train_torch._resume(fresh, fresh_opt, path, rank, world)
        weights = sorted({float(v) for p in fresh.parameters() for v in p.detach().flatten()})
        momenta = sorted({float(v) for s in fresh_opt.state.values() for v in s["momentum_buffer"].flatten()})
        results.append({"got": got, "weights": weights, "momenta": momenta})
    torch.save(results, Path(tmp) / f"results.{rank}")
    ranks.leave()


def _tiny_args():  # noqa: ANN202 - an argparse.Namespace
    import argparse

    return argparse.Namespace(lr=0.01, momentum=0.9, weight_decay=0.0)


def test_resume_takes_the_newest_checkpoint_any_rank_holds(tmp_path: Path) -> None:
    """Some ranks without a file, the newest on a rank other than 0, ties (the lowest rank), none at all; the
    validation accuracy the source saved comes with it (what a run with target_acc decides by)."""
    world = 3
    mp.spawn(_resume_rank, args=(world, f"file://{tmp_path / 'rdzv'}", str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        for (epochs, src), res in zip(RESUME_CASES, torch.load(tmp_path / f"results.{r}")):
            if src is None:
                assert res["got"] == (0, 0, None, "none") and res["momenta"] == [], epochs  # a fresh start everywhere
            elif src == "each":
                e = epochs[r]
                assert res["got"] == (e + 1, 10 * e, e / 10, "each"), (epochs, r)
                assert res["weights"] == res["momenta"] == [pytest.approx(e + r / 10)], (epochs, r)  # its own
            else:
                e = epochs[src]
                assert res["got"] == (e + 1, 10 * e + src, e / 10, f"rank {src}"), (epochs, r)  # the source's
                assert res["weights"] == [float(e)] and res["momenta"] == [float(e)], (epochs, r)


# (each rank's checkpoint epoch, whether its file is cut to 1000 bytes, the rank whose checkpoint both must take,
# None: a fresh start). Every file holds the weights and momentum e + rank / 10 and step 10 e, so even the same
# save point on both ranks ("each" if both were whole) tells whose values a rank ended with.
UNREADABLE_CASES = [([3, 3], [False, True], 0),  # rank 1's own copy of the same save point: it must receive rank 0's
                    ([2, 5], [False, True], 0),  # rank 1 would have been the source
                    ([5, 2], [True, False], 1),  # rank 0 would have been the source
                    ([4, 4], [True, True], None)]  # nothing readable anywhere: a fresh start


def _unreadable_rank(rank: int, world: int, init: str, tmp: str) -> None:
    """train_torch._resume over UNREADABLE_CASES in one gloo process group; this rank's stderr (node.log on a
    node) into a file of its own."""
    torch.set_num_threads(1)
    sys.stderr = open(Path(tmp) / f"stderr.{rank}", "w", buffering=1)  # noqa: SIM115 - until os._exit
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = []
    for case, (epochs, cut, _) in enumerate(UNREADABLE_CASES):
        e = epochs[rank]
        model = nn.Linear(16, 8)
        opt = train_torch.make_optimizer(model, _tiny_args())
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()  # creates the momentum buffers
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(e + rank / 10)
            for s in opt.state.values():
                s["momentum_buffer"].fill_(e + rank / 10)
        path = Path(tmp) / f"case{case}" / f"r{rank}" / "checkpoint.pt"
        path.parent.mkdir(parents=True)
        train_torch._save(model, opt, e, 10 * e, path, val_acc=e / 10)
        if cut[rank]:
            assert path.stat().st_size > 1000
            os.truncate(path, 1000)  # a disk that filled up mid-copy, a node that lost power mid-save
        fresh = nn.Linear(16, 8)
        fresh_opt = train_torch.make_optimizer(fresh, _tiny_args())
        got = train_torch._resume(fresh, fresh_opt, path, rank, world)
        weights = sorted({round(float(v), 4) for p in fresh.parameters() for v in p.detach().flatten()})
        momenta = sorted({round(float(v), 4) for s in fresh_opt.state.values() for v in s["momentum_buffer"].flatten()})
        results.append({"got": got, "weights": weights, "momenta": momenta, "path": str(path)})
    torch.save(results, Path(tmp) / f"results.{rank}")
    ranks.leave()


def test_an_unreadable_checkpoint_counts_as_none_and_its_rank_receives_the_sources(tmp_path: Path) -> None:
    """A checkpoint cut short on one rank fails no restart: that rank takes the source's model, momentum, epoch
    and step (never its own file, even where it held the same save point), and says which file it could not
    read; none readable anywhere: a fresh start."""
    world = 2
    mp.spawn(_unreadable_rank, args=(world, f"file://{tmp_path / 'rdzv'}", str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        said = (tmp_path / f"stderr.{r}").read_text().splitlines()
        results = torch.load(tmp_path / f"results.{r}")
        for (epochs, cut, src), res in zip(UNREADABLE_CASES, results):
            if src is None:
                assert res["got"] == (0, 0, None, "none") and res["momenta"] == [], (epochs, r)
                assert all(w < 1 for w in res["weights"]), (epochs, r)  # the freshly built model's (|w| < 1/4)
            else:
                e = epochs[src]
                assert res["got"] == (e + 1, 10 * e, e / 10, f"rank {src}"), (epochs, cut, r)
                assert res["weights"] == res["momenta"] == [round(e + src / 10, 4)], (epochs, cut, r)
            lines = [x for x in said if res["path"] in x]
            if cut[r]:
                assert len(lines) == 1 and "cannot be read" in lines[0], said
            else:
                assert lines == [], said
        unread = [x for x in said if "cannot be read" in x]
        assert len(unread) == sum(cut[r] for _, cut, _ in UNREADABLE_CASES), said  # one line per unreadable file


# ---------------------------------------------------------------- TensorFlow


# train_tf.py's main with a tiny Keras model in place of ResNet50 (BatchNormalization kept: its sync-on-read
# statistics make the checkpoint write a collective), so a run takes seconds
TF_PROGRAM = f"""
import sys
sys.path.insert(0, {str(WL)!r})
import tf_keras as keras
import train_tf


def tiny(classes, size):
    return keras.Sequential([keras.layers.Input((size, size, 3)), keras.layers.Conv2D(4, 3, padding="same"),
                             keras.layers.BatchNormalization(momentum=0.9), keras.layers.ReLU(),
                             keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(classes)])


train_tf.build_model = tiny
sys.exit(train_tf.main(sys.argv[1:]))
"""


def _tf_procs(program: Path, outs: list[Path], epochs: int, period: int = 1) -> list[subprocess.Popen]:
    """One train_tf.py (MWMS worker) per folder, worker index = its position in `outs`."""
    ports = _free_ports(len(outs))
    procs = []
    for rank, out in enumerate(outs):
        cfg = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}
        env = {**os.environ, "TF_CONFIG": json.dumps(cfg), "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
               "CLUSTER_PERIOD": str(period)}
        cmd = [sys.executable, str(program), "--dataset", "digits", "--size", "8", "--batch", "4", "--epochs",
               str(epochs), "--max-steps", "2", "--log-every", "1", "--threads", "1", "--collective-timeout-s", "120",
               "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _tf_state(out: Path) -> dict[str, object]:
    import numpy as np
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(out / "checkpoint"))
    return {k: np.asarray(reader.get_tensor(k)) for k in reader.get_variable_to_shape_map()
            if not k.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")}


def _tf_same(a: dict[str, object], b: dict[str, object]) -> None:
    import numpy as np

    assert a.keys() == b.keys() and any("optimizer" in k for k in a)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_every_tf_worker_saves_the_checkpoint_and_the_survivors_resume_with_swapped_ranks(tmp_path: Path) -> None:
    """The chief's copy lost, then (the ranks kept) the new chief's: each time the other worker's is taken."""
    program = tmp_path / "train_tf_tiny.py"
    program.write_text(TF_PROGRAM)
    w0, w1 = tmp_path / "w0", tmp_path / "w1"
    _wait_all(_tf_procs(program, [w0, w1], epochs=2))
    assert not list(tmp_path.glob("*/.checkpoint-worker*"))
    assert (w0 / "checkpoint" / "checkpoint").exists() and (w1 / "checkpoint" / "checkpoint").exists()
    _tf_same(_tf_state(w0), _tf_state(w1))  # each worker wrote the whole checkpoint into its own folder
    assert int(_tf_state(w1)["epoch/.ATTRIBUTES/VARIABLE_VALUE"]) == 1
    shutil.rmtree(w0 / "checkpoint")  # the chief's disk lost it
    _wait_all(_tf_procs(program, [w1, w0], epochs=3, period=2))  # restarted: w1 is the chief now, w0 worker 1
    for out, rank in ((w1, 0), (w0, 1)):
        start = _last_start(out / f"metrics-rank{rank}.jsonl")
        assert wlmetrics.validate(start) == []
        assert (start["world"], start["start_epoch"], start["start_step"], start["period"]) == (2, 2, 4, 2)
        assert start["resumed_from"] == "rank 0"
        epochs = [r for r in _records(out / f"metrics-rank{rank}.jsonl") if r["type"] == "epoch"]
        assert [(r["epoch"], r["step"]) for r in epochs] == [(2, 6)]
    s0, s1 = _tf_state(w0), _tf_state(w1)
    _tf_same(s0, s1)  # w0 took w1's values (model, momentum, epoch, step) and saved again
    assert (int(s0["epoch/.ATTRIBUTES/VARIABLE_VALUE"]), int(s0["step/.ATTRIBUTES/VARIABLE_VALUE"])) == (2, 6)
    # and the newest on a worker that is not the chief: the chief (w1) loses its copy, the ranks stay
    shutil.rmtree(w1 / "checkpoint")
    _wait_all(_tf_procs(program, [w1, w0], epochs=4, period=3))
    for out, rank in ((w1, 0), (w0, 1)):
        start = _last_start(out / f"metrics-rank{rank}.jsonl")
        assert (start["start_epoch"], start["start_step"], start["period"], start["resumed_from"]) == (3, 6, 3, "rank 1")
    s0, s1 = _tf_state(w0), _tf_state(w1)
    _tf_same(s0, s1)
    assert (int(s1["epoch/.ATTRIBUTES/VARIABLE_VALUE"]), int(s1["step/.ATTRIBUTES/VARIABLE_VALUE"])) == (3, 8)
    # both hold the same save point now: each restores its own, nothing is sent, and they go on as one
    _wait_all(_tf_procs(program, [w0, w1], epochs=5, period=4))
    for out, rank in ((w0, 0), (w1, 1)):
        start = _last_start(out / f"metrics-rank{rank}.jsonl")
        assert (start["start_epoch"], start["start_step"], start["resumed_from"]) == (4, 8, "each")
    _tf_same(_tf_state(w0), _tf_state(w1))


def test_a_tf_worker_whose_checkpoint_cannot_be_read_takes_the_other_workers(tmp_path: Path) -> None:
    """The chief's copy of the save point both hold, cut short: it restores nothing of it, says so, and takes
    worker 1's values; both go on from there as one."""
    import tensorflow as tf

    program = tmp_path / "train_tf_tiny.py"
    program.write_text(TF_PROGRAM)
    w0, w1 = tmp_path / "w0", tmp_path / "w1"
    _wait_all(_tf_procs(program, [w0, w1], epochs=2))
    latest = tf.train.latest_checkpoint(str(w0 / "checkpoint"))
    (data,) = Path(latest).parent.glob(Path(latest).name + ".data-*")
    os.truncate(data, data.stat().st_size // 2)
    errs = _wait_all(_tf_procs(program, [w0, w1], epochs=3, period=2))
    said = [x for x in errs[0].splitlines() if "cannot be read" in x]
    assert len(said) == 1 and latest in said[0], errs[0][-3000:]
    assert "cannot be read" not in errs[1], errs[1][-3000:]
    for out, rank in ((w0, 0), (w1, 1)):
        start = _last_start(out / f"metrics-rank{rank}.jsonl")
        assert (start["start_epoch"], start["start_step"], start["resumed_from"]) == (2, 4, "rank 1")
        epochs = [r for r in _records(out / f"metrics-rank{rank}.jsonl") if r["type"] == "epoch"]
        assert [(r["epoch"], r["step"]) for r in epochs] == [(0, 2), (1, 4), (2, 6)]  # each epoch once
    s0, s1 = _tf_state(w0), _tf_state(w1)
    _tf_same(s0, s1)
    assert (int(s0["epoch/.ATTRIBUTES/VARIABLE_VALUE"]), int(s0["step/.ATTRIBUTES/VARIABLE_VALUE"])) == (2, 6)
