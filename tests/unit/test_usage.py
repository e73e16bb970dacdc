"""The node agent's usage sampler (cluster/agent/usage.py): nvidia-smi's answers (recorded), RAPL
counters (a powercap tree of its own), and the CPU and memory of real processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cluster.agent import usage
from tests.conftest import ROOT
from tests.unit.test_nodeagent import agent, make_run, wait_state

FIXTURES = ROOT / "tests" / "fixtures" / "usage"


def test_nvidia_smi_answers_are_read_with_missing_fields_as_none() -> None:
    assert usage.parse_gpus((FIXTURES / "gtx1050ti-busy.txt").read_text()) == [
        {"util_percent": 97.0, "mem_mb": 3172.0, "power_w": 71.3}]
    assert usage.parse_gpus((FIXTURES / "two-geforce-na-power.txt").read_text()) == [
        {"util_percent": 88.0, "mem_mb": 1890.0, "power_w": None}, {"util_percent": 0.0, "mem_mb": 2.0, "power_w": None}]
    assert usage.parse_gpus("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n") == []


def _zone(root: Path, name: str, energy: int, wrap: int = 2**32) -> None:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "energy_uj").write_text(f"{energy}\n")
    (root / name / "max_energy_range_uj").write_text(f"{wrap}\n")


def test_cpu_energy_comes_from_the_package_counters_with_wraparound(tmp_path: Path) -> None:
    _zone(tmp_path, "intel-rapl:0", 1_000_000)
    _zone(tmp_path, "intel-rapl:0:0", 5)  # a subzone (cores) of package 0: not counted twice
    _zone(tmp_path, "intel-rapl:1", 2**32 - 500_000)  # about to wrap
    s = usage.Sampler(tmp_path / "u.jsonl", lambda: [os.getpid()], rapl_root=tmp_path)
    first = s.sample()
    assert "cpu_energy_j" not in first and "cpu_percent" not in first
    _zone(tmp_path, "intel-rapl:0", 3_000_000)
    _zone(tmp_path, "intel-rapl:1", 1_500_000)  # wrapped: 2.0 J later
    second = s.sample()
    assert second["cpu_energy_j"] == 4.0
    assert [json.loads(x)["t"] for x in (tmp_path / "u.jsonl").read_text().splitlines()] == [first["t"], second["t"]]
    assert usage.rapl_packages(tmp_path / "nothing") == {}


def test_cpu_and_memory_of_busy_processes(tmp_path: Path) -> None:
    busy = subprocess.Popen([sys.executable, "-c", "x = bytearray(64 << 20)\nwhile True: pass"])
    try:
        time.sleep(0.5)
        s = usage.Sampler(tmp_path / "u.jsonl", lambda: [busy.pid])
        s.sample()
        time.sleep(1.0)
        doc = s.sample()
    finally:
        busy.kill()
        busy.wait()
    # the busy loop got some CPU (how much depends on what else this machine runs: no speed is asserted)
    assert doc["procs"] == 1 and doc["rss_mb"] >= 64 and 5 <= doc["cpu_percent"] <= 100 * (os.cpu_count() or 1) + 10, doc


def test_the_node_agent_samples_every_run_and_status_shows_the_last(tmp_path: Path) -> None:
    d = make_run(tmp_path, f"{sys.executable} -c 'import time\nt = time.time()\nwhile time.time() - t < 3: pass'\n")
    r = subprocess.run([sys.executable, str(ROOT / "cluster" / "agent" / "nodeagent.py"), "start", str(d)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "CLUSTERCTL_SAMPLE_S": "0.5"})
    assert json.loads(r.stdout)["ok"]
    time.sleep(2.5)
    live = agent("status", str(d))
    assert live["state"] == "running" and live["usage"]["procs"] >= 1, live["usage"]
    wait_state(d, "succeeded", timeout=30)
    samples = [json.loads(x) for x in (d / "out" / "usage.jsonl").read_text().splitlines()]
    assert len(samples) >= 3 and max(x.get("cpu_percent", 0) for x in samples) > 5, samples
