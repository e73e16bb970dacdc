"""SSH host keys: fingerprints and known_hosts files (first contact, `clusterctl trust`, is transport/firstcontact.py).

A key is only ever recorded by `trust`, which shows its fingerprint; connecting
never adds one. A changed key is refused with both fingerprints shown.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paramiko
from paramiko.pkey import UnknownKeyType

from cluster.bounds import FileRefused, read_regular
from cluster.errors import HostKeyError, TransportError
from cluster.inventory.model import Host
from cluster.inventory.check import KNOWN_HOSTS_NOUN, known_hosts_problem
from cluster.inventory.model import KNOWN_HOSTS_MAX_BYTES

_cache: dict[tuple[Path, int, int], KnownHosts] = {}
_lock = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint, as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


@dataclass
class KnownHosts:
    """One known_hosts file as OpenSSH writes it, parsed by us: paramiko's own reader raises on the valid
    `@cert-authority` and `@revoked` lines (a traceback on every SSH command) and ignores @revoked."""

    path: Path
    keys: paramiko.HostKeys = field(default_factory=paramiko.HostKeys)  # plain and hashed (|1|) entries
    revoked: dict[str, str] = field(default_factory=dict)  # fingerprint -> "file:line"
    notes: list[str] = field(default_factory=list)  # lines we did not use, each with file:line and why

    def revoked_at(self, key: paramiko.PKey) -> str | None:
        return self.revoked.get(fingerprint(key))


def _parse_key(key_type: str, b64: str) -> paramiko.PKey:
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the key is not valid base64") from None
    try:
        return paramiko.PKey.from_type_string(key_type, raw)
    except UnknownKeyType:
        raise ValueError(f"unknown key type {key_type!r}") from None
    except Exception as e:  # noqa: BLE001 - any malformed key blob: paramiko raises several kinds
        raise ValueError(f"not a valid {key_type} key ({type(e).__name__})") from None


def parse_known_hosts(path: Path, text: bytes) -> KnownHosts:
    """Every line of an OpenSSH known_hosts file: plain and hashed host entries are used, `@revoked` keys are
    refused for every node (stricter than OpenSSH, which applies them to the line's host patterns),
    `@cert-authority` lines are noted and ignored (clusterctl does not accept host certificates), and any
    other line it cannot read is noted with file:line. Never raises on content."""
    kh = KnownHosts(path)
    plain: list[tuple[str, paramiko.PKey]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            kh.notes.append(f"{where}: not UTF-8 text; line ignored")
            continue
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if marker not in (None, "@revoked", "@cert-authority"):
            kh.notes.append(f"{where}: unknown marker {marker!r}; line ignored")
            continue
        if len(fields) < 3:
            kh.notes.append(f"{where}: expected `[marker] hosts key-type base64-key`; line ignored")
            continue
        names, key_type, b64 = fields[:3]
        try:
            key = _parse_key(key_type, b64)
        except ValueError as e:
            kh.notes.append(f"{where}: {e}; line ignored")
            continue
        if marker == "@revoked":
            kh.revoked[fingerprint(key)] = where
        elif marker == "@cert-authority":
            kh.notes.append(f"{where}: @cert-authority line ignored: clusterctl does not accept host "
                            "certificates; record each node's own key with `clusterctl trust`")
        else:
            for name in names.split(","):
                if name.startswith("!") or any(c in name for c in "*?"):
                    kh.notes.append(f"{where}: host pattern {name!r} ignored: clusterctl matches exact names "
                                    "(plain or hashed) only")
                    continue
                plain.append((name, key))
    for name, key in plain:  # a revoked key is never "known", even where a plain line also lists it
        if fingerprint(key) not in kh.revoked:
            kh.keys.add(name, key.get_name(), key)
    return kh


def _unusable(path: Path, problem: str, verb: str = "read") -> TransportError:
    return TransportError(f"cannot {verb} known_hosts file {path}: it {problem}",
                          "point `known_hosts:` in the inventory at a regular file (default ~/.ssh/known_hosts; "
                          "`clusterctl trust` creates it)", "known-hosts")


def _read_capped(path: Path) -> bytes:
    """The file's bytes, read only if it is a regular file of at most KNOWN_HOSTS_MAX_BYTES (bounds.read_regular:
    a FIFO or device, even one swapped in after the stat, is refused at once)."""
    try:
        return read_regular(path, "", KNOWN_HOSTS_MAX_BYTES, KNOWN_HOSTS_NOUN)
    except FileRefused as e:
        raise _unusable(path, e.problem) from None
    except OSError as e:
        raise TransportError(f"cannot read known_hosts file {path}: {e.strerror}",
                             "fix its permissions or point `known_hosts:` in the inventory elsewhere",
                             "known-hosts") from None


def parsed(path: Path) -> KnownHosts:
    """The known_hosts file, parsed once per invocation (re-read when it changes)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return KnownHosts(path)
    except OSError as e:
        raise TransportError(f"cannot read known_hosts file {path}: {e.strerror}",
                             "fix its permissions or point `known_hosts:` in the inventory elsewhere",
                             "known-hosts") from None
    problem = known_hosts_problem(st)
    if problem is not None:  # before the lock: a refused file costs no other thread a wait
        raise _unusable(path, problem)
    stamp = (path, st.st_mtime_ns, st.st_size)
    with _lock:
        if stamp not in _cache:
            _cache[stamp] = parse_known_hosts(path, _read_capped(path))
        return _cache[stamp]


def known_hosts(path: Path) -> paramiko.HostKeys:
    """The usable (not revoked) host keys of a known_hosts file."""
    return parsed(path).keys


def _notes(host: Host) -> str:
    notes = parsed(host.known_hosts_path).notes
    if not notes:
        return ""
    more = f" (and {len(notes) - 5} more)" if len(notes) > 5 else ""
    return " Lines of that file not used: " + "; ".join(notes[:5]) + more + "."


def revoked_key_error(host: Host, key: paramiko.PKey, where: str) -> HostKeyError:
    return HostKeyError(
        f"{host.name}: HOST KEY REVOKED: {host.host_key_name} offers {key.get_name()} {fingerprint(key)}, "
        f"which {where} marks @revoked. Refusing to connect.",
        fix="the node still uses a key you revoked: give it a new host key (`ssh-keygen -A` after removing the "
        "old one on the node), check its fingerprint there, then run `clusterctl trust`",
        problem="hostkey-revoked",
        fingerprint=fingerprint(key),
    )


def unknown_key_error(host: Host, key: paramiko.PKey) -> HostKeyError:
    where = parsed(host.known_hosts_path).revoked_at(key)
    if where:
        return revoked_key_error(host, key, where)
    return HostKeyError(
        f"{host.name}: host key of {host.host_key_name} is not in {host.known_hosts_path} "
        f"({key.get_name()} {fingerprint(key)}).{_notes(host)}",
        fix="check the fingerprint on the node (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`), "
        "then run `clusterctl trust` to record it",
        problem="hostkey-unknown",
        fingerprint=fingerprint(key),
    )


def changed_key_error(host: Host, got: paramiko.PKey, expected: paramiko.PKey) -> HostKeyError:
    where = parsed(host.known_hosts_path).revoked_at(got)
    if where:
        return revoked_key_error(host, got, where)
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


def check_key(host: Host, key: paramiko.PKey) -> str:
    """'known' when recorded and equal, 'unknown' when absent; raises HostKeyError when changed or revoked."""
    where = parsed(host.known_hosts_path).revoked_at(key)
    if where:
        raise revoked_key_error(host, key, where)
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
    with _lock:
        try:
            problem = known_hosts_problem(path.stat())
        except OSError:  # absent: created below
            problem = None
        if problem is not None:
            raise _unusable(path, problem, "write")
        try:  # without blocking, checked again once open: appending to a FIFO with no reader waits forever
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                         0o666)  # as open(path, "a"): the umask decides
        except OSError as e:
            raise TransportError(f"cannot write known_hosts file {path}: {e.strerror}",
                                 "fix its permissions or point `known_hosts:` in the inventory elsewhere",
                                 "known-hosts") from None
        with os.fdopen(fd, "w") as f:
            problem = known_hosts_problem(os.fstat(fd))
            if problem is not None:
                raise _unusable(path, problem, "write")
            f.write(line)
