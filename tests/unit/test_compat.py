"""The builds chosen for the GPUs a recycled lab holds, against drivers 470/535/580/590."""
from __future__ import annotations

from typing import Any

import pytest

from cluster.provision import compat
from cluster.errors import ClusterError

GPUS = {
    "GTX 750 Ti": "5.0",
    "GTX 970": "5.2",
    "GTX 1050 Ti": "6.1",
    "GTX 1080": "6.1",
    "RTX 2060": "7.5",
    "RTX 3090": "8.6",
}
DRIVERS = {"470": "470.256.02", "535": "535.247.01", "580": "580.95.05", "590": "590.44.01"}

# (gpu, driver) -> preferred torch build, TF on GPU (version or None = CPU), AMP; or the refusal's words.
EXPECTED = {
    **{(g, "470"): ("2.7.1+cu118", None, False) for g in ("GTX 750 Ti", "GTX 970", "GTX 1050 Ti", "GTX 1080")},
    **{(g, d): ("2.14.1+cu126", "2.16.2", False) for g in ("GTX 750 Ti", "GTX 970") for d in ("535", "580")},
    **{(g, d): ("2.14.1+cu126", "2.21.0", False) for g in ("GTX 1050 Ti", "GTX 1080") for d in ("535", "580")},
    **{(g, "590"): "branches after R580 dropped Maxwell, Pascal and Volta"
       for g in ("GTX 750 Ti", "GTX 970", "GTX 1050 Ti", "GTX 1080")},
    **{(g, "470"): ("2.7.1+cu118", None, True) for g in ("RTX 2060", "RTX 3090")},
    **{(g, d): ("2.14.1+cu126", "2.21.0", True) for g in ("RTX 2060", "RTX 3090") for d in ("535", "580", "590")},
}


def gpu(name: str, driver: str) -> list[dict[str, Any]]:
    return [{"name": f"NVIDIA GeForce {name}", "compute_capability": GPUS[name], "driver": DRIVERS[driver]}]


@pytest.mark.parametrize("case", sorted(EXPECTED), ids=lambda c: f"{c[0]}-{c[1]}")
def test_node_plan_matrix(case: tuple[str, str]) -> None:
    name, drv = case
    opts = compat.node_options("n", gpu(name, drv))
    want = EXPECTED[case]
    if isinstance(want, str):
        assert not opts.ok and want in (opts.refusal or "")
        assert "R580" in (opts.fix or "") and compat.RECOMMENDED_DRIVER in (opts.fix or "")
        return
    torch, tf, amp = want
    best = opts.torch_options[0]
    assert opts.ok and f"{best.version}+{best.variant}" == torch
    assert (opts.tf_gpu_options[0].version if opts.tf_gpu_options else None) == tf
    assert opts.amp is amp
    alone = compat.choose_builds([opts]).builds["n"]
    assert alone.backend == "nccl"
    assert alone.tf_package == ("tensorflow[and-cuda]" if tf else "tensorflow-cpu")
    pascal_or_older_on_tf221 = tf == "2.21.0" and float(GPUS[name]) < 7.5
    assert (compat.CUDNN_PIN_PRE_TURING in alone.pins) is pascal_or_older_on_tf221


@pytest.mark.parametrize("drv", sorted(DRIVERS))
def test_cpu_only_node_any_driver(drv: str) -> None:
    opts = compat.node_options("cpu", [])
    b = compat.choose_builds([opts]).builds["cpu"]
    assert (b.torch, b.torch_variant, b.tensorflow, b.tf_package, b.backend, b.amp) == (
        "2.14.1", "cpu", "2.21.0", "tensorflow-cpu", "gloo", False)
    assert b.requirements()[:3] == ["torch==2.14.1+cpu", "torchvision==0.29.1+cpu", "tensorflow-cpu==2.21.0"]


def test_unknown_and_too_old_gpus_are_refused_with_a_fix() -> None:
    p = compat.node_options("k", [{"name": "GeForce GTX 780", "compute_capability": "3.5", "driver": "470.256.02"}])
    assert not p.ok and "no supported PyTorch build" in (p.refusal or "") and "gpu: none" in (p.fix or "")
    p = compat.node_options("x", [{"name": "Mystery GPU", "compute_capability": None, "driver": "580.95.05"}])
    assert not p.ok and "compute_capability" in (p.fix or "")
    p = compat.node_options("o", [{"name": "GeForce GTX 1050 Ti", "compute_capability": "6.1", "driver": "440.100"}])
    assert not p.ok and "too old" in (p.refusal or "") and ">= 450.80.02" in (p.refusal or "")


def test_mixed_lab_agrees_on_versions_and_backend() -> None:
    options = [compat.node_options("pc1", gpu("GTX 1050 Ti", "580")), compat.node_options("pc2", gpu("GTX 970", "580")),
             compat.node_options("pc4", [])]
    cp = compat.choose_builds(options)
    assert cp.torch == "2.14.1" and cp.tensorflow == "2.16.2"  # the 970 (Maxwell) sets TF's version
    assert cp.backend == "gloo"  # one CPU-only rank: every rank uses gloo
    assert [cp.builds[h].torch_variant for h in ("pc1", "pc2", "pc4")] == ["cu126", "cu126", "cpu"]
    assert cp.builds["pc1"].tf_on_gpu and not cp.builds["pc4"].tf_on_gpu
    assert compat.CUDNN_PIN_PRE_TURING not in cp.builds["pc1"].pins  # TF 2.16 pins cuDNN 8.9 itself


def test_one_old_driver_pulls_the_lab_to_a_common_torch() -> None:
    cp = compat.choose_builds([compat.node_options("a", gpu("GTX 1080", "470")), compat.node_options("b", gpu("RTX 3090", "580"))])
    assert cp.torch == "2.7.1" and {b.torch_variant for b in cp.builds.values()} == {"cu118"}
    assert cp.backend == "nccl"
    # the same TF version everywhere: on the GPU where the driver allows, on the CPU on the R470 node
    assert cp.tensorflow == "2.21.0" and not cp.builds["a"].tf_on_gpu and cp.builds["b"].tf_on_gpu
    assert any("runs on the CPU" in n for n in cp.builds["a"].notes)


def test_refused_nodes_are_reported_and_the_rest_planned() -> None:
    cp = compat.choose_builds([compat.node_options("a", gpu("GTX 1080", "590")), compat.node_options("b", [])])
    assert set(cp.refused) == {"a"} and set(cp.builds) == {"b"}
    assert cp.to_dict()["refused"]["a"]["fix"].startswith("install the R580 driver")


def test_no_common_torch_is_an_error() -> None:
    old = compat.node_options("old", [{"name": "Tesla K80", "compute_capability": "3.7", "driver": "470.256.02"}])
    new = compat.node_options("new", gpu("RTX 3090", "580"))
    new.torch_options = [o for o in new.torch_options if o.version != "2.7.1"]
    with pytest.raises(ClusterError, match="no PyTorch version runs on every node"):
        compat.choose_builds([old, new])


def test_pypi_index_uses_plain_versions() -> None:
    b = compat.choose_builds([compat.node_options("c", [])], torch_index=None).builds["c"]
    assert b.requirements()[:2] == ["torch==2.14.1", "torchvision==0.29.1"]
