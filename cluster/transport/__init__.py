"""How to talk to one node. `transport_for(host)` picks the transport the inventory asks for.

Takes in: one inventory `Host` (address, user, key, known_hosts, timeouts).
Gives out: bounded commands (`CommandResult`) and verified file copies on that node.
Must never import: nodes, relay, provision, runs, study, lab or cli (only inventory and the base).
"""
from __future__ import annotations

from cluster.inventory.model import Host
from cluster.transport.base import CommandResult, Transport


def transport_for(host: Host) -> Transport:
    if host.connection == "local":
        from cluster.transport.local import LocalTransport

        return LocalTransport(host)
    from cluster.transport.ssh import SSHTransport

    return SSHTransport(host)


__all__ = ["CommandResult", "Transport", "transport_for"]
