"""The inventory corpus (tests/fixtures/ansible/): both readers against Ansible's own saved answers.

Each case's answer.json was written by scripts/ansible_answers.py from ansible-core itself
(`ansible-inventory --list`, and a play that contacts nothing: templated vars, group_names and the ssh
command line Ansible would run). Ansible path: equal, field by field. Built-in path: equal, or an
InventoryError (exit 2) naming the fix -- never a third outcome. Addresses are parsed, never contacted.
"""
from __future__ import annotations

import getpass
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.inventory import ansible as inventory_ansible, ansible_core, loader, model
from cluster.errors import InventoryError
from tests.conftest import FIXTURES

CORPUS = FIXTURES / "ansible"
CASES = sorted(p.parent.name for p in CORPUS.glob("*/case.yaml"))
CONSUMED = inventory_ansible.CONSUMED
needs_ansible = pytest.mark.skipif(not ansible_core.available(),
                                   reason="ansible-core is not installed (pip install clusterctl[ansible])")


def _case(name: str) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    d = CORPUS / name
    spec = yaml.safe_load((d / "case.yaml").read_text())
    answer = json.loads((d / "answer.json").read_text().replace("$CASE", str(d)))
    return d / spec["source"], spec, answer


def _expanded(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser())


def _python(value: Any) -> str:
    return "python3" if value in (None, "auto", "auto_silent", "auto_legacy", "auto_legacy_silent") else str(value)


def _connection(value: Any) -> str:
    return "ssh" if value in (None, "ssh", "smart", "paramiko") else str(value)


def assert_same_as_ansible(inv: model.Inventory, answer: dict[str, Any]) -> None:
    """Every field clusterctl takes from the loader, compared with Ansible's answer."""
    assert list(inv.hosts) == answer["order"]
    assert {g: set(m) for g, m in inv.groups.items()} == {g: set(m) for g, m in answer["groups"].items()}
    for name, want in answer["hosts"].items():
        h = inv.hosts[name]
        ssh, values = want["ssh"], want["vars"]
        assert h.address == ssh["address"], name
        assert h.port == (ssh["port"] or 22), name
        assert h.user == (ssh["user"] or getpass.getuser()), name
        assert _expanded(h.identity_file) == _expanded(ssh["key"]), name
        assert h.python == values.get("clusterctl_python", _python(values.get("ansible_python_interpreter"))), name
        assert h.connection == _connection(values.get("ansible_connection")), name
        assert sorted(h.groups) == sorted(want["group_names"]), name
        free = {k: v for k, v in values.items()
                if k not in CONSUMED and not k.startswith("clusterctl_")
                and not (isinstance(v, dict) and "__error__" in v)}
        assert dict(h.vars) == free, name
        if "clusterctl_workdir" in values:
            assert h.workdir == values["clusterctl_workdir"], name
    rank0 = [n for n, w in answer["hosts"].items() if w["vars"].get("clusterctl_rank0") in (True, "true")]
    assert inv.rank0 == (rank0[0] if rank0 else answer["order"][0])


def test_corpus_is_large_and_answered() -> None:
    assert len(CASES) >= 20
    kinds = {"ini": 0, "yaml": 0, "dir": 0}
    for name in CASES:
        source, spec, answer = _case(name)
        assert "error" not in answer, name
        assert answer["hosts"], name
        kinds["dir" if source.is_dir() else "yaml" if source.suffix in (".yaml", ".yml") else "ini"] += 1
    assert all(kinds.values()), kinds
    # the built-in reader reads a real share of the corpus, not nothing
    assert sum(yaml.safe_load((CORPUS / n / "case.yaml").read_text())["builtin"] == "read" for n in CASES) >= 10


@needs_ansible
@pytest.mark.parametrize("name", CASES)
def test_ansible_path_equals_ansible(name: str) -> None:
    source, spec, answer = _case(name)
    if spec.get("refuse"):
        with pytest.raises(InventoryError, match=spec["refuse"]):
            loader.load(source, check_files=False, reader="ansible")
        return
    inv = loader.load(source, check_files=False, reader="ansible")
    assert inv.format == "ansible"
    assert_same_as_ansible(inv, answer)


@pytest.mark.parametrize("name", CASES)
def test_builtin_path_equals_ansible_or_refuses(name: str) -> None:
    source, spec, answer = _case(name)
    try:
        inv = loader.load(source, check_files=False, reader="builtin")
    except InventoryError as e:
        assert spec["builtin"] == "refuse" or spec.get("refuse"), f"{name}: refused unexpectedly: {e}"
        if spec.get("refuse") and "install clusterctl[ansible]" not in str(e):
            assert spec["refuse"] in str(e)
        else:
            assert "install clusterctl[ansible]" in str(e)
            assert e.file, name
        return
    assert not spec.get("refuse"), f"{name}: read, but clusterctl must refuse it"
    assert spec["builtin"] == "read", f"{name}: read by the built-in reader, expected a refusal"
    assert_same_as_ansible(inv, answer)


@needs_ansible
def test_cache_is_used_and_invalidated(tmp_path: Path) -> None:
    src = tmp_path / "hosts.ini"
    src.write_text("[lab]\npc01 ansible_host=10.99.30.1\n")
    first = ansible_core.resolve([src])
    again = ansible_core.resolve([src])
    assert (first["cached"], again["cached"]) == (False, True)
    gv = tmp_path / "group_vars"
    gv.mkdir()
    (gv / "lab.yml").write_text("ansible_user: changed\n")  # a new file beside it: read again
    third = ansible_core.resolve([src])
    assert third["cached"] is False and third["hosts"][0]["conn"]["user"] == "changed"
    (gv / "lab.yml").write_text("ansible_user: changed2\n")
    assert ansible_core.resolve([src])["hosts"][0]["conn"]["user"] == "changed2"
