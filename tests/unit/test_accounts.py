"""The login user's numbers on every PC (`id -u; id -g; id -un`): Slurm runs a job under the submitter's uid on
every PC and munge's credentials carry numbers, so a PC where the same name has another uid or gid is named,
with the user, both numbers and the fix; clusterctl never changes an account."""
from __future__ import annotations

import subprocess

from cluster.inventory.model import Host
from cluster.nodes import facts, health
from cluster.nodes.facts import NodeFacts

PCS = [Host(name=f"pc{i}", address=f"10.0.0.{i}") for i in (1, 2, 3)]


def _facts(outputs: dict[str, str]) -> dict[str, NodeFacts]:
    return {n: NodeFacts(host=n, values={"account": facts.parse_account(out, 0)}) for n, out in outputs.items()}


def test_the_fact_reads_what_id_prints_here() -> None:
    out = subprocess.run(["sh", "-c", "id -u; id -g; id -un"], capture_output=True, text=True, check=True).stdout
    got = facts.parse_account(out, 0)
    assert got is not None and got["uid"] == int(out.split()[0]) and got["name"] == out.split()[2]
    assert facts.parse_account("id: cannot find name for user ID 1234\n", 1) is None


def test_a_pc_whose_user_has_another_uid_is_named_against_most_pcs() -> None:
    nf = _facts({"pc1": "1001\n1001\nalice\n", "pc2": "1002\n1001\nalice\n", "pc3": "1001\n1001\nalice\n"})
    found = health.accounts(PCS, nf, head=lambda name: None)
    assert [(p.host, p.code, p.blocking) for p in found] == [("pc2", "account-ids", False)]
    assert "user alice is uid 1002, gid 1001 here but 1001, 1001 on most PCs" in found[0].message
    assert "usermod -u 1001 alice" in found[0].fix and "never changes accounts" in found[0].fix


def test_the_heads_account_of_that_name_is_the_reference() -> None:
    nf = _facts({"pc1": "1001\n1001\nalice\n", "pc2": "1001\n1001\nalice\n", "pc3": "1001\n1001\nalice\n"})
    found = health.accounts(PCS, nf, head=lambda name: (2000, 2000) if name == "alice" else None)
    assert [p.host for p in found] == ["pc1", "pc2", "pc3"] and "on the head" in found[0].message
    assert health.accounts(PCS, nf, head=lambda name: (1001, 1001)) == []
