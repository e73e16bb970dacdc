"""Exit codes against a real simulated lab: a node lost in the middle of a provision is unreachable
(exit 3, "check the node, re-run"), not failed (exit 1, "fix the step"), because the fix differs."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cluster.provision import apply
from cluster.lab import lifecycle
from cluster.inventory import loader
from tests.integration.conftest import lab_up, pytestmark  # noqa: F401

# node2's second step kills the sshd serving its own connection (its nearest sshd ancestor: the command runs
# under the transport's node-side bound, so $PPID is `timeout`, not sshd) and, with `listener`, sshd's
# listener too (its parent): the node is gone mid-step, as when a PC is switched off or its link cut.
# Without the listener, only the connection drops while the node stays up (sshd restarted, a port flap).
PLAYBOOK = """\
name: losing
steps:
  - name: work directory
    command: mkdir -p -- {{ host.workdir }}
  - name: lose the connection
    when: host.name == 'node2'
    command: p=$$; while [ "$p" -gt 1 ] && ! grep -q '^sshd' /proc/$p/comm; do p=$(cut -d' ' -f4 /proc/$p/stat); done; kill -9 KILL $p; sleep 5
  - name: after
    command: touch -- {{ host.workdir }}/after
"""
LISTENER = "$(ps -o ppid= -p $p)"


@pytest.fixture(scope="module")
def lab2(tmp_path_factory: pytest.TempPathFactory):
    with lab_up(tmp_path_factory, "e", 2, 7) as (state, d):
        yield state, d


def provision_losing_node2(state: lifecycle.LabState, d: Path, kill: str) -> apply.ProvisionReport:
    pb = d / "losing.yaml"
    pb.write_text(PLAYBOOK.replace("KILL", kill))
    inv = loader.load(state.inventory, overrides=[f"python={sys.executable}", "vars.python_env=existing"])
    return apply.run(inv, list(inv.hosts.values()), pb_path=str(pb))


def check_outcome(report: apply.ProvisionReport, state: lifecycle.LabState) -> None:
    n1, n2 = report.nodes["node1"], report.nodes["node2"]
    assert n2.status == "unreachable", n2.to_dict()
    assert "connection lost during the playbook" in (n2.error or "") and "re-run provision" in (n2.fix or "")
    assert [s.name for s in n2.steps] == ["work directory", "lose the connection"]
    # the other node is not held back: every step done (its verification then fails for want of the
    # environment check, which this playbook does not install; that is a failure, not a lost node)
    assert [(s.name, s.status) for s in n1.steps] == [("work directory", "changed"), ("lose the connection", "skipped"),
                                                      ("after", "changed")]
    assert n1.status == "failed" and "verification" in (n1.error or "")


def test_a_command_killed_by_a_signal_is_a_failed_command_not_a_lost_node(lab2) -> None:
    """sshd reports a signal death without an exit status, on a connection that stays up: that is the
    command's failure (exit -1), not an unreachable node."""
    from cluster.transport.ssh import SSHTransport

    state, _ = lab2
    host = loader.load(Path(state.inventory)).hosts["node1"]
    with SSHTransport(host) as t:
        r = t.run("kill -9 $$", timeout=30)
        assert r.exit_code == -1 and not r.ok
        assert t.run("echo still here", timeout=30).stdout.strip() == "still here"


def test_connection_dropped_during_a_step_is_unreachable_not_failed(lab2, monkeypatch: pytest.MonkeyPatch) -> None:
    state, d = lab2
    monkeypatch.setenv("CLUSTERCTL_HOME", str(d / "home"))
    check_outcome(provision_losing_node2(state, d, ""), state)


def test_node_lost_during_a_step_is_unreachable_not_failed(lab2, monkeypatch: pytest.MonkeyPatch) -> None:
    state, d = lab2  # runs last: node2 has no sshd afterwards
    monkeypatch.setenv("CLUSTERCTL_HOME", str(d / "home"))
    check_outcome(provision_losing_node2(state, d, LISTENER), state)
