"""What Slurm needs of a room and rooms get wrong, read from the PCs' facts: refused before anything changes,
each with its fix (a refusal names every PC it concerns, not the first one only). A firewall is not refused:
setting up needs root anyway, and provision opens exactly Slurm's ports for the room (cluster.room.plan)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.inventory.model import Host
from cluster.nodes.facts import NodeFacts
from cluster.nodes.health import accounts, firewalls

# munged refuses a credential older than its time-to-live (300 s by default) and one from a clock ahead of
# its own: PCs further apart than that cannot authenticate to each other.
MUNGE_TTL_S = 300.0


@dataclass(frozen=True)
class Refusal:
    pcs: tuple[str, ...]
    message: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return {"pcs": list(self.pcs), "message": self.message, "fix": self.fix}


def refusals(controller: Host, nodes: list[Host], facts: dict[str, NodeFacts]) -> list[Refusal]:
    """Every refusal of the room's facts: root, hostnames, clocks, firewalls."""
    found: list[Refusal] = []
    everyone = [controller, *nodes]
    rootless = [h.name for h in everyone if h.user != "root" and not h.become]
    if rootless:
        found.append(Refusal(tuple(rootless), "Slurm and munge are set up as root, and these PCs are reached as a "
                             "user without `become`", "set become: true (with NOPASSWD sudo on the PCs) in the "
                             "inventory, or log in as root"))
    nosudo = [h.name for h in everyone if h.become and facts[h.name].values.get("sudo") is False]
    if nosudo:
        found.append(Refusal(tuple(nosudo), "`sudo -n true` asks for a password (become needs NOPASSWD sudo)",
                             "add `USER ALL=(ALL) NOPASSWD: ALL` in /etc/sudoers.d/ on these PCs"))
    misnamed = [(h.name, (facts[h.name].values.get("hostname") or {}).get("name")) for h in nodes]
    misnamed = [(n, got) for n, got in misnamed if got != n]
    if misnamed:
        found.append(Refusal(tuple(n for n, _ in misnamed), "Slurm finds a node by its hostname, and these PCs' "
                             "hostnames are not their inventory names: " +
                             ", ".join(f"{n} is called {got!r}" for n, got in misnamed),
                             "rename the hosts in the inventory to their hostnames, or set each PC's "
                             "(`sudo hostnamectl set-hostname NAME` there)"))
    numbers = accounts(everyone, facts)
    if numbers:
        found.append(Refusal(tuple(p.host for p in numbers), "; ".join(f"{p.host}: {p.message}" for p in numbers),
                             numbers[0].fix))
    offsets: dict[str, float] = {}
    for h in everyone:
        off = facts[h.name].clock_offset_s
        if off is not None:
            offsets[h.name] = off
    if offsets and max(offsets.values()) - min(offsets.values()) > MUNGE_TTL_S:
        ahead, behind = max(offsets, key=lambda n: offsets[n]), min(offsets, key=lambda n: offsets[n])
        found.append(Refusal(tuple(sorted(offsets)), f"the PCs' clocks are {offsets[ahead] - offsets[behind]:.0f} s "
                             f"apart ({ahead} ahead, {behind} behind), more than munge's {MUNGE_TTL_S:.0f} s",
                             "set the clocks (systemd-timesyncd against one PC of the room, or `sudo date -s` "
                             "from the head's `date`) and run again"))
    return found


def warnings(controller: Host, nodes: list[Host], facts: dict[str, NodeFacts]) -> list[str]:
    """What may go wrong but is not sure to: a firewall that cannot be read (one that can is opened for
    Slurm's ports where it would stop them: cluster.room.plan)."""
    return [f"{p.host}: {p.message} (Slurm needs TCP 6817, 6818 and 60001-63000 open between the PCs)"
            for p in firewalls([controller, *nodes], facts) if p.code == "firewall-unreadable"]


def unconfined(nodes: list[Host], facts: dict[str, NodeFacts]) -> list[str]:
    """The compute PCs whose kernel offers no cgroup v2 (jobs there cannot be confined to their share)."""
    return [h.name for h in nodes if not (facts[h.name].values.get("cgroup") or {}).get("v2")]
