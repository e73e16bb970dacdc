from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import paramiko
import pytest

from cluster.inventory import hostkeys, loader
from cluster.errors import HostKeyError, InventoryError, TransportError
from cluster.inventory.model import Host
from cluster.inventory.model import KNOWN_HOSTS_MAX_BYTES
from tests.conftest import ROOT, write


def _keypair(tmp_path: Path, name: str) -> tuple[Path, paramiko.PKey]:
    p = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(p)], check=True)
    kind, b64 = (p.with_suffix(".pub")).read_text().split()[:2]
    return p, paramiko.PKey.from_type_string(kind, __import__("base64").b64decode(b64))


def test_fingerprint_matches_ssh_keygen(tmp_path: Path) -> None:
    p, key = _keypair(tmp_path, "k")
    expected = subprocess.run(["ssh-keygen", "-lf", str(p.with_suffix(".pub"))], capture_output=True,
                              text=True, check=True).stdout.split()[1]
    assert hostkeys.fingerprint(key) == expected


def test_record_then_known_then_changed(tmp_path: Path) -> None:
    _, key = _keypair(tmp_path, "a")
    _, other = _keypair(tmp_path, "b")
    host = Host(name="pc4", address="192.168.1.14", port=2222, known_hosts=str(tmp_path / "kh" / "known_hosts"))
    assert hostkeys.check_key(host, key) == "unknown"
    hostkeys.record(host, key)
    assert (tmp_path / "kh" / "known_hosts").read_text().startswith("[192.168.1.14]:2222 ssh-ed25519 ")
    assert hostkeys.check_key(host, key) == "known"
    try:
        hostkeys.check_key(host, other)
    except HostKeyError as e:
        assert e.problem == "hostkey-changed"
        assert e.fingerprint == hostkeys.fingerprint(other) and e.expected == hostkeys.fingerprint(key)
        assert "ssh-keygen -R [192.168.1.14]:2222" in (e.fix or "")
    else:
        raise AssertionError("a changed key must be refused")


def test_hashed_known_hosts_entries_are_understood(tmp_path: Path) -> None:
    _, key = _keypair(tmp_path, "a")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"10.1.2.3 {key.get_name()} {key.get_base64()}\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(kh)], check=True, capture_output=True)
    assert "|1|" in kh.read_text()
    assert hostkeys.check_key(Host(name="n", address="10.1.2.3", known_hosts=str(kh)), key) == "known"


def _line(pub: Path) -> str:
    kind, b64 = pub.read_text().split()[:2]
    return f"{kind} {b64}"


def _openssh_file(tmp_path: Path) -> tuple[Path, paramiko.PKey, paramiko.PKey, paramiko.PKey]:
    """A known_hosts with every kind of line OpenSSH accepts (and a few it would also skip), hashed by ssh-keygen."""
    _, good = _keypair(tmp_path, "good")
    _, revoked = _keypair(tmp_path, "revoked")
    _, wild = _keypair(tmp_path, "wild")
    _keypair(tmp_path, "ca")
    kh = tmp_path / "known_hosts"
    kh.write_text(
        "# lab PCs, written by hand\n"
        f"10.1.2.3 {_line(tmp_path / 'good.pub')} root@pc3\n"
        f"@revoked * {_line(tmp_path / 'revoked.pub')}\n"
        f"@cert-authority *.lab.example.org {_line(tmp_path / 'ca.pub')} lab CA\n"
        f"10.1.2.* {_line(tmp_path / 'wild.pub')}\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(kh)], check=True, capture_output=True)
    lines = kh.read_text().splitlines()
    assert lines[0].startswith("# lab") and lines[1].startswith("|1|") and lines[2].startswith("@revoked * ")
    assert lines[3].startswith("@cert-authority ") and lines[4].startswith("10.1.2.* ")
    with open(kh, "ab") as f:  # lines ssh-keygen itself would not hash
        f.write(b"10.1.2.9 ssh-ed25519 not!base64\n"
                b"10.1.2.8 ssh-foo AAAAB3NzaC1yc2EAAAADAQABAAABAQ==\n"
                b"@unknown-marker 10.1.2.7 ssh-ed25519 AAAA\n"
                b"10.1.2.6 ssh-ed25519\n"
                b"\n"
                b"10.1.2.5 ssh-ed25519 \xff\xfe\n")
    return kh, good, revoked, wild


def test_openssh_markers_and_bad_lines_never_raise(tmp_path: Path) -> None:
    kh, good, revoked, _ = _openssh_file(tmp_path)
    assert hostkeys.check_key(Host(name="pc3", address="10.1.2.3", known_hosts=str(kh)), good) == "known"
    notes = hostkeys.parsed(kh).notes
    text = "\n".join(notes)
    for lineno, what in [(4, "@cert-authority line ignored"), (5, "host pattern '10.1.2.*' ignored"),
                         (6, "not valid base64"), (7, "unknown key type 'ssh-foo'"),
                         (8, "unknown marker '@unknown-marker'"), (9, "expected `[marker] hosts"),
                         (11, "not UTF-8")]:
        assert f"{kh}:{lineno}: " in text and what in text, (lineno, what, text)
    assert len(notes) == 7
    assert hostkeys.parsed(kh).revoked_at(revoked) == f"{kh}:3"


def test_a_revoked_key_is_refused_even_when_also_listed(tmp_path: Path) -> None:
    kh, _, revoked, _ = _openssh_file(tmp_path)
    with open(kh, "a") as f:  # the same key recorded for a node: @revoked still wins
        f.write(f"10.1.2.20 {revoked.get_name()} {revoked.get_base64()}\n")
    for address in ("10.1.2.20", "10.1.2.21"):
        host = Host(name="pc20", address=address, known_hosts=str(kh))
        try:
            hostkeys.check_key(host, revoked)
        except HostKeyError as e:
            assert e.problem == "hostkey-revoked" and e.exit_code == 3
            assert "REVOKED" in e.message and f"{kh}:3" in e.message and "clusterctl trust" in (e.fix or "")
        else:
            raise AssertionError("a revoked key must be refused")
        err = hostkeys.unknown_key_error(host, revoked)  # what the SSH connection raises
        assert err.problem == "hostkey-revoked"
    assert hostkeys.known_hosts(kh).lookup("10.1.2.20") is None


def test_an_unknown_key_error_lists_the_lines_not_used(tmp_path: Path) -> None:
    kh, _, _, wild = _openssh_file(tmp_path)
    e = hostkeys.unknown_key_error(Host(name="pc4", address="10.1.2.4", known_hosts=str(kh)), wild)
    assert e.problem == "hostkey-unknown"
    assert f"{kh}:4: @cert-authority line ignored" in e.message and "(and 2 more)" in e.message


def test_an_unreadable_known_hosts_is_a_clear_error(tmp_path: Path) -> None:
    from cluster.errors import TransportError

    (tmp_path / "kh").mkdir()
    try:
        hostkeys.known_hosts(tmp_path / "kh")
    except TransportError as e:
        assert f"cannot read known_hosts file {tmp_path / 'kh'}" in e.message and e.problem == "known-hosts"
    else:
        raise AssertionError("a directory is not a known_hosts file")


def _at_once(fn: Callable[[], object], seconds: float = 10,
             release: Callable[[], None] | None = None) -> BaseException | None:
    """What fn raised (None if it returned), run in a thread: a regression that blocks fails here, not hangs
    (`release` then unblocks the thread, which may hold hostkeys' lock the other tests need)."""
    box: list[BaseException | None] = []

    def go() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)
        else:
            box.append(None)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive() and release is not None:
        release()
        t.join(seconds)
        raise AssertionError(f"still blocked after {seconds} s")
    assert not t.is_alive(), f"still blocked after {seconds} s"
    return box[0]


def _child(*args: str) -> subprocess.CompletedProcess[str]:
    """A python child with its memory capped: in a regression its endless read of /dev/zero ends in a
    MemoryError, or at the timeout, not in the machine's memory."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          preexec_fn=cap)


def _fifo(tmp_path: Path) -> Path:
    p = tmp_path / "known_hosts.fifo"
    os.mkfifo(p)
    return p


_THREE_CALLS = """
import sys
from pathlib import Path
from cluster.inventory import hostkeys
from cluster.errors import TransportError
from cluster.inventory.model import Host
from tests.unit.test_hostkeys import _keypair
path, tmp = Path(sys.argv[1]), Path(sys.argv[2])
host = Host(name="pc1", address="10.1.2.3", known_hosts=str(path))
_, key = _keypair(tmp, "k")
for fn in (lambda: hostkeys.known_hosts(path), lambda: hostkeys.check_key(host, key),
           lambda: hostkeys.record(host, key)):
    try:
        fn()
        print("returned")
    except TransportError as e:
        print(e.problem, e.exit_code, e.message, "|", e.fix)
"""


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_known_hosts_that_is_no_regular_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    """`known_hosts: /dev/zero` (never ends) or a FIFO (blocks its reader) hung every command. In a child
    process with a timeout: a regression fails here, and its endless read of /dev/zero is killed with it."""
    path = _fifo(tmp_path) if kind == "fifo" else Path("/dev/zero")
    what = "a named pipe (FIFO)" if kind == "fifo" else "a character device"
    r = _child("-c", _THREE_CALLS, str(path), str(tmp_path))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 3, r.stderr
    for line in lines:  # known_hosts, check_key, record: each refuses, naming the file, what it is and the fix
        assert line.startswith("known-hosts 3 cannot ") and f"known_hosts file {path}: it is {what}, " \
            "not a regular file" in line and "point `known_hosts:` in the inventory at a regular file" in line


def test_a_fifo_known_hosts_returns_at_once_in_this_process(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path)

    def release() -> None:  # a writer that opens and closes: the blocked reader gets its end of file
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    e = _at_once(lambda: hostkeys.known_hosts(fifo), release=release)
    assert isinstance(e, TransportError) and "named pipe" in e.message


def test_a_known_hosts_larger_than_the_cap_is_refused(tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    with open(kh, "wb") as f:
        f.truncate(KNOWN_HOSTS_MAX_BYTES + 1)  # sparse: no disk used
    e = _at_once(lambda: hostkeys.known_hosts(kh))
    assert isinstance(e, TransportError) and "more than a known_hosts file holds (at most 16 MiB)" in e.message
    with open(kh, "r+b") as f:
        f.truncate(KNOWN_HOSTS_MAX_BYTES)  # at the cap: read (all NUL bytes, one line not used)
    assert _at_once(lambda: hostkeys.known_hosts(kh)) is None


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "big"])
def test_the_inventory_refuses_such_a_known_hosts_naming_its_line(tmp_path: Path, kind: str) -> None:
    path = _fifo(tmp_path) if kind == "fifo" else Path("/dev/zero") if kind == "/dev/zero" else tmp_path / "kh"
    if kind == "big":
        with open(path, "wb") as f:
            f.truncate(KNOWN_HOSTS_MAX_BYTES + 1)
    inv = write(tmp_path, f"defaults:\n  known_hosts: {path}\nhosts:\n  pc1: {{address: 127.0.0.1}}\n")
    e = _at_once(lambda: loader.load(inv))
    assert isinstance(e, InventoryError) and (e.line, e.field, e.exit_code) == (2, "defaults.known_hosts", 2), e
    assert ("not a regular file" in e.message or "more than a known_hosts file holds" in e.message) \
        and "regular file" in (e.fix or "")
    r = _child("-m", "cluster", "exec", str(inv), "--", "true")
    assert r.returncode == 2 and "Traceback" not in r.stderr and f"{inv}:2: defaults.known_hosts" in r.stderr
