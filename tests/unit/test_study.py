"""`study --vary`: its values, which one-node cells it records, and the scaling baseline they give."""
from __future__ import annotations

import pytest

from cluster.study import comparison, matrix
from cluster.runs import records
from cluster.errors import UsageError


def test_vary_is_one_setting_per_value() -> None:
    assert matrix.variants(None) == [None]
    assert matrix.variants("grad_compression=none, fp16") == ["grad_compression=none", "grad_compression=fp16"]


@pytest.mark.parametrize("text", ["grad_compression", "=none,fp16", "grad_compression=fp16", "batch=8,8", "accumulate="])
def test_vary_refuses_what_is_not_two_values_of_one_setting(text: str) -> None:
    with pytest.raises(UsageError) as e:
        matrix.variants(text)
    assert "--vary" in e.value.message and "grad_compression=none,fp16" in e.value.fix


def test_one_node_runs_once_for_a_wire_setting_and_per_value_otherwise() -> None:
    first = "grad_compression=none"
    assert matrix._runs_alone(first, first) and not matrix._runs_alone("grad_compression=fp16", first)
    assert not matrix._runs_alone("collective_timeout_s=30", "collective_timeout_s=10")
    assert matrix._runs_alone("accumulate=4", "accumulate=1")  # more micro-batches per step: another run
    assert matrix._runs_alone("batch=16", "batch=8") and matrix._runs_alone(None, None)


def test_study_id_is_unchanged_without_vary_and_differs_with_it() -> None:
    class Inv:
        path = "inventory/lab.yaml"

    plain = matrix.study_id(Inv(), ["resnet50-ddp"], [1, 2], [])  # type: ignore[arg-type]
    assert plain == "study-" + __import__("hashlib").sha256(
        b'{"inventory": "inventory/lab.yaml", "jobs": ["resnet50-ddp"], "sizes": [1, 2], "set": []}').hexdigest()[:12]
    assert matrix.study_id(Inv(), ["resnet50-ddp"], [1, 2], [], "grad_compression=none,fp16") != plain  # type: ignore[arg-type]


def record(nodes: int, **settings: object) -> records.RunRecord:
    return records.RunRecord(f"r{nodes}", "resnet50-ddp", "pytorch", "succeeded", 0.0,
                          [records.RunNode(f"node{i}", i, 1, "/srv") for i in range(nodes)], {},
                          {"batch": 32, "grad_compression": "none", "accumulate": 1, **settings})


def test_a_one_node_baseline_ignores_wire_settings_only() -> None:
    one = record(1)
    assert comparison._comparable(one, record(2, grad_compression="fp16", collective_timeout_s=30))
    assert not comparison._comparable(one, record(2, accumulate=4))  # another optimizer: not the same run
    assert not comparison._comparable(one, record(2, batch=16))
    assert not comparison._comparable(record(2), record(4, grad_compression="fp16"))  # both cross a network
