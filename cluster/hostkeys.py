"""SSH host keys: fingerprints, known_hosts files, and first contact (`clusterctl trust`).

A key is only ever recorded by `trust`, which shows its fingerprint; connecting
never adds one. A changed key is refused with both fingerprints shown.
"""
from __future__ import annotations

import base64
import hashlib
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import paramiko

from cluster.errors import HostKeyError, TransportError
from cluster.inventory import Host

_cache: dict[tuple[Path, int, int], paramiko.HostKeys] = {}
_lock = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint, as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts(path: Path) -> paramiko.HostKeys:
    """Parsed known_hosts, shared by all connections of an invocation (re-read when it changes)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return paramiko.HostKeys()
    stamp = (path, st.st_mtime_ns, st.st_size)
    with _lock:
        if stamp not in _cache:
            _cache[stamp] = paramiko.HostKeys(str(path))
        return _cache[stamp]


def unknown_key_error(host: Host, key: paramiko.PKey) -> HostKeyError:
    return HostKeyError(
        f"{host.name}: host key of {host.host_key_name} is not in {host.known_hosts_path} "
        f"({key.get_name()} {fingerprint(key)})",
        fix="check the fingerprint on the node (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`), "
        "then run `clusterctl trust` to record it",
        problem="hostkey-unknown",
        fingerprint=fingerprint(key),
    )


def changed_key_error(host: Host, got: paramiko.PKey, expected: paramiko.PKey) -> HostKeyError:
    return HostKeyError(
        f"{host.name}: HOST KEY CHANGED for {host.host_key_name}: it now offers {got.get_name()} "
        f"{fingerprint(got)}, but {host.known_hosts_path} records {fingerprint(expected)}. "
        "Refusing to connect (someone may be impersonating the node).",
        fix="if the node was reinstalled and you verified the new fingerprint on it, remove the old entry "
        f"with `ssh-keygen -R {host.host_key_name} -f {host.known_hosts_path}` and run `clusterctl trust`",
        problem="hostkey-changed",
        fingerprint=fingerprint(got),
        expected=fingerprint(expected),
    )


def scan(host: Host) -> paramiko.PKey:
    """The key the node offers, fetched without authenticating (first contact)."""
    try:
        sock = socket.create_connection((host.address, host.port), timeout=host.connect_timeout)
    except OSError as e:
        raise TransportError(f"{host.name}: cannot reach {host.address}:{host.port}: {e}",
                             "is the PC on, on the network, and running sshd?", "unreachable") from None
    t = paramiko.Transport(sock)
    try:
        preferred = [k.get_name() for k in (known_hosts(host.known_hosts_path).lookup(host.host_key_name) or {}).values()]
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


def check_key(host: Host, key: paramiko.PKey) -> str:
    """'known' when recorded and equal, 'unknown' when absent; raises HostKeyError when changed."""
    entry = known_hosts(host.known_hosts_path).lookup(host.host_key_name)
    if not entry:
        return "unknown"
    expected = entry.get(key.get_name())
    if expected is None:
        expected = next(iter(entry.values()))
    if expected != key:
        raise changed_key_error(host, key, expected)
    return "known"


def record(host: Host, key: paramiko.PKey) -> None:
    """Append one OpenSSH-format line to the host's known_hosts file."""
    path = host.known_hosts_path
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    line = f"{host.host_key_name} {key.get_name()} {key.get_base64()}\n"
    with _lock, open(path, "a") as f:
        f.write(line)



@dataclass(frozen=True)
class Offer:
    """What one node offered at first contact, compared with known_hosts."""

    host: Host
    status: str  # new | known | changed | unreachable | local
    key: paramiko.PKey | None = None
    message: str | None = None

    @property
    def fingerprint(self) -> str | None:
        return fingerprint(self.key) if self.key is not None else None

    def to_dict(self) -> dict[str, str | None]:
        return {"host": self.host.name, "address": self.host.host_key_name, "status": self.status,
                "key_type": self.key.get_name() if self.key else None, "fingerprint": self.fingerprint,
                "known_hosts": str(self.host.known_hosts_path), "message": self.message}


def survey(hosts: list[Host], forks: int = 32) -> list[Offer]:
    """Scan every node at once; nothing is recorded here."""

    def one(host: Host) -> Offer:
        if host.connection != "ssh":
            return Offer(host, "local")
        try:
            key = scan(host)
        except TransportError as e:
            return Offer(host, "unreachable", message=str(e))
        try:
            return Offer(host, "known" if check_key(host, key) == "known" else "new", key)
        except HostKeyError as e:
            return Offer(host, "changed", key, message=str(e))

    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(hosts)))) as pool:
        return list(pool.map(one, hosts))
