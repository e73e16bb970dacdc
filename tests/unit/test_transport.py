"""Transport pieces that need no SSH server: the stall setting and resumable copies (send_file)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.errors import UsageError
from cluster.inventory import Host
from cluster.transport import base
from cluster.transport.local import LocalTransport


def _local(tmp_path: Path) -> LocalTransport:
    return LocalTransport(Host(name="n", address="127.0.0.1", connection="local", workdir=str(tmp_path)))


def test_stall_timeout_default_and_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(base.STALL_ENV, raising=False)
    assert _local(tmp_path).stall_timeout == base.STALL_TIMEOUT_S == 30.0
    monkeypatch.setenv(base.STALL_ENV, "7.5")
    assert _local(tmp_path).stall_timeout == 7.5


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "nan", "inf"])
def test_stall_timeout_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    raw: str) -> None:
    monkeypatch.setenv(base.STALL_ENV, raw)
    with pytest.raises(UsageError) as e:
        _local(tmp_path)
    assert base.STALL_ENV in str(e.value) and "positive number of seconds" in str(e.value)
    assert e.value.exit_code == 2


def test_send_file_resumes_a_verified_prefix(tmp_path: Path) -> None:
    t = _local(tmp_path)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    dest = tmp_path / "node" / "dest.part"
    dest.parent.mkdir()
    dest.write_bytes(src.read_bytes()[:123_456])  # a copy cut short
    assert t.send_file(src, str(dest), 0o600) == 300_000 - 123_456
    assert dest.read_bytes() == src.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o600
    assert t.send_file(src, str(dest)) == 0  # complete: nothing crosses again
    assert dest.stat().st_mode & 0o777 == 0o644


def test_send_file_restarts_when_the_remote_bytes_differ(tmp_path: Path) -> None:
    t = _local(tmp_path)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(200_000))
    dest = tmp_path / "dest.part"
    wrong = bytearray(src.read_bytes()[:50_000])
    wrong[10] ^= 1
    dest.write_bytes(bytes(wrong))
    assert t.send_file(src, str(dest)) == 200_000
    assert dest.read_bytes() == src.read_bytes()
    dest.write_bytes(src.read_bytes() + b"more")  # longer than the source: not a prefix
    assert t.send_file(src, str(dest)) == 200_000
    assert dest.read_bytes() == src.read_bytes()


def test_send_file_to_a_missing_file_sends_everything(tmp_path: Path) -> None:
    t = _local(tmp_path)
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    assert t.send_file(src, str(tmp_path / "a" / "b.part")) == 1000
    assert (tmp_path / "a" / "b.part").read_bytes() == b"x" * 1000
