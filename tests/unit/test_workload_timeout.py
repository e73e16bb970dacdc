"""A training process whose peer dies or freezes must fail by itself within the collective timeout.

Two real train_torch.py processes (gloo on loopback, ResNet50 at 8x8 so steps are quick); one is
frozen (SIGSTOP: its sockets stay open, nothing answers) or killed (SIGKILL) mid-training. The other
must exit non-zero within --collective-timeout-s plus slack, not hang for gloo's default 30 minutes.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the training programs: left out of the quick tier

WL = Path(__file__).resolve().parents[2] / "cluster" / "programs"
TIMEOUT_S = 10
SLACK_S = 30  # process teardown, a step in flight, a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp: Path, rank: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(WL / "train_torch.py"), "--dataset", "digits", "--size", "8", "--batch", "8",
           "--epochs", "50", "--log-every", "1", "--threads", "1", "--out", str(tmp / f"r{rank}"),
           "--collective-timeout-s", str(TIMEOUT_S)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"r{rank}.err", "w"))


def _steps(tmp: Path, rank: int) -> int:
    f = tmp / f"r{rank}" / f"metrics-rank{rank}.jsonl"
    if not f.exists():
        return 0
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return max((r["step"] for r in recs if r["type"] == "step"), default=0)


def _wait_for_steps(tmp: Path, procs: list[subprocess.Popen], n: int, limit: float) -> None:
    """Until rank 0 has logged `n` steps (both ranks training), or fail with its stderr."""
    deadline = time.monotonic() + limit
    while _steps(tmp, 0) < n and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    assert _steps(tmp, 0) >= n, (tmp / "r0.err").read_text()[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen-peer", "dead-peer"])
def test_a_rank_whose_peer_stops_answering_exits_nonzero_within_the_timeout(tmp_path: Path, sig: int) -> None:
    port = _free_port()
    procs = [_start(tmp_path, r, port) for r in range(2)]
    try:
        _wait_for_steps(tmp_path, procs, 3, 300)
        os.kill(procs[1].pid, sig)
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=TIMEOUT_S + SLACK_S)  # TimeoutExpired here: it hung
        waited = time.monotonic() - t0
        print(f"peer {signal.Signals(sig).name}: rank 0 exited {rc} after {waited:.1f} s")  # shown with -s
        assert rc != 0
        err = (tmp_path / "r0.err").read_text()
        if sig == signal.SIGSTOP:
            # nothing told it the peer was gone: only the collective timeout can have ended it
            assert waited >= TIMEOUT_S * 0.5, (waited, err[-2000:])
            assert "timed out" in err.lower() or "timeout" in err.lower(), err[-2000:]
        steps_at_end = _steps(tmp_path, 0)
        assert steps_at_end < 50 * 89  # it did not finish the run: it failed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def _start_tf(tmp: Path, rank: int, ports: list[int]) -> subprocess.Popen:
    cfg = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}
    env = {**os.environ, "TF_CONFIG": json.dumps(cfg), "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(WL / "train_tf.py"), "--dataset", "digits", "--batch", "4", "--epochs", "50",
           "--log-every", "1", "--threads", "1", "--out", str(tmp / f"r{rank}"),
           "--collective-timeout-s", str(TF_TIMEOUT_S)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"r{rank}.err", "w"))


TF_TIMEOUT_S = 20


def test_a_tf_worker_whose_peer_freezes_exits_nonzero_within_the_timeout(tmp_path: Path) -> None:
    """MWMS: the coordination service's heartbeat timeout and the collective timeout, both from
    --collective-timeout-s, end the worker whose peer froze mid-training."""
    ports = [_free_port(), _free_port()]
    procs = [_start_tf(tmp_path, r, ports) for r in range(2)]
    try:
        _wait_for_steps(tmp_path, procs, 2, 600)
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=TF_TIMEOUT_S + SLACK_S + 30)  # TimeoutExpired here: it hung
        waited = time.monotonic() - t0
        print(f"TF peer SIGSTOP: worker 0 exited {rc} after {waited:.1f} s")  # shown with -s
        assert rc != 0
        assert waited >= TF_TIMEOUT_S * 0.5, (waited, (tmp_path / "r0.err").read_text()[-2000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
