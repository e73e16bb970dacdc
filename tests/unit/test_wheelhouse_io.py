"""A head without internet (`clusterctl wheelhouse build|export|import`; cluster/provision/wheelhouse_plan.py,
wheelhouse_export.py, wheelhouse_import.py): the wheelhouses provision would build, exported with a manifest
of sha256s, imported only when every file matches, then used by provision without network; and pip's failure
on a head that cannot reach the index names that way out.

Fast: the wheelhouses are made by hand (files of a few bytes under the keys provision computes), and the
one pip run goes to a closed port on 127.0.0.1 (never anything else on the network).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster import cli, errors
from cluster.errors import ClusterError, UsageError
from cluster.inventory import loader
from cluster.nodes.facts import NodeFacts
from cluster.provision import apply, wheelhouse, wheelhouse_export, wheelhouse_import, wheelhouse_plan
from cluster.provision.report import NodeOutcome
from tests.conftest import write

CLOSED_INDEX = "http://127.0.0.1:9/simple"  # the discard port: nothing listens, the connection is refused


def main(*argv: str) -> tuple[int, str, str]:
    """`clusterctl ARGV` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("CLUSTERCTL_WHEELHOUSE", str(d))
    return d


def use_cache(monkeypatch: pytest.MonkeyPatch, d: Path) -> Path:
    monkeypatch.setenv("CLUSTERCTL_WHEELHOUSE", str(d))
    return d


def offline_pip(monkeypatch: pytest.MonkeyPatch, retries: str = "1") -> None:
    """pip with no configuration (no local mirror, find-links or constraints) and a closed index."""
    for k in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", CLOSED_INDEX)
    monkeypatch.setenv("PIP_RETRIES", retries)


def fake_wheelhouse(root: Path, requirements: list[str], python: str, index: str | None = None,
                    constraints: tuple[str, ...] = (), seed: str = "") -> wheelhouse.Wheelhouse:
    """A wheelhouse folder as wheelhouse.build leaves it (manifest.json, files/), with hand-made 'wheels'."""
    d = root / wheelhouse.key(requirements, python, index, constraints)
    (d / "files").mkdir(parents=True)
    files: dict[str, dict[str, int | str]] = {}
    for i, r in enumerate(requirements):
        name = wheelhouse.requirement_name(r).replace("-", "_")
        f = d / "files" / f"{name}-1.{i}-py3-none-any.whl"
        f.write_bytes(f"{r} {seed}".encode() * (i + 1))
        files[f.name] = {"sha256": wheelhouse.sha256_file(f), "size": f.stat().st_size}
    if constraints:
        (d / "constraints.txt").write_text("".join(f"{c}\n" for c in sorted(constraints)))
    (d / "manifest.json").write_text(json.dumps({"requirements": requirements, "python": python, "index": index,
                                                 "files": files}, indent=1))
    return wheelhouse.Wheelhouse(d / "files", tuple(requirements), files)


# --------------------------------------------------------------------------- pip on a head without internet


@pytest.mark.parametrize("retries", ["0", "1"])
def test_a_head_that_cannot_reach_the_index_is_told_to_import(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                               retries: str) -> None:
    """pip download against a closed port fails within seconds, and the fix names the disk's way in."""
    offline_pip(monkeypatch, retries)
    start = time.monotonic()
    with pytest.raises(ClusterError) as e:
        wheelhouse.build(["six==1.16.0"], "3.11")
    assert time.monotonic() - start < 60
    assert "pip download failed for six==1.16.0" in e.value.message
    assert ("cannot reach the package index" if retries == "1" else "out of this head's reach") in e.value.message
    fix = e.value.fix or ""
    assert "clusterctl wheelhouse import DIR" in fix and "clusterctl wheelhouse export DIR" in fix
    assert "clusterctl wheelhouse build INVENTORY" in fix and "--for py3.11,cpu" in fix
    assert e.value.exit_code == errors.EXIT_FAILED
    assert wheelhouse.cached(["six==1.16.0"], "3.11") is None


def test_provision_on_a_head_without_internet_fails_its_nodes_with_that_fix(cache: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """What provision does with each wheelhouse (apply._wheelhouses): the node fails, the fix says import."""
    offline_pip(monkeypatch)
    inv, facts = wheelhouse_plan.target_inventory(wheelhouse_plan.parse_targets(["py3.11,cpu"]), torch_index="pypi")
    sel = wheelhouse_plan.select(inv, list(inv.hosts.values()), facts)
    hosts = list(inv.hosts.values())
    out = {h.name: NodeOutcome(h.name) for h in hosts}
    assert apply._wheelhouses(hosts, facts, sel.choice, False, lambda s: None, out) == {}
    (o,) = out.values()
    assert o.status == "failed" and "wheelhouse: pip download failed" in (o.error or "")
    assert "clusterctl wheelhouse import DIR" in (o.fix or "")


def test_wheelhouse_build_cli_offline_exits_1_naming_import(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_pip(monkeypatch)
    rc, out, err = main("wheelhouse", "build", "--for", "py3.11,cpu", "--torch-index", "pypi", "--json")
    assert rc == errors.EXIT_FAILED, err
    (w,) = json.loads(out)["wheelhouses"]
    assert w["status"] == "failed" and "clusterctl wheelhouse import DIR" in w["fix"]


# --------------------------------------------------------------------------- what build fills: provision's sets


def facts_json(tmp_path: Path, nodes: dict[str, list[dict[str, Any]] | None], python: tuple[int, int] = (3, 11)) -> Path:
    """A file as `clusterctl check --json` writes it: each node's GPUs (None: the node was unreachable)."""
    doc = {"nodes": [{"host": n, "address": "10.0.0.1", "status": "ok" if g is not None else "unreachable",
                      "facts": None if g is None else {
                          "host": n, "python": {"version": "%d.%d.4" % python, "version_tuple": [*python, 4]},
                          "gpus": {"source": "nvidia-smi", "gpus": g, "error": None}, "address_nic": "eth0"}}
                     for n, g in nodes.items()]}
    p = tmp_path / "facts.json"
    p.write_text(json.dumps(doc))
    return p


GTX1050TI = {"name": "NVIDIA GeForce GTX 1050 Ti", "compute_capability": "6.1", "driver": "580.95.05"}
RTX3060 = {"name": "NVIDIA GeForce RTX 3060", "compute_capability": "8.6", "driver": "580.95.05"}


def room(tmp_path: Path) -> Path:
    return write(tmp_path, """\
hosts:
  pc1: {address: 10.0.0.1}
  pc2: {address: 10.0.0.2}
  pc3: {address: 10.0.0.3}
""", "room.yaml")


def test_build_plans_exactly_the_wheelhouses_provision_would(tmp_path: Path, cache: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The sets of `wheelhouse build INVENTORY --facts FILE` are the ones provision asks wheelhouse.build for."""
    inv = loader.load(room(tmp_path))
    hosts = list(inv.hosts.values())
    ff = facts_json(tmp_path, {"pc1": [GTX1050TI], "pc2": [RTX3060], "pc3": []})
    nf, out = wheelhouse_plan.facts_file(ff, hosts)
    sel = wheelhouse_plan.select(inv, hosts, nf, out)
    asked: list[tuple[tuple[str, ...], str, str | None]] = []

    def recording_build(reqs: list[str], python: str, index: str | None = None, **kw: Any) -> wheelhouse.Wheelhouse:
        asked.append((tuple(reqs), python, index))
        return wheelhouse.Wheelhouse(cache, tuple(reqs), {})

    monkeypatch.setattr(wheelhouse, "build", recording_build)
    request = apply.request_for(inv, hosts, nf, apply.playbook.load("provision"))
    apply._wheelhouses(request.planned, nf, request.choice, False, lambda s: None, request.outcomes)
    assert sorted(asked) == sorted((s.requirements, s.python, s.index) for s in sel.sets)
    assert {n for s in sel.sets for n in s.nodes} == {"pc1", "pc2", "pc3"} and not sel.left_out
    by_node = {n: s for s in sel.sets for n in s.nodes}
    assert by_node["pc1"].requirements[:3] == ("torch==2.14.1+cu126", "torchvision==0.29.1+cu126",
                                               "tensorflow[and-cuda]==2.21.0")
    assert "nvidia-cudnn-cu12<9.11" in by_node["pc1"].requirements  # Pascal: cuDNN below 9.11
    assert "nvidia-cudnn-cu12<9.11" not in by_node["pc2"].requirements
    assert by_node["pc3"].requirements[0] == "torch==2.14.1+cpu" and by_node["pc3"].index.endswith("/whl/cpu")


def test_for_targets_render_the_same_sets_as_such_nodes(tmp_path: Path, cache: Path) -> None:
    """`--for py3.11,cpu,cu126`: the requirement sets of a lab of a CPU PC and a Pascal PC on R580."""
    inv = loader.load(write(tmp_path, "hosts:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.2}\n"))
    hosts = list(inv.hosts.values())
    nf, out = wheelhouse_plan.facts_file(facts_json(tmp_path, {
        "a": [], "b": [{"name": "NVIDIA GeForce GTX 1080", "compute_capability": "6.1", "driver": "580.95.05"}]}),
        hosts)
    from_facts = wheelhouse_plan.select(inv, hosts, nf, out)
    tinv, tfacts = wheelhouse_plan.target_inventory(wheelhouse_plan.parse_targets(["py3.11,cpu,cu126"]))
    from_targets = wheelhouse_plan.select(tinv, list(tinv.hosts.values()), tfacts)
    assert [s.key for s in from_targets.sets] == [s.key for s in from_facts.sets]
    cu = next(s for s in from_targets.sets if s.nodes == ("cu126-py3.11",))
    assert cu.index == "https://download.pytorch.org/whl/cu126" and cu.python == "3.11"
    assert cu.requirements == ("torch==2.14.1+cu126", "torchvision==0.29.1+cu126", "tensorflow[and-cuda]==2.21.0",
                               "tf-keras==2.21.*", "nvidia-cudnn-cu12<9.11", *apply.EXTRA_PACKAGES)
    # cu118 (an R470 driver) pulls the whole lab down to torch 2.7.1, as provision's plan would
    tinv, tfacts = wheelhouse_plan.target_inventory(wheelhouse_plan.parse_targets(["py3.10,cpu", "py3.10,cu118"]))
    sel = wheelhouse_plan.select(tinv, list(tinv.hosts.values()), tfacts)
    assert sel.choice is not None and sel.choice.torch == "2.7.1"
    assert {s.requirements[0] for s in sel.sets} == {"torch==2.7.1+cpu", "torch==2.7.1+cu118"}


def test_facts_of_an_unreachable_node_leave_it_out_exit_3(tmp_path: Path, cache: Path) -> None:
    inv = room(tmp_path)
    ff = facts_json(tmp_path, {"pc1": [], "pc2": None, "pc3": []})
    rc, out, err = main("wheelhouse", "build", str(inv), "--facts", str(ff), "--dry-run", "--json")
    assert rc == errors.EXIT_UNREACHABLE, err
    doc = json.loads(out)
    assert [n["host"] for n in doc["nodes"]] == ["pc2"] and doc["nodes"][0]["status"] == "unreachable"
    assert [w["status"] for w in doc["wheelhouses"]] == ["missing"]


@pytest.mark.parametrize("argv, needle", [
    (["--for", "cpu"], "name the nodes' Python once"),
    (["--for", "py3.11"], "no kind of node"),
    (["--for", "py3.11,py3.12,cpu"], "name the nodes' Python once"),
    (["--for", "py3.11,cu999"], "unknown kind of node 'cu999'"),
    (["--for", "py3.11,cc6.1@x"], "unknown kind of node"),
    (["--for", "py3,cpu"], "name the nodes' Python once"),
    (["--for", "py3.11,cpu", "-i", "x.yaml"], "--for names the nodes itself"),
    (["--extra", "tqdm"], "--torch-index and --extra go with --for"),
    (["INV", "--facts", "/nonexistent/facts.json"], "cannot read the facts"),
    (["INV", "--facts", "BADFACTS"], "not the output of `clusterctl check --json`"),
])
def test_bad_selection_is_exit_2_with_a_fix(tmp_path: Path, cache: Path, argv: list[str], needle: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": 3}')
    argv = [str(room(tmp_path)) if a == "INV" else str(bad) if a == "BADFACTS" else a for a in argv]
    rc, out, err = main("wheelhouse", "build", *argv, "--dry-run")
    assert rc == errors.EXIT_USAGE and needle in err and "fix:" in err and "Traceback" not in err, err


def test_build_dry_run_on_local_nodes_gathers_their_facts(tmp_path: Path, cache: Path) -> None:
    """With an inventory and no --facts, build reaches the nodes as provision does (two local nodes here)."""
    inv = write(tmp_path, f"""\
defaults: {{connection: local}}
hosts:
  a: {{address: 127.0.0.1, workdir: {tmp_path / 'a'}}}
  b: {{address: 127.0.0.1, workdir: {tmp_path / 'b'}}}
""")
    rc, out, err = main("wheelhouse", "build", str(inv), "--dry-run", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    (w,) = doc["wheelhouses"]
    assert w["nodes"] == ["a", "b"] and w["status"] == "missing" and doc["builds"]["backend"] == "gloo"


# --------------------------------------------------------------------------- export and import


def test_export_then_import_fills_an_offline_head_that_provision_then_uses(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole way: the connected machine's cache holds the wheelhouse provision wants for `--for
    py3.11,cpu` (made by hand here), export to a 'USB disk', import on a head whose index is a closed port;
    then `wheelhouse build` finds it cached and wheelhouse.build (provision's call) downloads nothing."""
    connected = use_cache(monkeypatch, tmp_path / "connected")
    tinv, tfacts = wheelhouse_plan.target_inventory(wheelhouse_plan.parse_targets(["py3.11,cpu"]))
    (s,) = wheelhouse_plan.select(tinv, list(tinv.hosts.values()), tfacts).sets
    made = fake_wheelhouse(connected, list(s.requirements), s.python, s.index)
    layer = fake_wheelhouse(connected, ["tabulate==0.9.0"], "3.11", constraints=("numpy==2.1.0",))
    usb = tmp_path / "usb"
    rc, out, err = main("wheelhouse", "export", str(usb), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert {w["key"] for w in doc["wheelhouses"]} == {s.key, layer.dir.parent.name}
    manifest = json.loads((usb / wheelhouse_export.EXPORT_MANIFEST).read_text())
    assert manifest["format"] == wheelhouse_export.FORMAT and manifest["platform"] == wheelhouse_export.platform_tag()
    assert f"{s.key}/manifest.json" in manifest["files"] and f"{layer.dir.parent.name}/constraints.txt" in \
        manifest["files"]
    for rel, m in manifest["files"].items():
        assert hashlib.sha256((usb / rel).read_bytes()).hexdigest() == m["sha256"], rel
    if shutil.which("sha256sum"):
        assert subprocess.run(["sha256sum", "--quiet", "-c", wheelhouse_export.SUMS], cwd=usb).returncode == 0
    # again: nothing written, everything verified in place
    rc, out, _ = main("wheelhouse", "export", str(usb), "--json")
    assert rc == 0 and json.loads(out)["copied"] == 0 and json.loads(out)["kept"] == len(manifest["files"])

    head = use_cache(monkeypatch, tmp_path / "head")
    offline_pip(monkeypatch)
    rc, out, err = main("wheelhouse", "import", str(usb), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert {w["status"] for w in doc["wheelhouses"]} == {"imported"} and doc["files"] == len(manifest["files"])
    assert not [p for p in head.iterdir() if p.name.startswith(wheelhouse_import.STAGING_PREFIX)]
    got = wheelhouse.build(list(s.requirements), s.python, s.index)  # provision's call: no pip, no network
    assert got.files == made.files and got.dir == head / s.key / "files"
    assert wheelhouse.build(["tabulate==0.9.0"], "3.11", constraints=("numpy==2.1.0",)).files == layer.files
    rc, out, err = main("wheelhouse", "build", "--for", "py3.11,cpu", "--json")
    assert rc == 0 and [w["status"] for w in json.loads(out)["wheelhouses"]] == ["cached"], err
    # importing again: already there
    rc, out, _ = main("wheelhouse", "import", str(usb), "--json")
    assert rc == 0 and {w["status"] for w in json.loads(out)["wheelhouses"]} == {"present"}


def exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int = 2) -> tuple[Path, list[str]]:
    src = use_cache(monkeypatch, tmp_path / "connected")
    keys = [fake_wheelhouse(src, [f"pkg{i}==1.0", "six==1.16.0"], "3.11").dir.parent.name for i in range(n)]
    usb = tmp_path / "usb"
    wheelhouse_export.export(usb)
    use_cache(monkeypatch, tmp_path / "head")
    return usb, keys


def assert_nothing_imported(tmp_path: Path) -> None:
    head = tmp_path / "head"
    assert not head.exists() or [p.name for p in head.iterdir()] == [], list(head.iterdir())


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "link", "manifest"])
def test_a_damaged_file_is_refused_by_name_and_nothing_is_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   damage: str) -> None:
    usb, keys = exported(tmp_path, monkeypatch)
    wheel = next((usb / keys[1] / "files").glob("pkg1-*.whl"))
    rel = f"{keys[1]}/files/{wheel.name}"
    if damage == "flip":
        data = bytearray(wheel.read_bytes())
        data[0] ^= 1
        wheel.write_bytes(bytes(data))
    elif damage == "truncate":
        wheel.write_bytes(wheel.read_bytes()[:-1])
    elif damage == "remove":
        wheel.unlink()
    elif damage == "link":
        (tmp_path / "elsewhere.whl").write_bytes(wheel.read_bytes())
        wheel.unlink()
        wheel.symlink_to(tmp_path / "elsewhere.whl")
    else:
        rel = f"{keys[1]}/manifest.json"
        (usb / rel).write_text((usb / rel).read_text() + " ")
    with pytest.raises(wheelhouse_import.ImportRefused) as e:
        wheelhouse_import.import_dir(usb)
    assert rel in e.value.message and "nothing was imported" in e.value.message
    assert [m.split(":")[0] for m in e.value.mismatches] == [rel]
    assert e.value.exit_code == errors.EXIT_FAILED and "export again" in (e.value.fix or "")
    assert_nothing_imported(tmp_path)
    rc, _, err = main("wheelhouse", "import", str(usb))
    assert rc == errors.EXIT_FAILED and rel in err and "Traceback" not in err


def test_a_mismatch_leaves_an_earlier_cache_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupted download of the same wheelhouse in the head's cache stays untouched by a refused import."""
    usb, keys = exported(tmp_path, monkeypatch, n=1)
    head = tmp_path / "head"
    (head / keys[0] / "files").mkdir(parents=True)
    (head / keys[0] / "files" / "partial.whl").write_bytes(b"half")
    next((usb / keys[0] / "files").glob("six-*.whl")).write_bytes(b"six==1.16.0 " + b"x")
    with pytest.raises(wheelhouse_import.ImportRefused):
        wheelhouse_import.import_dir(usb)
    assert sorted(p.name for p in head.iterdir()) == [keys[0]]
    assert [p.name for p in (head / keys[0] / "files").iterdir()] == ["partial.whl"]


def test_an_interrupted_download_is_replaced_a_complete_other_build_kept(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    usb, keys = exported(tmp_path, monkeypatch)
    head = tmp_path / "head"
    (head / keys[0] / "files").mkdir(parents=True)  # pip download cut short: files, no manifest
    (head / keys[0] / "files" / "partial.whl").write_bytes(b"half")
    other = fake_wheelhouse(tmp_path / "other", ["pkg1==1.0", "six==1.16.0"], "3.11", seed="built later")
    shutil.copytree(other.dir.parent, head / keys[1])
    report = wheelhouse_import.import_dir(usb)
    assert {w.entry.key: w.status for w in report.wheelhouses} == {keys[0]: "replaced", keys[1]: "kept"}
    assert wheelhouse_export.cache_entry(keys[0]) is not None
    assert not (head / keys[0] / "files" / "partial.whl").exists()
    assert wheelhouse_export.cache_entry(keys[1]).files == other.files  # type: ignore[union-attr]
    report = wheelhouse_import.import_dir(usb, replace=True)
    assert {w.entry.key: w.status for w in report.wheelhouses} == {keys[0]: "present", keys[1]: "replaced"}
    assert wheelhouse_export.cache_entry(keys[1]).files != other.files  # type: ignore[union-attr]
    assert sorted(p.name for p in head.iterdir()) == sorted(keys)


def test_an_export_cut_short_or_from_elsewhere_is_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usb, keys = exported(tmp_path, monkeypatch)
    manifest = usb / wheelhouse_export.EXPORT_MANIFEST
    doc = json.loads(manifest.read_text())
    cases: list[tuple[dict[str, Any] | None, str]] = [
        (None, "no manifest.json"),
        ({**doc, "platform": "macosx-14.0-arm64"}, "built on macosx-14.0-arm64"),
        ({**doc, "layout": 1}, "wheelhouse layout 1"),
        ({**doc, "format": "tarball"}, "not a clusterctl wheelhouse export"),
        ({**doc, "files": {**doc["files"], "../../etc/passwd": {"sha256": "0" * 64, "size": 1}}}, "no export holds"),
        ({**doc, "files": {**doc["files"], f"{keys[0]}/files/.x.whl": {"sha256": "0" * 64, "size": 1}}},
         "no export holds"),
        ({**doc, "wheelhouses": {}}, "no wheelhouses listed"),
    ]
    for new, needle in cases:
        if new is None:
            manifest.unlink()
        else:
            manifest.write_text(json.dumps(new))
        rc, _, err = main("wheelhouse", "import", str(usb))
        assert rc == errors.EXIT_USAGE and needle in err and "fix:" in err, (needle, err)
        assert_nothing_imported(tmp_path)
    # a wheelhouse folder renamed, or built with other rules: its key no longer follows from its requirements
    manifest.write_text(json.dumps(doc))
    bad = "0" * 16
    os.rename(usb / keys[0], usb / bad)
    renamed = {**doc, "wheelhouses": {bad if k == keys[0] else k: v for k, v in doc["wheelhouses"].items()},
               "files": {(bad + r[16:] if r.startswith(keys[0]) else r): m for r, m in doc["files"].items()}}
    manifest.write_text(json.dumps(renamed))
    with pytest.raises(UsageError) as e:
        wheelhouse_import.import_dir(usb)
    assert "built by another clusterctl version" in e.value.message
    assert_nothing_imported(tmp_path)


def test_import_needs_room_and_says_how_much(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usb, _ = exported(tmp_path, monkeypatch)
    monkeypatch.setattr(wheelhouse_import, "ROOM_MARGIN", 1 << 60)
    with pytest.raises(ClusterError) as e:
        wheelhouse_import.import_dir(usb)
    assert "MiB free, the import needs" in e.value.message and e.value.exit_code == errors.EXIT_FAILED
    assert [p.name for p in (tmp_path / "head").iterdir()] == []


def test_export_refuses_a_damaged_cache_and_an_empty_one(tmp_path: Path, cache: Path) -> None:
    rc, _, err = main("wheelhouse", "export", str(tmp_path / "usb"))
    assert rc == errors.EXIT_FAILED and "no complete wheelhouse to export" in err and "wheelhouse build" in err
    wh = fake_wheelhouse(cache, ["six==1.16.0"], "3.11")
    f = next(wh.dir.iterdir())
    f.write_bytes(bytes(b ^ 1 for b in f.read_bytes()))  # same size: only the sha256 tells
    with pytest.raises(ClusterError) as e:
        wheelhouse_export.export(tmp_path / "usb")
    assert str(f) in e.value.message and "the cache is damaged" in e.value.message
    assert not (tmp_path / "usb" / wheelhouse_export.EXPORT_MANIFEST).exists()
    rc, _, err = main("wheelhouse", "export", str(cache / "inside"))
    assert rc == errors.EXIT_USAGE and "overlap" in err


def test_export_of_an_inventory_takes_its_wheelhouses_only(tmp_path: Path, cache: Path) -> None:
    inv = room(tmp_path)
    ff = facts_json(tmp_path, {"pc1": [], "pc2": [], "pc3": []})
    rc, _, err = main("wheelhouse", "export", str(tmp_path / "usb"), str(inv), "--facts", str(ff))
    assert rc == errors.EXIT_FAILED and "not in the wheelhouse cache" in err and "wheelhouse build" in err
    hosts = list(loader.load(inv).hosts.values())
    nf, out = wheelhouse_plan.facts_file(ff, hosts)
    (s,) = wheelhouse_plan.select(loader.load(inv), hosts, nf, out).sets
    fake_wheelhouse(cache, list(s.requirements), s.python, s.index)
    fake_wheelhouse(cache, ["six==1.16.0"], "3.11")  # another lab's: not exported
    rc, out_, err = main("wheelhouse", "export", str(tmp_path / "usb"), str(inv), "--facts", str(ff), "--json")
    assert rc == 0, err
    assert [w["key"] for w in json.loads(out_)["wheelhouses"]] == [s.key]


# --------------------------------------------------------------------------- never a traceback


MANIFEST_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.text(max_size=20),
                            st.lists(st.text(max_size=5), max_size=2), st.dictionaries(st.text(max_size=5),
                                                                                       st.integers(), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["format", "version", "layout", "platform", "wheelhouses", "files", "file-meta",
                             "file-size", "inner-requirements", "inner-files", "inner-python"]),
       value=MANIFEST_VALUES)
def test_any_damaged_manifest_is_exit_1_or_2_never_a_traceback(tmp_path_factory: pytest.TempPathFactory,
                                                                 path: str, value: Any) -> None:
    tmp = tmp_path_factory.mktemp("fuzz")
    mp = pytest.MonkeyPatch()
    try:
        usb, keys = exported(tmp, mp, n=1)
        manifest = usb / wheelhouse_export.EXPORT_MANIFEST
        doc = json.loads(manifest.read_text())
        rel = next(r for r in doc["files"] if r.endswith(".whl"))
        if path == "file-meta":
            doc["files"][rel] = value
        elif path == "file-size":
            doc["files"][rel]["size"] = value
        elif path.startswith("inner-"):  # the wheelhouse's own manifest, with the export's sums made to match
            inner = usb / keys[0] / "manifest.json"
            d = json.loads(inner.read_text())
            d[path[6:]] = value
            inner.write_text(json.dumps(d))
            doc["files"][f"{keys[0]}/manifest.json"] = {"sha256": wheelhouse.sha256_file(inner),
                                                         "size": inner.stat().st_size}
        else:
            doc[path] = value
        manifest.write_text(json.dumps(doc))
        rc, _, err = main("wheelhouse", "import", str(usb))
        assert "Traceback" not in err and "internal error" not in err, err
        assert rc in (errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_USAGE), (rc, err)
        if rc != errors.EXIT_OK:
            assert "fix:" in err
            head = tmp / "head"
            assert not head.exists() or not [p for p in head.iterdir()]
    finally:
        mp.undo()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gpu=st.fixed_dictionaries({}, optional={"name": MANIFEST_VALUES | st.just("GTX 1080"),
                                               "driver": MANIFEST_VALUES | st.sampled_from(["580.95.05", "470", ""]),
                                               "compute_capability": MANIFEST_VALUES | st.sampled_from(
                                                   ["6.1", "x", "12.0", "99.9"])}) | MANIFEST_VALUES,
       python=MANIFEST_VALUES | st.just({"version": "3.11", "version_tuple": [3, 11, 4]}))
def test_any_facts_file_is_a_plan_or_exit_2_never_a_traceback(tmp_path_factory: pytest.TempPathFactory,
                                                               gpu: Any, python: Any) -> None:
    tmp = tmp_path_factory.mktemp("facts")
    mp = pytest.MonkeyPatch()
    try:
        use_cache(mp, tmp / "cache")
        inv = write(tmp, "hosts:\n  a: {address: 10.0.0.1}\n")
        ff = tmp / "facts.json"
        ff.write_text(json.dumps({"nodes": [{"host": "a", "facts": {"host": "a", "python": python,
                                                                    "gpus": {"gpus": [gpu]}}}]}))
        rc, _, err = main("wheelhouse", "build", str(inv), "--facts", str(ff), "--dry-run")
        assert "Traceback" not in err and "internal error" not in err, err
        assert rc in (errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_USAGE), (rc, err)
    finally:
        mp.undo()


def test_every_action_has_help_and_json() -> None:
    for action in ("build", "export", "import"):
        rc, out, _ = main("wheelhouse", action, "--help")
        assert rc == 0 and "usage: clusterctl wheelhouse" in out and "--json" in out
    rc, _, err = main("wheelhouse")
    assert rc == errors.EXIT_USAGE and "needs an action: build, export or import" in err and "fix:" in err
    rc, _, err = main("wheelhouse", "nosuch")
    assert rc == errors.EXIT_USAGE and "usage: clusterctl wheelhouse" in err


def test_planned_and_facts_types_are_what_provision_uses() -> None:
    """The facts made for `--for` targets read as a node's facts do (node_gpus, the Python minor)."""
    inv, facts = wheelhouse_plan.target_inventory(wheelhouse_plan.parse_targets(["py3.12,cc8.6@550.54.14"]))
    (h,) = inv.hosts.values()
    assert isinstance(facts[h.name], NodeFacts)
    assert apply.node_gpus(h, facts[h.name]) == [{"name": "a GPU of compute capability 8.6",
                                                  "compute_capability": "8.6", "driver": "550.54.14"}]
    sel = wheelhouse_plan.select(inv, [h], facts)
    assert [s.python for s in sel.sets] == ["3.12"]
