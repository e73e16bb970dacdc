"""The byte stream to a node's sshd: a TCP connection, a ProxyCommand's pipes, or a channel through its jump
hosts (ProxyJump), each hop an SSH connection of its own whose host key is checked like any node's.

A hop is reached through the one before it (a `direct-tcpip` channel, as `ssh -J` does); the first through
TCP or its own ProxyCommand. Every wait is bounded by the host's connect_timeout: the TCP connect, each
hop's handshake and authentication, and each channel open. The Route keeps the hops' connections and
closes them with the node's connection.
"""
from __future__ import annotations

import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko

from cluster.errors import TransportError
from cluster.inventory import hostkeys
from cluster.inventory.model import Host
from cluster.inventory.sshconfig import expand_proxy_command


_keys: dict[Path, paramiko.PKey] = {}
_keys_lock = threading.Lock()


def load_key(path: Path) -> paramiko.PKey:
    """Parse each identity file once per process, not once per node."""
    with _keys_lock:
        if path not in _keys:
            try:
                _keys[path] = paramiko.PKey.from_path(path)
            except paramiko.PasswordRequiredException:
                raise TransportError(f"identity file {path} is protected by a passphrase",
                                     "load it into ssh-agent (`ssh-add`) and leave identity_file unset",
                                     "auth") from None
            except (OSError, paramiko.SSHException, ValueError) as e:
                raise TransportError(f"cannot load identity file {path}: {e}",
                                     "point identity_file at an OpenSSH private key", "auth") from None
        return _keys[path]



def key_for(host: Host) -> paramiko.PKey | None:
    return load_key(host.key_path) if host.key_path else None


def connect_error(h: Host, e: BaseException, elapsed: float) -> BaseException:
    """paramiko's and the socket layer's failures, as errors that say what to do."""
    if isinstance(e, TransportError):  # from our host-key policy
        return e
    if isinstance(e, paramiko.BadHostKeyException):
        return hostkeys.changed_key_error(h, e.key, e.expected_key)
    if isinstance(e, paramiko.BadAuthenticationType) and "publickey" not in e.allowed_types:
        # sshd offers no (more) key: a password login, or a second factor after the key (MFA)
        return TransportError(f"{h.name}: {h.user}@{h.address} asks for {' or '.join(e.allowed_types)} (a password "
                              "or a one-time code, alone or after the key): clusterctl runs unattended and never "
                              "asks for one", "log in with a key alone: `ssh-copy-id` it there, or ask the admins "
                              "how keys are allowed (a university login node's docs name the way)", "auth")
    if isinstance(e, paramiko.AuthenticationException):
        return TransportError(f"{h.name}: {h.user}@{h.address} refused our key: {e}",
                              f"copy your public key to the node: `ssh-copy-id -p {h.port} {h.user}@{h.address}` "
                              "(a node that wants a one-time code after the key cannot be scripted: use a login "
                              "that takes the key alone)", "auth")
    if isinstance(e, ConnectionRefusedError):
        return TransportError(f"{h.name}: {h.address}:{h.port} refused the connection",
                              "is sshd running on the node? (`systemctl status ssh` there)", "refused")
    if isinstance(e, (paramiko.SSHException, EOFError)) and elapsed >= 0.9 * h.connect_timeout:
        # The TCP connection opened but the handshake never finished (paramiko reports this as
        # "Error reading SSH protocol banner" or "No existing session", depending on timing).
        return TransportError(f"{h.name}: {h.address}:{h.port} accepted the connection but sent no SSH banner "
                              f"within {h.connect_timeout:g}s", "is sshd overloaded or hung on the node?", "timeout")
    if isinstance(e, (socket.timeout, TimeoutError)):
        return TransportError(f"{h.name}: no answer from {h.address}:{h.port} within {h.connect_timeout:g}s",
                              "is the PC on and on the lab network? (`ping` it from the head)", "timeout")
    if isinstance(e, (OSError, paramiko.SSHException, EOFError)):
        return TransportError(f"{h.name}: cannot connect to {h.address}:{h.port}: {e}",
                              "is the PC on the lab network and sshd running? (`ping` it, `systemctl status ssh`)",
                              "unreachable")
    return e




class RejectUnknown(paramiko.MissingHostKeyPolicy):
    """Never accept a key unasked: `clusterctl trust` records keys, connecting only checks them."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        # paramiko looks the key up as [address]:port; a HostKeyAlias names it otherwise (trust_known_hosts)
        if hostkeys.check_key(self.host, key) != "known":  # changed or revoked: check_key raises
            raise hostkeys.unknown_key_error(self.host, key)


def trust_known_hosts(client: paramiko.SSHClient, host: Host) -> None:
    """The host's known_hosts as paramiko checks it, and RejectUnknown for the rest. With a HostKeyAlias
    paramiko would look under the address and port, so every key goes to the policy, which looks it up
    under the alias as OpenSSH does."""
    if not host.host_key_alias:
        client.get_host_keys().update(hostkeys.known_hosts(host.known_hosts_path))
    client.set_missing_host_key_policy(RejectUnknown(host))


@dataclass
class Route:
    """The stream to hand to paramiko (`sock`) and what carries it (closed with the node's connection)."""

    sock: Any
    hops: list[paramiko.SSHClient] = field(default_factory=list)

    def close(self) -> None:
        for client in reversed(self.hops):
            client.close()
        self.hops.clear()


def _tcp(host: Host) -> socket.socket:
    sock = socket.create_connection((host.address, host.port), timeout=host.connect_timeout)
    # NOTE: without TCP_NODELAY every channel open waits out Nagle + delayed ACK (~40 ms):
    # measured 48 ms -> 3 ms per command on the simulated lab.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _proxy(host: Host) -> paramiko.ProxyCommand:
    """The host's ProxyCommand, its tokens expanded, run by /bin/sh as OpenSSH runs it (`exec` in front)."""
    assert host.proxy_command is not None
    try:
        command = expand_proxy_command(host.proxy_command, host, host.name)
    except ValueError as e:
        raise TransportError(f"{host.name}: {e}", "use the tokens %h %p %r %n %% only", "unreachable") from None
    proxy = paramiko.ProxyCommand(shlex.join(["/bin/sh", "-c", "exec " + command]))
    proxy.settimeout(host.connect_timeout)
    return proxy


def first_stream(host: Host) -> Any:
    """The stream to `host` itself when nothing routes it: its ProxyCommand, else TCP."""
    return _proxy(host) if host.proxy_command else _tcp(host)


def _hop(host: Host, sock: Any) -> paramiko.SSHClient:
    """An authenticated connection to a jump host, its key checked in its known_hosts (strict)."""
    client = paramiko.SSHClient()
    trust_known_hosts(client, host)
    key = key_for(host)
    try:
        client.connect(hostname=host.address, port=host.port, username=host.user, pkey=key, sock=sock,
                       timeout=host.connect_timeout, banner_timeout=host.connect_timeout,
                       auth_timeout=host.connect_timeout, look_for_keys=key is None, allow_agent=key is None)
    except BaseException:
        client.close()
        raise
    transport = client.get_transport()
    assert transport is not None
    transport.set_keepalive(15)
    return client


def open_route(node: Host) -> Route:
    """The stream to the node's sshd, through its jump hosts when it has some. A hop that fails raises the
    TransportError of that hop (named `<addr> (jump host of <node>)`), so the fix is the hop's."""
    if not node.jumps:
        start = time.monotonic()
        try:
            return Route(first_stream(node))
        except (OSError, paramiko.SSHException) as e:
            raise connect_error(node, e, time.monotonic() - start) from None
    route = Route(None)
    current = node.jumps[0]
    try:
        sock: Any = first_stream(current)
        for i, hop in enumerate(node.jumps):
            current = hop
            client = _hop(hop, sock)
            route.hops.append(client)
            nxt = node.jumps[i + 1] if i + 1 < len(node.jumps) else node
            transport = client.get_transport()
            assert transport is not None
            try:
                sock = transport.open_channel("direct-tcpip", (nxt.address, nxt.port), ("127.0.0.1", 0),
                                              timeout=node.connect_timeout)
            except paramiko.ChannelException as e:
                raise TransportError(f"{node.name}: jump host {hop.address} cannot open a connection to "
                                     f"{nxt.address}:{nxt.port}: {e}",
                                     f"check that {hop.address} reaches {nxt.address} (`ssh {hop.user}@{hop.address} "
                                     f"nc -zv {nxt.address} {nxt.port}`)", "unreachable") from None
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise TransportError(f"{node.name}: no connection through jump host {hop.address} within "
                                     f"{node.connect_timeout:g}s: {e}", "is the jump host overloaded?",
                                     "timeout") from None
        route.sock = sock
        return route
    except BaseException as e:
        route.close()
        if isinstance(e, TransportError):
            raise
        raise connect_error(current, e, current.connect_timeout if isinstance(e, socket.timeout) else 0.0) from None
