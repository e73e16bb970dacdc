"""Wheelhouse: a real (small) download, pushed incrementally and verified on a local node."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.provision import wheelhouse
from cluster.errors import ClusterError
from cluster.inventory.model import Host
from cluster.transport.local import LocalTransport


@pytest.fixture(scope="module")
def small_wh(tmp_path_factory: pytest.TempPathFactory) -> wheelhouse.Wheelhouse:
    mp = pytest.MonkeyPatch()
    mp.setenv("CLUSTERCTL_WHEELHOUSE", str(tmp_path_factory.mktemp("wh")))
    try:
        wh = wheelhouse.build(["six==1.16.0", "idna==3.10"], "3.11")
        assert wheelhouse.cached(["six==1.16.0", "idna==3.10"], "3.11") == wh  # the second call downloads nothing
    finally:
        mp.undo()
    return wh


def test_lock_pins_every_wheel(small_wh: wheelhouse.Wheelhouse) -> None:
    assert small_wh.lock_text == "idna==3.10\nsix==1.16.0\n"
    assert all(len(str(m["sha256"])) == 64 for m in small_wh.files.values())


def test_push_is_incremental_verified_and_resumes(tmp_path: Path, small_wh: wheelhouse.Wheelhouse) -> None:
    t = LocalTransport(Host(name="n", address="127.0.0.1", connection="local", workdir=str(tmp_path)))
    dest = str(tmp_path / "wheels")
    changed, detail = wheelhouse.push(t, small_wh, dest)
    assert changed and detail.startswith("sent 2 wheels")
    assert json.loads((tmp_path / "wheels" / wheelhouse.MANIFEST).read_text()) == {
        f: m["sha256"] for f, m in small_wh.files.items()}
    assert wheelhouse.push(t, small_wh, dest) == (False, "2 wheels present and verified")
    # an interrupted earlier push: one wheel cut short, nothing recorded as verified
    six = next(f for f in small_wh.files if f.startswith("six"))
    (tmp_path / "wheels" / wheelhouse.MANIFEST).unlink()
    p = tmp_path / "wheels" / six
    p.write_bytes(p.read_bytes()[:100])
    changed, detail = wheelhouse.push(t, small_wh, dest)
    assert changed and detail.startswith("sent 1 wheels") and "verified 2" in detail
    assert wheelhouse.sha256_file(p) == small_wh.files[six]["sha256"]


def test_corrupted_transfer_is_refused_and_removed(tmp_path: Path, small_wh: wheelhouse.Wheelhouse,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    t = LocalTransport(Host(name="n", address="127.0.0.1", connection="local", workdir=str(tmp_path)))
    real_put = LocalTransport.put_file

    def flipping_put(self: LocalTransport, local: Path, remote: str, mode: int = 0o644) -> None:  # a bit flipped on the wire
        real_put(self, local, remote, mode)
        p = Path(remote)
        data = bytearray(p.read_bytes())
        data[-1] ^= 1
        p.write_bytes(bytes(data))

    monkeypatch.setattr(LocalTransport, "put_file", flipping_put)
    with pytest.raises(ClusterError, match="sha256 mismatch"):
        wheelhouse.push(t, small_wh, str(tmp_path / "wheels"))
    assert not [p for p in (tmp_path / "wheels").iterdir() if p.suffix == ".whl"]


def test_unsatisfied_compares_pins_with_pip_freeze() -> None:
    lock = "torch==2.14.1\nnumpy==2.3.0\n"
    assert wheelhouse.unsatisfied(lock, "Torch==2.14.1\nnumpy==2.2.0\npip==25.0\n") == ["numpy==2.3.0"]
    assert wheelhouse.unsatisfied(lock, "torch==2.14.1\nnumpy==2.3.0\n") == []


def test_tf_keras_comes_alone_where_tensorflow_cpu_provides_its_tensorflow(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = ["torch==2.14.1", "tensorflow-cpu==2.21.0", "tf-keras==2.21.*", "numpy"]
    assert wheelhouse._alone(cpu) == ["tf-keras==2.21.*"]
    assert wheelhouse._alone(["tensorflow==2.21.0", "tf-keras==2.21.*"]) == []  # the GPU build is its own dep
    assert wheelhouse._alone(["Tensorflow_CPU>=2.21", "TF_Keras ; python_version >= '3.9'"]) == [
        "TF_Keras ; python_version >= '3.9'"]
    # the layout is part of the cache key: wheelhouses built before it (the GPU build beside tensorflow-cpu)
    # are not reused
    now = wheelhouse.key(cpu, "3.11", None)
    monkeypatch.setattr(wheelhouse, "LAYOUT", wheelhouse.LAYOUT - 1)
    assert wheelhouse.key(cpu, "3.11", None) != now
