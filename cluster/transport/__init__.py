"""How to talk to one node. `transport_for(host)` picks the transport the inventory asks for."""
from __future__ import annotations

from cluster.inventory.loader import Host
from cluster.transport.base import CommandResult, Transport


def transport_for(host: Host) -> Transport:
    if host.connection == "local":
        from cluster.transport.local import LocalTransport

        return LocalTransport(host)
    from cluster.transport.ssh import SSHTransport

    return SSHTransport(host)


__all__ = ["CommandResult", "Transport", "transport_for"]
