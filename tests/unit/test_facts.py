"""Fact parsers on recorded real outputs (tests/fixtures/facts/README.md says where each came from)."""
from __future__ import annotations

import pytest

from cluster.nodes import facts, health
from cluster.nodes.facts import NodeFacts
from cluster.nodes.gpus import compute_capability_for
from cluster.inventory.model import GpuSpec, Host
from tests.conftest import FIXTURES

F = FIXTURES / "facts"


def test_full_script_output_from_a_lab_node() -> None:
    v = facts.parse_all((F / "lab-node1.txt").read_text())
    assert v["os"] == {"name": "Debian GNU/Linux 12 (bookworm)", "id": "debian", "version": "12",
                       "codename": "bookworm", "arch": None}  # recorded before the os fact printed dpkg's arch
    assert v["kernel"].startswith("Linux ") and v["kernel"].endswith("x86_64")
    assert v["python"]["version_tuple"][:2] == [3, 11]
    assert v["cpu"]["usable"] == 2 and v["cpu"]["logical"] == 2 and "Xeon" in v["cpu"]["model"]
    assert v["memory"]["total_mib"] > 20000 and 0 < v["memory"]["available_mib"] <= v["memory"]["total_mib"]
    assert v["disk"]["path"] == "/srv/cluster" and 0 < v["disk"]["free_gib"] <= v["disk"]["total_gib"]
    assert v["gpus"] == {"source": "none", "gpus": [], "error": None}  # no nvidia-smi on this machine
    assert [n["name"] for n in v["nics"]] == ["lo", "eth0"]
    assert "10.79.0.11" in v["nics"][1]["addresses"]  # "eth0@if6" in `ip -o` output: the @ part is dropped
    assert facts.nic_for(v["nics"], "10.79.0.11") == "eth0"
    assert v["hostname"] == {"name": "node1", "resolves_to": [], "on_loopback": False}


def test_hostname_on_loopback_recorded_on_the_head() -> None:
    v = facts.parse_all((F / "head-local.txt").read_text())
    assert v["hostname"]["name"] == "vm" and v["hostname"]["on_loopback"]
    assert v["hostname"]["resolves_to"] == ["127.0.0.1"]


def test_nvidia_smi_gtx1050ti() -> None:
    g = facts.parse_gpus((F / "nvidia-smi-gtx1050ti.txt").read_text(), 0)
    assert g["source"] == "nvidia-smi" and g["error"] is None
    assert g["gpus"] == [{"index": None, "name": "NVIDIA GeForce GTX 1050 Ti", "compute_capability": "6.1",
                          "driver": "580.95.05", "memory_mib": 4096}]


@pytest.mark.parametrize("fixture,model,usable", [
    ("cpu-i5-2400.txt", "Intel(R) Core(TM) i5-2400 CPU @ 3.10GHz", None),  # an old lab PC, no nproc line
    ("cpu-amd-epyc.txt", "AMD EPYC", 2),
])
def test_cpu_model_and_usable_cores_from_recorded_cpuinfo(fixture: str, model: str, usable: int | None) -> None:
    cpu = facts.parse_cpu((F / fixture).read_text(), 0)
    assert (cpu["model"], cpu["usable"]) == (model, usable)


def test_nvidia_smi_r470_rejects_compute_cap_and_falls_back_to_the_name() -> None:
    g = facts.parse_gpus((F / "nvidia-smi-r470.txt").read_text(), 0)
    assert g["source"].startswith("nvidia-smi (no compute_cap")
    assert [(x["name"], x["compute_capability"], x["driver"]) for x in g["gpus"]] == [
        ("NVIDIA GeForce GTX 1050 Ti", "6.1", "470.256.02"), ("NVIDIA GeForce GTX 970", "5.2", "470.256.02")]


def test_nvidia_smi_without_driver() -> None:
    g = facts.parse_gpus((F / "nvidia-smi-no-driver.txt").read_text(), 0)
    assert g["gpus"] == [] and g["source"] == "nvidia-smi failed"
    assert "couldn't communicate with the NVIDIA driver" in g["error"]


def test_machine_without_nvidia_smi() -> None:
    out, rc = facts.split_output((F / "lab-node1.txt").read_text())["gpus"]
    assert out.strip() == "@@absent" and rc == 0
    assert facts.parse_gpus(out, rc)["source"] == "none"


def test_missing_python_and_disk() -> None:
    assert facts.parse_python("sh: 1: python3: not found\n", 127) is None
    assert facts.parse_python("/usr/bin/python3\n3.9.2\n", 0)["version_tuple"] == [3, 9, 2]
    assert facts.parse_disk("df: cannot read table of mounted file systems\n", 1) is None


def test_compute_capability_table() -> None:
    cases = {"GeForce GTX 750 Ti": "5.0", "NVIDIA GeForce GTX 970": "5.2", "GeForce GTX 1080 Ti": "6.1",
             "NVIDIA GeForce RTX 2060": "7.5", "NVIDIA GeForce RTX 3090": "8.6", "Tesla P100-PCIE-16GB": "6.0",
             "NVIDIA H200": "9.0", "Matrox G200": None}
    assert {n: compute_capability_for(n) for n in cases} == cases


def test_script_quotes_inventory_values() -> None:
    h = Host(name="a", address="x", python="python3; touch /tmp/pwned", workdir="/srv/it's here")
    s = facts.script(h)
    assert "'python3; touch /tmp/pwned' -c" in s
    assert "d='/srv/it'\"'\"'s here'" in s


def _host(**kw) -> Host:
    return Host(name="pc1", address="10.0.0.11", **kw)


def _facts(text: str = "lab-node1.txt", **kw) -> NodeFacts:
    nf = NodeFacts(host="pc1", values=facts.parse_all((F / text).read_text()), address_nic="eth0",
                   clock_offset_s=0.001)
    for k, v in kw.items():
        setattr(nf, k, v)
    return nf


def test_health_healthy_node_has_no_problem() -> None:
    assert health.from_facts(_host(), _facts()) == []


def test_health_problems_and_fixes() -> None:
    nf = _facts("head-local.txt", clock_offset_s=2.5, address_nic=None)
    nf.values["python"] = facts.parse_python("/usr/bin/python3\n3.8.10\n", 0)
    nf.values["disk"] = {"path": "/srv", "total_gib": 100.0, "free_gib": 1.5}
    probs = {p.code: p for p in health.from_facts(_host(gpu=GpuSpec(1, "GTX 1050 Ti")), nf)}
    assert set(probs) == {"python-old", "disk-low", "clock-skew", "hostname-loopback", "address-nic", "gpu-missing"}
    assert probs["python-old"].blocking and probs["disk-low"].blocking and probs["gpu-missing"].blocking
    assert not probs["clock-skew"].blocking and "+2.50 s" in probs["clock-skew"].message
    assert "timedatectl" in probs["clock-skew"].fix
    assert "127.0.0.1" in probs["hostname-loopback"].message


@pytest.mark.parametrize("free, blocking, says", [(1.9, True, "will not fit"), (2.0, False, "first provision"),
                                                 (9.9, False, "first provision"), (10.0, False, "datasets"),
                                                 (24.9, False, "datasets"), (25.0, None, "")])
def test_low_disk_blocks_only_where_no_run_fits_and_leaves_a_first_provision_to_provisions_own_measure(
        free: float, blocking: bool | None, says: str) -> None:
    nf = _facts()
    nf.values["disk"] = {"path": "/srv/cluster", "total_gib": 100.0, "free_gib": free}
    probs = [p for p in health.from_facts(_host(), nf) if p.code == "disk-low"]
    if blocking is None:
        assert probs == []
    else:
        assert [p.blocking for p in probs] == [blocking] and says in probs[0].message + probs[0].fix
        assert f"{free} GiB free at /srv/cluster" in probs[0].message


def test_health_gpu_driver_failure_blocks_only_where_a_gpu_is_expected() -> None:
    nf = _facts()
    nf.values["gpus"] = facts.parse_gpus((F / "nvidia-smi-no-driver.txt").read_text(), 0)
    assert [(p.code, p.blocking) for p in health.from_facts(_host(), nf)] == [("gpu-driver", False)]
    codes = {(p.code, p.blocking) for p in health.from_facts(_host(gpu=GpuSpec(1)), nf)}
    assert codes == {("gpu-driver", True), ("gpu-missing", True)}


def test_summary_cells_of_check_table() -> None:
    """`check`'s table cells: short texts from the facts dict, None where a fact the node needs is missing."""
    d = {"os": {"id": "debian", "version": "12"}, "python": {"version": "3.11.2"}, "cpu": {"usable": 4},
         "memory": {"total_mib": 16000}, "disk": {"free_gib": 120.4},
         "gpus": {"gpus": [{"name": "NVIDIA GeForce GTX 1050 Ti", "compute_capability": "6.1", "driver": "535"}]},
         "address_nic": "eth0", "clock_offset_s": -0.0123}
    assert facts.summary(d) == ["debian 12", "3.11.2", "4", "16G", "120G", "GTX 1050 Ti (cc 6.1, 535)", "eth0",
                                "-0.012"]
    assert len(facts.SUMMARY_COLUMNS) == len(facts.summary(d))
    # nothing known: placeholders, and None where the node must have Python
    assert facts.summary({"python": None}) == ["?", None, "?", "0G", "?", "none", "-", "?"]
