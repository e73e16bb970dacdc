"""The login user's numbers and every person's account on every PC (facts.ACCOUNTS): Slurm runs a job under the submitter's uid on
every PC and munge's credentials carry numbers, so a PC where the same name has another uid or gid is named,
with the user, both numbers and the fix; clusterctl never changes an account."""
from __future__ import annotations

import pwd
import subprocess

from cluster.inventory.model import Host
from cluster.nodes import facts, health
from cluster.nodes.facts import NodeFacts

PCS = [Host(name=f"pc{i}", address=f"10.0.0.{i}") for i in (1, 2, 3)]


def _facts(outputs: dict[str, str]) -> dict[str, NodeFacts]:
    return {n: NodeFacts(host=n, values={"account": facts.parse_account(out, 0)}) for n, out in outputs.items()}


def test_the_fact_reads_what_id_prints_here() -> None:
    out = subprocess.run(["sh", "-c", facts.ACCOUNTS], capture_output=True, text=True, check=True).stdout
    got = facts.parse_account(out, 0)
    assert got is not None and got["uid"] == int(out.split()[0]) and got["name"] == out.split()[2]
    people = {p.pw_name: [p.pw_uid, p.pw_gid] for p in pwd.getpwall() if 1000 <= p.pw_uid < 60000}
    assert got["users"] == people  # nobody (65534) and the system's accounts are not people
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


PASSWD = ("root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
          "alice:x:1001:1001::/home/alice:/bin/bash\nbob:x:{bob}:1002::/home/bob:/bin/bash\n")


def test_a_students_uid_that_differs_on_one_pc_is_named_though_the_login_user_is_another() -> None:
    nf = _facts({pc: "0\n0\nroot\n" + PASSWD.format(bob=1009 if pc == "pc2" else 1002) for pc in ("pc1", "pc2", "pc3")})
    found = health.accounts(PCS, nf, head=lambda name: {"bob": (1002, 1002)}.get(name))
    assert [(p.host, p.message.split(" here")[0]) for p in found] == [("pc2", "user bob is uid 1009, gid 1002")]
    assert "usermod -u 1002 bob" in found[0].fix
