"""First contact (`clusterctl trust`): the key each node, and each jump host on the way to it, offers.

A node behind jump hosts is scanned through them (route.py), which needs their keys trusted first: its
offer is `blocked` until they are, and `trust` asks again after recording them, hop by hop. Nothing is
recorded here (hostkeys.record does, after the user compared the fingerprints).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import paramiko

from cluster.errors import HostKeyError, TransportError
from cluster.inventory import hostkeys
from cluster.inventory.model import Host
from cluster.transport.route import open_route


@dataclass(frozen=True)
class Offer:
    """What one node (or jump host) offered at first contact, compared with known_hosts."""

    host: Host
    status: str  # new | known | changed | revoked | unreachable | blocked | local
    key: paramiko.PKey | None = None
    message: str | None = None
    jump: bool = False  # a jump host on the way to nodes, not a node

    @property
    def fingerprint(self) -> str | None:
        return hostkeys.fingerprint(self.key) if self.key is not None else None

    def to_dict(self) -> dict[str, str | bool | None]:
        return {"host": self.host.name, "address": self.host.host_key_name, "status": self.status,
                "key_type": self.key.get_name() if self.key else None, "fingerprint": self.fingerprint,
                "known_hosts": str(self.host.known_hosts_path), "message": self.message, "jump": self.jump}


def scan(host: Host) -> paramiko.PKey:
    """The key `host` offers, fetched without authenticating, through its jump hosts (which must be trusted)."""
    route = open_route(host)
    t = paramiko.Transport(route.sock)
    try:
        preferred = [k.get_name() for k in (hostkeys.known_hosts(host.known_hosts_path).lookup(host.host_key_name)
                                            or {}).values()]
        if preferred:
            opts = t.get_security_options()
            opts.key_types = preferred + [k for k in opts.key_types if k not in preferred]
        t.banner_timeout = host.connect_timeout
        t.start_client(timeout=host.connect_timeout)
        return t.get_remote_server_key()
    except (paramiko.SSHException, OSError, EOFError) as e:
        raise TransportError(f"{host.name}: SSH handshake with {host.address}:{host.port} failed: {e}",
                             "is sshd running on that port?", "unreachable") from None
    finally:
        t.close()
        route.close()


def _targets(hosts: list[Host]) -> list[tuple[Host, bool]]:
    """Every distinct jump host (as reached: through the hops before it), then every node."""
    seen: dict[tuple[str, int, str, str], Host] = {}
    for h in hosts:
        for i, j in enumerate(h.jumps):
            seen.setdefault((j.address, j.port, j.host_key_name, str(j.known_hosts_path)), replace(j, jumps=h.jumps[:i]))
    return [(j, True) for j in seen.values()] + [(h, False) for h in hosts]


def _offer(host: Host, jump: bool) -> Offer:
    if host.connection != "ssh":
        return Offer(host, "local")
    try:
        key = scan(host)
    except HostKeyError as e:  # a jump host on the way is not trusted (yet), or its key changed
        status = "blocked" if e.problem == "hostkey-unknown" else "unreachable"
        return Offer(host, status, message=str(e), jump=jump)
    except TransportError as e:
        return Offer(host, "unreachable", message=str(e), jump=jump)
    try:
        return Offer(host, "known" if hostkeys.check_key(host, key) == "known" else "new", key, jump=jump)
    except HostKeyError as e:  # refused either way; the status says which fix applies
        return Offer(host, "revoked" if e.problem == "hostkey-revoked" else "changed", key, message=str(e),
                     jump=jump)


def survey(hosts: list[Host], forks: int = 32) -> list[Offer]:
    """Scan every jump host and node at once; nothing is recorded here. Jump hosts come first."""
    targets = _targets(hosts)
    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(targets)))) as pool:
        return list(pool.map(lambda t: _offer(*t), targets))
