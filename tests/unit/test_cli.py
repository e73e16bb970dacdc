"""The CLI as a user meets it: help, exit codes, JSON, the local inventory (no SSH, no root)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, write

COMMANDS = [["lab"], ["lab", "up"], ["lab", "down"], ["lab", "status"], ["trust"], ["check"], ["exec"], ["context"]]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster", *args], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ.copy(), timeout=120)


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_every_command_has_help(cmd: list[str]) -> None:
    r = run(*cmd, "--help")
    assert r.returncode == 0 and "usage: clusterctl" in r.stdout


def local_inventory(tmp_path: Path) -> Path:
    return write(tmp_path, f"""\
defaults: {{connection: local}}
hosts:
  a: {{address: 127.0.0.1, workdir: {tmp_path / 'a'}}}
  b: {{address: 127.0.0.1, workdir: {tmp_path / 'b'}}}
""")


def test_exec_on_local_nodes_json_and_exit_codes(tmp_path: Path) -> None:
    inv = local_inventory(tmp_path)
    r = run("exec", str(inv), "--json", "--", "echo", "$((6*7))")
    assert r.returncode == 0
    data = json.loads(r.stdout)
    assert data["command"] == "echo $((6*7))"
    assert [(n["host"], n["stdout"]) for n in data["nodes"]] == [("a", "42\n"), ("b", "42\n")]
    r = run("exec", "-i", str(inv), "--", "exit 5")
    assert r.returncode == 1 and "0 ok, 2 failed, 0 unreachable" in r.stdout
    r = run("exec", str(inv))
    assert r.returncode == 2 and "put it after --" in r.stderr


def test_check_local_nodes(tmp_path: Path) -> None:
    r = run("check", str(local_inventory(tmp_path)), "--json")
    data = json.loads(r.stdout)
    assert [n["status"] for n in data["nodes"]] == ["ok", "ok"]
    assert data["nodes"][0]["facts"]["python"] is not None
    # the project machine's hostname resolves to 127.0.0.1: a warning, not a blocker
    assert r.returncode == (1 if any(p["blocking"] for p in data["problems"]) else 0)


def test_bad_inventory_exits_2_naming_file_line_field(tmp_path: Path) -> None:
    inv = write(tmp_path, "hosts:\n  pc1:\n    address: 10.0.0.1\n    prot: 22\n")
    r = run("check", str(inv))
    assert r.returncode == 2
    assert f"{inv}:4: hosts.pc1.prot: unknown key" in r.stderr and "did you mean 'port'" in r.stderr
    assert r.stdout == ""


def test_context_and_defaults(tmp_path: Path) -> None:
    r = run("context", "--json")
    assert json.loads(r.stdout) == {"inventory": None}
    # no inventory, no context: the embedded local default, said on stderr
    r = run("exec", "--json", "--", "true")
    assert r.returncode == 0 and "embedded default" in r.stderr
    assert [n["host"] for n in json.loads(r.stdout)["nodes"]] == ["local1", "local2"]
    inv = local_inventory(tmp_path)
    assert run("context", str(inv)).returncode == 0
    r = run("exec", "--json", "--", "true")
    assert [n["host"] for n in json.loads(r.stdout)["nodes"]] == ["a", "b"] and "current context" in r.stderr


def test_dash_dash_only_for_exec() -> None:
    r = run("check", "--", "ls")
    assert r.returncode == 2 and "only go with `clusterctl exec`" in r.stderr
