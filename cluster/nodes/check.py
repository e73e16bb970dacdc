"""`clusterctl check`: reach every node, gather its facts, list what would stop a job."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from cluster.nodes import facts, health
from cluster.nodes.fanout import Group, GroupResult, HostResult
from cluster.inventory.model import Host


@dataclass
class CheckReport:
    hosts: list[Host]
    results: GroupResult
    problems: list[health.Problem]

    @property
    def facts(self) -> dict[str, facts.NodeFacts]:
        return {n: r.value for n, r in self.results.items() if r.ok}

    @property
    def blocking(self) -> list[health.Problem]:
        return [p for p in self.problems if p.blocking]

    @property
    def healthy(self) -> list[str]:
        bad = {p.host for p in self.blocking}
        return [h.name for h in self.hosts if h.name not in bad]

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [
                {"host": h.name, "address": h.address, "status": self.results[h.name].status,
                 "healthy": h.name in self.healthy,
                 "facts": self.results[h.name].value.to_dict() if self.results[h.name].ok else None}
                for h in self.hosts
            ],
            "problems": [p.to_dict() for p in self.problems],
            "healthy": len(self.healthy),
            "total": len(self.hosts),
        }


def run(group: Group, on_done: Callable[[HostResult], None] | None = None) -> CheckReport:
    results = facts.gather(group, on_done=on_done)
    problems: list[health.Problem] = []
    for h in group.hosts:
        r = results[h.name]
        problems += health.from_facts(h, r.value) if r.ok else health.from_result(r)
    answered = {n: r.value for n, r in results.items() if r.ok}
    problems += health.shared_workdirs(group.hosts, answered) + health.firewalls(group.hosts, answered)
    problems += health.accounts(group.hosts, answered)
    return CheckReport(group.hosts, results, problems)
