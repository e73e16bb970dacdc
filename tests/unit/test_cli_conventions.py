"""Command-line conventions: --limit and --forks reach the selection on every node command, `-o json`,
$CLUSTERCTL_INVENTORY, shell completion, and the line `provision`/`lab up` print when the context changes.

No node is contacted: the first call that would reach one is replaced by a recording that stops the command.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cluster import cli, errors
from cluster.cli import main
from cluster.inventory import context
from tests.conftest import write

INVENTORY = """\
hosts:
  a: {address: 10.0.0.1}
  b: {address: 10.0.0.2}
  c: {address: 10.0.0.3}
groups:
  g: {hosts: [a, b]}
"""


class Stop(errors.ClusterError):
    """Raised where a node would be contacted: the command ends with exit 1, the recording kept."""


@pytest.fixture
def inv(tmp_path: Path) -> Path:
    return write(tmp_path, INVENTORY)


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Group(hosts, forks=...) anywhere records the hosts and forks, then stops the command."""
    from cluster.nodes import fanout
    from cluster.runs import launch
    from cluster.planner import bench

    got: dict[str, Any] = {}

    class Recording:
        def __init__(self, hosts: Any, forks: int = fanout.DEFAULT_FORKS, **kw: Any) -> None:
            got["hosts"], got["forks"] = [h.name for h in hosts], forks
            raise Stop("stopped by the test before any node")

    for module in (fanout, launch, bench):
        monkeypatch.setattr(module, "Group", Recording)
    return got


@pytest.mark.parametrize("argv", [["check"], ["exec", "--", "true"]], ids=["check", "exec"])
def test_node_commands_pass_limit_and_forks(inv: Path, seen: dict[str, Any], argv: list[str]) -> None:
    cmd, rest = argv[0], argv[1:]
    assert main([cmd, str(inv), "--limit", "all:!g[0]", "--forks", "3", *rest]) == errors.EXIT_FAILED
    assert seen == {"hosts": ["b", "c"], "forks": 3}
    assert main([cmd, "-i", str(inv), *rest]) == errors.EXIT_FAILED
    assert seen == {"hosts": ["a", "b", "c"], "forks": 32}  # the default


def test_trust_passes_limit_and_forks(inv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.transport import firstcontact

    got: dict[str, Any] = {}

    def survey(hosts: Any, forks: int = 32) -> Any:
        got.update(hosts=[h.name for h in hosts], forks=forks)
        raise Stop("stopped")

    monkeypatch.setattr(firstcontact, "survey", survey)
    assert main(["trust", str(inv), "--limit", "g:&~[bc]", "--forks", "2", "--yes"]) == errors.EXIT_FAILED
    assert got == {"hosts": ["b"], "forks": 2}


def test_provision_passes_limit_and_forks(inv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.provision import apply

    got: dict[str, Any] = {}

    def prepare(inventory: Any, hosts: Any, forks: int = 32, **kw: Any) -> Any:
        got.update(hosts=[h.name for h in hosts], forks=forks)
        raise Stop("stopped")

    monkeypatch.setattr(apply, "prepare", prepare)
    assert main(["provision", str(inv), "--limit", "c,a", "--forks", "5", "--dry-run"]) == errors.EXIT_FAILED
    assert got == {"hosts": ["a", "c"], "forks": 5}


def test_launch_passes_limit_and_forks(inv: Path, seen: dict[str, Any]) -> None:
    assert main(["launch", "resnet50-ddp", "-i", str(inv), "--limit", "!a", "--forks", "4",
                 "--dry-run"]) == errors.EXIT_FAILED
    assert seen == {"hosts": ["b", "c"], "forks": 4}


def test_bench_passes_limit_and_forks(inv: Path, seen: dict[str, Any]) -> None:
    assert main(["bench", "-i", str(inv), "--limit", "g", "--forks", "7", "--jobs", "resnet50-ddp"]) \
        == errors.EXIT_FAILED
    assert seen == {"hosts": ["a", "b"], "forks": 7}
    assert main(["bench", "-i", str(inv), "--limit", "g[5]"]) == errors.EXIT_USAGE  # refused before anything runs


def test_plan_passes_limit_to_the_candidates(inv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.runs import preflight
    from cluster.planner import plans

    got: dict[str, Any] = {}
    real = preflight.select_hosts

    def select_hosts(inventory: Any, spec: Any, limit: str | None) -> Any:
        got["hosts"] = [h.name for h in real(inventory, spec, limit)]
        raise Stop("stopped")

    monkeypatch.setattr(plans, "_job_bench", lambda inventory, spec, job: (None, None))
    monkeypatch.setattr(preflight, "select_hosts", select_hosts)
    assert main(["plan", "resnet50-ddp", "-i", str(inv), "--limit", "~[ac]$"]) == errors.EXIT_FAILED
    assert got == {"hosts": ["a", "c"]}


def test_study_passes_limit_and_forks(inv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.runs import launch

    got: list[tuple[str | None, int]] = []

    def fake_prepare(inventory: Any, spec: Any, limit: str | None = None, forks: int = 32, **kw: Any) -> Any:
        got.append((limit, forks))
        raise Stop("stopped")

    monkeypatch.setattr(launch, "prepare", fake_prepare)  # the room's scheduler prepares each cell's request
    assert main(["study", "resnet50-ddp", "-i", str(inv), "--nodes", "1,2", "--limit", "all:!a",
                 "--forks", "6", "--json"]) == errors.EXIT_FAILED
    assert got == [("b", 6), ("b,c", 6)]  # the first N of the nodes the pattern selects
    assert main(["study", "resnet50-ddp", "-i", str(inv), "--nodes", "3", "--limit", "all:!a"]) == errors.EXIT_USAGE


@pytest.mark.parametrize("cmd", ["hosts", "completion"])
def test_the_new_commands_have_help(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([cmd, "--help"]) == 0
    assert f"usage: clusterctl {cmd}" in capsys.readouterr().out


# --------------------------------------------------------------------------- -o json


def _minimal(name: str) -> list[list[str]]:
    if name == "lab":
        return [["lab", "up", "1"], ["lab", "down"], ["lab", "status"]]
    return [[name, "x"] if name in ("launch", "plan", "study") else [name]]


@pytest.mark.parametrize("name", [n for n in cli.COMMANDS if n != "completion"])
def test_dash_o_json_is_json_wherever_there_is_json(name: str) -> None:
    parser = cli.build_parser(name)
    for argv in _minimal(name):
        try:
            plain = parser.parse_args(argv)
        except SystemExit:
            pytest.skip(f"{name} needs arguments this test does not know")
        if not hasattr(plain, "json"):
            continue  # no --json here (a command group whose subcommands declare their own)
        assert plain.json is False
        assert parser.parse_args([*argv, "-o", "json"]).json is True
        assert parser.parse_args([*argv, "--json"]).json is True
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([*argv, "-o", "yaml"])
        assert exc.value.code == errors.EXIT_USAGE


def test_dash_o_json_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["context", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"inventory": None}


# --------------------------------------------------------------------------- CLUSTERCTL_INVENTORY


def test_inventory_precedence_given_env_context_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved, env, given = (write(tmp_path, INVENTORY, n) for n in ("saved.yaml", "env.yaml", "given.yaml"))
    monkeypatch.delenv(context.ENV, raising=False)
    assert context.resolve(None)[1].startswith("embedded default")
    context.set_current(saved)
    assert context.resolve(None) == (saved.resolve(), "current context")
    monkeypatch.setenv(context.ENV, str(env))
    assert context.resolve(None) == (env, context.ENV)
    assert context.resolve(str(given)) == (given, "given")
    monkeypatch.setenv(context.ENV, str(tmp_path / "gone.yaml"))
    with pytest.raises(errors.UsageError, match="CLUSTERCTL_INVENTORY=.*no such inventory"):
        context.resolve(None)


def test_the_environment_variable_reaches_the_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    env = write(tmp_path, INVENTORY, "env.yaml")
    monkeypatch.setenv(context.ENV, str(env))
    assert main(["hosts", "g", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["inventory"] == str(env) and "(CLUSTERCTL_INVENTORY)" in captured.err
    assert main(["context"]) == 0
    assert "CLUSTERCTL_INVENTORY=" in capsys.readouterr().out


# --------------------------------------------------------------------------- completion


def _script(shell: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["completion", shell]) == 0
    return capsys.readouterr().out


def test_bash_completion_defines_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "clusterctl.bash"
    script.write_text(_script("bash", capsys))
    r = subprocess.run(["bash", "-c", f"source {script} && complete -p clusterctl"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "clusterctl" in r.stdout and "-F" in r.stdout
    text = script.read_text()
    assert "hosts" in text and "completion" in text and "--limit" in text and "-o" in text


def test_zsh_completion_is_generated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = _script("zsh", capsys)
    assert text.startswith("#compdef clusterctl") and "--limit" in text and "hosts" in text
    if shutil.which("zsh"):
        script = tmp_path / "_clusterctl"
        script.write_text(text)
        r = subprocess.run(["zsh", "-n", str(script)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr


def test_completion_without_a_shell_uses_dollar_shell(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SHELL", "/usr/bin/zsh")
    assert main(["completion"]) == 0 and capsys.readouterr().out.startswith("#compdef")
    monkeypatch.setenv("SHELL", "/usr/bin/fish")
    assert main(["completion"]) == errors.EXIT_USAGE
    assert "clusterctl completion bash" in capsys.readouterr().err


# --------------------------------------------------------------------------- the context line


def test_provision_says_when_it_changes_the_current_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.provision import apply

    report = SimpleNamespace(nodes={"a": SimpleNamespace(status="ok")}, ok=True, to_dict=lambda: {})
    monkeypatch.setattr(apply, "prepare", lambda *a, **k: None)
    monkeypatch.setattr(apply, "execute", lambda *a, **k: report)
    monkeypatch.delenv(context.ENV, raising=False)
    first, second = write(tmp_path, INVENTORY, "first.yaml"), write(tmp_path, INVENTORY, "second.yaml")
    assert main(["provision", str(first), "--json"]) == 0
    said = capsys.readouterr().err
    assert f"current context is now {first.resolve()}" in said and "switch back: clusterctl context --clear" in said
    assert main(["provision", str(first), "--json"]) == 0
    assert "current context" not in capsys.readouterr().err  # unchanged: nothing said
    assert main(["provision", str(second), "--json"]) == 0
    said = capsys.readouterr().err
    assert f"now {second.resolve()} (was {first.resolve()}; switch back: clusterctl context {first.resolve()})" in said
    assert main(["context", "--clear"]) == 0 and context.current() is None


def test_lab_up_says_when_it_changes_the_current_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.lab import lifecycle

    lab_inv = write(tmp_path, INVENTORY, "lab.yaml")
    state = SimpleNamespace(name="lab", inventory=str(lab_inv), subnet="10.77.0.0/24", nodes=[], slurm=None,
                            users={})
    monkeypatch.setattr(lifecycle, "up", lambda *a, **k: state)
    monkeypatch.setenv(context.ENV, str(lab_inv))
    assert main(["lab", "up", "1", "--json"]) == 0
    said = capsys.readouterr().err
    assert f"current context is now {lab_inv.resolve()}" in said and "switch back" in said
    assert "CLUSTERCTL_INVENTORY=" in said  # the variable still wins in this shell: said too
    assert os.environ[context.ENV] == str(lab_inv)
