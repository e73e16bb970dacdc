"""What `clusterctl provision` did, node by node: outcomes as data (a node that fails never stops the others).

Shared by the stages of provision (cluster/provision/apply.py: facts, builds, playbook) and of the
verification (cluster/provision/verify.py): each records a node's outcome the same way, and a node lost in the
middle of a stage is unreachable (exit 3), not failed (exit 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from cluster.provision import compat, playbook
from cluster.nodes.fanout import Group, GroupResult
from cluster.inventory.model import Host

LOST_FIX = ("check that the node is up and on the network (`clusterctl check`), then re-run provision: "
            "it repeats only what is not done")


@dataclass
class NodeOutcome:
    host: str
    status: str = "pending"  # ok | failed | unreachable | refused
    error: str | None = None
    fix: str | None = None
    steps: list[playbook.StepResult] = field(default_factory=list)
    build: compat.NodeBuild | None = None
    fingerprint: dict[str, Any] | None = None
    allreduce: dict[str, Any] | None = None
    duration: float = 0.0

    def fail(self, status: str, error: str, fix: str | None = None) -> None:
        self.status, self.error, self.fix = status, error, fix

    @property
    def changed(self) -> int:
        return sum(s.status in (playbook.CHANGED, playbook.WOULD_CHANGE) for s in self.steps)

    @property
    def unchanged(self) -> int:
        return sum(s.status in (playbook.UNCHANGED, playbook.SKIPPED) for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "status": self.status, "error": self.error, "fix": self.fix,
                "changed": self.changed, "unchanged": self.unchanged, "duration": round(self.duration, 2),
                "steps": [s.to_dict() for s in self.steps],
                "build": self.build.to_dict() if self.build else None,
                "fingerprint": self.fingerprint, "allreduce": self.allreduce}


@dataclass
class ProvisionReport:
    inventory: str
    dry_run: bool
    choice: compat.BuildChoice | None  # shown as "builds" in --json
    nodes: dict[str, NodeOutcome]
    fingerprint_diff: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    distribution: dict[str, Any] | None = None  # the wheels' relay routes: who receives from whom

    @property
    def ok(self) -> bool:
        return all(n.status == "ok" for n in self.nodes.values())

    @property
    def nothing_to_do(self) -> bool:
        return self.ok and not any(n.changed for n in self.nodes.values())

    def to_dict(self) -> dict[str, Any]:
        return {"inventory": self.inventory, "dry_run": self.dry_run, "ok": self.ok,
                "nothing_to_do": self.nothing_to_do, "builds": self.choice.to_dict() if self.choice else None,
                "nodes": [n.to_dict() for n in self.nodes.values()],
                "fingerprint_diff": self.fingerprint_diff, "notes": self.notes, "distribution": self.distribution}


def lost(group: Group, names: Iterable[str]) -> set[str]:
    """Which of these nodes the head can no longer reach: a step or check that failed because the node
    went away (sshd killed, link down, reboot) makes the node unreachable (exit 3), not failed (exit 1)."""
    wanted = set(names)
    hosts = [h for h in group.hosts if h.name in wanted]
    if not hosts:
        return set()
    probe = group.call(lambda t: t.run("true", timeout=2 * t.host.connect_timeout), hosts)
    return {n for n, r in probe.items() if r.status == "unreachable"}


def settle(group: Group, hosts: list[Host], results: GroupResult, out: dict[str, NodeOutcome], stage: str) -> None:
    """Record each node's outcome of one fan-out stage: lost nodes unreachable, errors failed.
    A node still `pending` after its function raised must not end up `ok`."""
    bad = [h.name for h in hosts if not results[h.name].ok or out[h.name].status == "failed"]
    gone = lost(group, bad)
    for h in hosts:
        o, r = out[h.name], results[h.name]
        failed_step = next((st for st in o.steps if st.status == playbook.FAILED), None)
        if r.status == "unreachable" or h.name in gone or (failed_step is not None and failed_step.unreachable):
            detail = o.error or r.error or "no answer"
            o.fail("unreachable", f"connection lost during {stage}: {detail}", LOST_FIX)
        elif not r.ok and o.status in ("pending", "ok"):
            o.fail("failed", f"{stage}: {r.error or r.status}", r.fix)
