"""A job's requirements layer installed on `connection: local` nodes for real (pip, offline, --target): by
SFTP-style copies below the relay threshold, by the peer relay above it; a node that has it is skipped."""
from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from cluster.inventory.model import Host
from cluster.nodes.fanout import Group
from cluster.provision.wheelhouse import Wheelhouse
from cluster.relay import distribute
from cluster.runs import layers


def tiny_wheel(folder: Path, padding: int) -> tuple[str, dict[str, int | str]]:
    """tinypkg 1.0, a pure-Python wheel made by hand (what `pip wheel` writes, less the build), with
    `padding` random bytes of data so that it crosses the relay threshold when asked to."""
    import os

    name = "tinypkg-1.0-py3-none-any.whl"
    files = {"tinypkg/__init__.py": b"VALUE = 42\n", "tinypkg/pad.bin": os.urandom(padding),
             "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
             "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},"
                     f"{len(b)}\n" for p, b in files.items()) + "tinypkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / name, "w") as z:
        for p, b in {**files, "tinypkg-1.0.dist-info/RECORD": record.encode()}.items():
            z.writestr(p, b)
    data = (folder / name).read_bytes()
    return name, {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def nodes(tmp_path: Path, n: int) -> list[Host]:
    hosts = []
    for i in range(n):
        wd = tmp_path / f"n{i}"
        wd.mkdir()
        (wd / "cluster.env").write_text(f"CLUSTER_PYTHON={sys.executable}\nexport CLUSTER_PYTHON\n")
        hosts.append(Host(name=f"n{i}", address="127.0.0.1", connection="local", workdir=str(wd)))
    return hosts


@pytest.mark.parametrize("padding, via", [(1000, "sftp"), (3_000_000, "relay")])
def test_the_layer_is_installed_once_by_sftp_or_relay(tmp_path: Path, padding: int, via: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distribute, "RELAY_MIN_BYTES", 4 << 20)  # 3 nodes x 3 MB crosses it, 3 x 1 kB does not
    wh_dir = tmp_path / "wheelhouse"
    wh_dir.mkdir()
    name, meta = tiny_wheel(wh_dir, padding)
    layer = layers.Layer(Wheelhouse(wh_dir, ("tinypkg",), {name: meta}), "tinypkg==1.0\n", "d" * 16)
    hosts = nodes(tmp_path, 3)
    with Group(hosts) as g:
        first = layers.install(g, hosts, layer)
        assert first.ok, {n: r.error or r.stderr for n, r in first.items()}
        assert [r.value for r in first.values()] == [{"installed": True, "bytes": meta["size"], "via": via}] * 3
        for h in hosts:
            assert (Path(layer.dir(h)) / "site" / "tinypkg" / "__init__.py").read_text() == "VALUE = 42\n"
        again = layers.install(g, hosts, layer)
    assert [r.value for r in again.values()] == [{"installed": False, "bytes": 0}] * 3
