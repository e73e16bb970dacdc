"""Per-inventory state on the head: one file per loader, never shared by two that share a name."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster import paths
from cluster.planner import bench, plans
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
    assert plans.choice_path(a, "j") != plans.choice_path(b, "j")
    for p in (bench.bench_path(a), plans.choice_path(a, "j")):
        assert p.resolve().is_relative_to((tmp_path / "home").resolve())
    assert paths.inventory_key("lab", tmp_path / "a" / "lab.yaml") == paths.inventory_key("lab", tmp_path / "a" / "lab.yaml")


@pytest.mark.parametrize("name", ["../../etc/x", "a/b", "..", "x\ny"])
def test_an_inventory_name_that_is_not_path_safe_is_refused(tmp_path: Path, name: str) -> None:
    import json

    with pytest.raises(InventoryError, match="name"):
        loader.load(write(tmp_path, f"name: {json.dumps(name)}\n" + INV.split("\n", 1)[1], "lab.yaml"),
                       check_files=False)


def test_a_write_that_fails_part_way_leaves_the_old_file_whole_and_no_temporary(tmp_path: Path) -> None:
    """lab.json, run.json, context.json: polled by other processes, so never truncated before the new text
    is complete (a test polling lab.json once read an empty file while `study --poweroff-after` saved it)."""
    from cluster.lab import state as lab_state

    p = tmp_path / "lab.json"
    paths.write_atomic(p, '{"old": 1}\n')
    with pytest.raises(UnicodeEncodeError):
        paths.write_atomic(p, '{"new": "\udcff"}\n')  # fails in the write, after the temporary is open
    assert p.read_text() == '{"old": 1}\n'
    assert [f.name for f in tmp_path.iterdir()] == ["lab.json"]
    st = lab_state.LabState(name="t", subnet="10.0.0.0/24", bridge="b", gateway="10.0.0.1", bandwidth=None,
                            dir=str(tmp_path), inventory=str(tmp_path / "lab.yaml"), nodes=[])
    lab_state.save_state(st)
    assert lab_state.load_state("t", tmp_path) == st
    assert [f.name for f in tmp_path.iterdir()] == ["lab.json"]
