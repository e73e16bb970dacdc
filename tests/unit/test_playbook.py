"""The playbook engine on local nodes: idempotence, guards, quoting, errors that point at the line."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.provision import playbook
from cluster.inventory.model import Host
from cluster.provision.playbook import CHANGED, FAILED, SKIPPED, UNCHANGED, WOULD_CHANGE, PlaybookError
from cluster.transport.local import LocalTransport
from tests.conftest import write

PB = """\
name: t
vars:
  marker: "{{ host.workdir }}/made"
  greeting: hello {{ host.name }}
steps:
  - name: make a file once
    command: echo made > {{ marker }}
    creates: "{{ marker }}"
  - name: write a config
    file: {dest: "{{ host.workdir }}/conf.txt", content: "{{ greeting }} {{ vars.colour }}\\n", mode: "600"}
  - name: render a template
    template: {src: node.env.j2, dest: "{{ host.workdir }}/cluster.env"}
  - name: only on gpu nodes
    when: net.gpus > 0
    command: "false"
  - name: guarded by a check
    unless: test -e {{ marker }}
    command: "false"
"""


def ctx(host: Host, **extra: Any) -> dict[str, Any]:
    return {"host": host.to_dict(), "vars": {"colour": "blue"}, "env_python": "/usr/bin/python3",
            "net": {"iface": "eth0", "gpus": 0, "hostname_on_loopback": True},
            "build": {"backend": "gloo", "amp": False}, **extra}


def node(tmp_path: Path, name: str = "n1") -> LocalTransport:
    t = LocalTransport(Host(name=name, address="127.0.0.1", connection="local", workdir=str(tmp_path / name)))
    t.connect()  # as the fan-out does before the first command: creates the workdir
    return t


def test_first_run_changes_second_run_changes_nothing(tmp_path: Path) -> None:
    pb = playbook.load(write(tmp_path, PB, "pb.yaml"))
    t = node(tmp_path)
    first = playbook.run(t, pb, ctx(t.host))
    assert [s.status for s in first.steps] == [CHANGED, CHANGED, CHANGED, SKIPPED, UNCHANGED]
    assert (tmp_path / "n1" / "conf.txt").read_text() == "hello n1 blue\n"
    assert oct((tmp_path / "n1" / "conf.txt").stat().st_mode & 0o777) == "0o600"
    env = (tmp_path / "n1" / "cluster.env").read_text()
    assert "GLOO_SOCKET_IFNAME=eth0" in env and "NCCL_SOCKET_IFNAME==eth0" in env
    assert "CLUSTER_HOSTNAME_ON_LOOPBACK=1" in env and "NCCL_P2P_DISABLE" not in env
    second = playbook.run(t, pb, ctx(t.host))
    assert [s.status for s in second.steps] == [UNCHANGED, UNCHANGED, UNCHANGED, SKIPPED, UNCHANGED]
    # a changed input changes exactly the step that uses it
    third = playbook.run(t, pb, {**ctx(t.host), "vars": {"colour": "red"}})
    assert [s.status for s in third.steps] == [UNCHANGED, CHANGED, UNCHANGED, SKIPPED, UNCHANGED]


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    pb = playbook.load(write(tmp_path, PB, "pb.yaml"))
    t = node(tmp_path)
    r = playbook.run(t, pb, ctx(t.host), dry=True)
    assert [s.status for s in r.steps][:3] == [WOULD_CHANGE, WOULD_CHANGE, WOULD_CHANGE]
    assert sorted(p.name for p in (tmp_path / "n1").iterdir()) == []


def test_a_failed_step_stops_that_node(tmp_path: Path) -> None:
    pb = playbook.load(write(tmp_path, "steps:\n  - name: boom\n    command: echo no >&2; exit 4\n"
                                       "  - name: after\n    command: 'true'\n", "pb.yaml"))
    t = node(tmp_path)
    r = playbook.run(t, pb, ctx(t.host))
    assert [s.status for s in r.steps] == [FAILED] and r.failed is not None and "exit 4: no" in r.failed.detail


def test_values_are_shell_quoted_in_commands(tmp_path: Path) -> None:
    pb = playbook.load(write(tmp_path, "steps:\n  - name: echo\n    command: echo {{ vars.evil }} > {{ host.workdir }}/out\n", "pb.yaml"))
    t = node(tmp_path)
    evil = "x'; touch /tmp/clusterctl-pwned-$$; echo \"$(id)\" `id` 'y"
    r = playbook.run(t, pb, {**ctx(t.host), "vars": {"evil": evil}})
    assert r.steps[0].status == CHANGED
    assert (tmp_path / "n1" / "out").read_text() == evil + "\n"
    assert not list(Path("/tmp").glob("clusterctl-pwned-*"))


def test_undefined_value_names_file_line_and_step(tmp_path: Path) -> None:
    p = write(tmp_path, "steps:\n  - name: ok\n    command: 'true'\n  - name: typo\n    command: echo {{ host.wrokdir }}\n", "pb.yaml")
    t = node(tmp_path)
    with pytest.raises(PlaybookError) as e:
        playbook.run(t, playbook.load(p), ctx(t.host))
    assert f"{p}:4: step 'typo'" in str(e.value) and "wrokdir" in str(e.value)


@pytest.mark.parametrize("text, words", [
    ("steps:\n  - command: 'true'\n", "every step needs a `name:`"),
    ("steps:\n  - name: a\n    command: x\n    file: {dest: y}\n", "needs exactly one action, found command, file"),
    ("steps:\n  - name: a\n    comand: x\n", "unknown key 'comand'"),
    ("name: x\n", "a mapping with a `steps:` list"),
])
def test_schema_errors(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(PlaybookError, match=words.replace("(", r"\(").replace("`", "`")):
        playbook.load(write(tmp_path, text, "pb.yaml"))


def test_default_playbook_loads() -> None:
    pb = playbook.load("provision")
    assert [s.action for s in pb.steps] == ["command", "command", "command", "wheels", "file", "template", "command",
                                            "pip", "template", "file", "file"]


def test_cluster_env_keeps_a_hostile_host_name_inside_its_comment(tmp_path: Path) -> None:
    """The host name is written in a comment of cluster.env, which every launch script sources: a newline
    in it must not start a command."""
    canary = tmp_path / "pwned"
    t = LocalTransport(Host(name=f"pc1\ntouch {canary}\n#", address="127.0.0.1", connection="local",
                            workdir=str(tmp_path / "n1")))
    t.connect()
    pb = playbook.load(write(tmp_path, "steps:\n  - name: env\n    template: {src: node.env.j2, dest: "
                                       "\"{{ host.workdir }}/cluster.env\"}\n", "pb.yaml"))
    assert playbook.run(t, pb, ctx(t.host)).steps[0].status == CHANGED
    import subprocess

    r = subprocess.run(["sh", "-c", ". ./cluster.env && echo $GLOO_SOCKET_IFNAME"], cwd=tmp_path / "n1",
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "eth0"
    assert not canary.exists(), "a host name in cluster.env was executed"
