"""Per-inventory state on the head: one file per loader, never shared by two that share a name."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster import paths
from cluster.study import bench, placement
from cluster.inventory import loader
from cluster.errors import InventoryError
from tests.conftest import write

INV = "name: lab\nhosts:\n  pc1: {address: 127.0.0.1}\n"


def test_two_inventories_with_one_name_keep_separate_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_HOME", str(tmp_path / "home"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = loader.load(write(tmp_path / "a", INV, "lab.yaml"), check_files=False)
    b = loader.load(write(tmp_path / "b", INV, "lab.yaml"), check_files=False)
    assert a.name == b.name == "lab"
    assert bench.bench_path(a) != bench.bench_path(b)
    assert placement.choice_path(a, "j") != placement.choice_path(b, "j")
    for p in (bench.bench_path(a), placement.choice_path(a, "j")):
        assert p.resolve().is_relative_to((tmp_path / "home").resolve())
    assert paths.inventory_key("lab", tmp_path / "a" / "lab.yaml") == paths.inventory_key("lab", tmp_path / "a" / "lab.yaml")


@pytest.mark.parametrize("name", ["../../etc/x", "a/b", "..", "x\ny"])
def test_an_inventory_name_that_is_not_path_safe_is_refused(tmp_path: Path, name: str) -> None:
    import json

    with pytest.raises(InventoryError, match="name"):
        loader.load(write(tmp_path, f"name: {json.dumps(name)}\n" + INV.split("\n", 1)[1], "lab.yaml"),
                       check_files=False)
