from __future__ import annotations

import subprocess
from pathlib import Path

import paramiko

from cluster import hostkeys
from cluster.errors import HostKeyError
from cluster.inventory import Host


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
        assert "ssh-keygen -R [192.168.1.14]:2222" in e.fix
    else:
        raise AssertionError("a changed key must be refused")


def test_hashed_known_hosts_entries_are_understood(tmp_path: Path) -> None:
    _, key = _keypair(tmp_path, "a")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"10.1.2.3 {key.get_name()} {key.get_base64()}\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(kh)], check=True, capture_output=True)
    assert "|1|" in kh.read_text()
    assert hostkeys.check_key(Host(name="n", address="10.1.2.3", known_hosts=str(kh)), key) == "known"
