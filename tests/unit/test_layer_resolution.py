"""A job's requirements resolved over the provisioned environment: the layer is what the environment lacks, and
only its wheels reach the head's wheelhouse (never torch or CUDA); the program folder's requirements.txt is used
unless others, or `none`, are named.

tests/fixtures/pip_report/lightning.json is what wheelhouse.resolution(["lightning"], "3.11", constraints)
returned over an environment with torch 2.14.1 and its CUDA 13 wheels (`base`: its packages, constraints
`name==version` from it), each entry's metadata cut to name, version and requires_dist. The tests that resolve
for real read the package index, as tests/unit/test_wheelhouse.py does."""
from __future__ import annotations

import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from cluster.provision import wheelhouse
from cluster.runs import jobs, layers
from cluster.runs.schema import JobError
from tests.conftest import ROOT

REPORT = json.loads((ROOT / "tests" / "fixtures" / "pip_report" / "lightning.json").read_text())
LIGHTNING_LAYER = ["aiohappyeyeballs", "aiohttp", "aiosignal", "attrs", "frozenlist", "lightning",
                   "lightning-utilities", "multidict", "propcache", "pytorch-lightning", "torchmetrics", "tqdm", "yarl"]
SAID = "using requirements.txt from the program folder; `--requirements none` skips it"
PY = "%d.%d" % sys.version_info[:2]


def names(entries: list[dict[str, Any]]) -> list[str]:
    return sorted(wheelhouse.normalize(e["metadata"]["name"]) for e in entries)


def test_the_layer_is_what_the_environment_lacks_never_torch_or_its_cuda_wheels() -> None:
    """pip's report lists torch, triton and 17 CUDA wheels (it resolved them, from metadata only); the layer
    keeps lightning's own dependencies, aiohttp's family included: fsspec is in the environment, but
    lightning asks for fsspec[http], whose extra the environment lacks."""
    install, base = REPORT["install"], REPORT["base"]
    assert {"torch", "triton", "nvidia-cublas", "numpy", "fsspec"} <= set(names(install))  # what pip resolved
    assert names(layers.needed(install, base)) == LIGHTNING_LAYER
    assert layers.clashes(install, base) == []
    with_aiohttp = {**base, **{n: e["metadata"]["version"] for n, e in
                               ((wheelhouse.normalize(e["metadata"]["name"]), e) for e in install) if n == "aiohttp"}}
    assert "aiohttp" not in names(layers.needed(install, with_aiohttp))  # one the environment has stays out


def test_a_cpu_torch_environment_gets_none_of_the_cuda_wheels_pip_lists_for_torch() -> None:
    """An environment with torch 2.14.1+cpu and no CUDA wheels: the same resolution (pip read PyPI's torch, whose
    metadata names CUDA wheels) gives the same layer: torch's dependencies are the environment's business,
    and 2.14.1+cpu is release 2.14.1 (no clash)."""
    base = {n: v for n, v in REPORT["base"].items() if not n.startswith(("nvidia-", "cuda-", "triton"))}
    base["torch"] = "2.14.1+cpu"
    assert names(layers.needed(REPORT["install"], base)) == LIGHTNING_LAYER
    assert layers.clashes(REPORT["install"], base) == []


def test_a_package_the_environment_has_at_another_release_is_named_with_both_versions() -> None:
    base = {**REPORT["base"], "torch": "2.13.0+cu126", "tqdm": "4.60.0"}  # tqdm: now in the environment, older
    assert layers.clashes(REPORT["install"], base) == ["torch==2.14.1 would replace torch==2.13.0+cu126",
                                                       "tqdm==4.70.1 would replace tqdm==4.60.0"]


def test_the_program_folders_requirements_txt_is_used_unless_others_or_none_are_named(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "extra.txt").write_text("tqdm\n")
    argv = ["python", "train.py"]
    assert jobs.from_command(argv, tmp_path)["requirements"] is None  # none in the folder: none
    (tmp_path / "requirements.txt").write_text("tabulate==0.9.0\n")
    spec = jobs.from_command(argv, tmp_path)
    assert spec["requirements"] == "requirements.txt" and layers.requirements(spec) == ["tabulate==0.9.0"]
    assert jobs.from_command(argv, tmp_path, overrides=["requirements=none"])["requirements"] is None
    assert jobs.from_command(argv, tmp_path, overrides=["requirements=extra.txt"])["requirements"] == "extra.txt"
    assert jobs.from_command(argv, tmp_path, overrides=["requirements=[tqdm]"])["requirements"] == ["tqdm"]


def environment() -> dict[str, str]:
    """This interpreter's packages, as layers.base_environment reads a node's (the lab's nodes run it too)."""
    return {wheelhouse.normalize(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def stored_bytes(root: Path) -> int:
    """What the folder takes on disk, a hard-linked file once (as `du` counts)."""
    seen: dict[tuple[int, int], int] = {}
    for d, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(d, f))
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def test_a_requirement_on_torch_adds_only_its_own_wheels_to_the_heads_wheelhouse(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchmetrics needs torch and numpy, which the environment has: resolved for real, the wheelhouse gets
    torchmetrics and lightning-utilities (about 1 MB; pip download of the resolution took torch and CUDA, 2.9 GB).
    A second set naming the same wheels stores them once; the same set again needs no index."""
    base = environment()
    if "torch" not in base:
        pytest.skip("this interpreter has no torch: install the project with its `torch` extra")
    wh = tmp_path / "wh"
    monkeypatch.setenv("CLUSTERCTL_WHEELHOUSE", str(wh))
    (tmp_path / "train.py").write_text("import torchmetrics\n")
    spec = jobs.from_command(["python", "train.py"], tmp_path, overrides=["requirements=[torchmetrics==1.9.0]"])
    layer = layers.resolve(spec, PY, base)
    assert layer is not None and "torchmetrics==1.9.0" in layer.lock.split(), layer
    assert not {wheelhouse.wheel_pin(f)[0] for f in layer.wheels.files} & set(base), layer.lock  # torch, numpy: not
    grown = stored_bytes(wh)
    assert 0 < grown < 100 * 2**20, f"{grown / 2**20:.0f} MiB in the wheelhouse for {layer.lock.split()}"
    store = sorted(p.name for p in (wh / wheelhouse.LAYER_STORE).iterdir())

    both = jobs.from_command(["python", "train.py"], tmp_path,
                             overrides=["requirements=[torchmetrics==1.9.0, lightning-utilities]"])
    said: list[str] = []
    again = layers.resolve(both, PY, base, log=said.append)
    assert again is not None and again.lock == layer.lock and again.wheels.dir != layer.wheels.dir
    assert not [s for s in said if s.startswith("downloading")], said  # every wheel already in the store
    assert sorted(p.name for p in (wh / wheelhouse.LAYER_STORE).iterdir()) == store
    assert stored_bytes(wh) - grown < 64 * 1024  # a manifest and a constraints file more, no wheel twice

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the same set again: from the cache, pip is not asked
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    assert layers.resolve(spec, PY, base) == layer


def test_an_unresolvable_requirements_txt_is_refused_naming_requirements_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERCTL_WHEELHOUSE", str(tmp_path / "wh"))
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "requirements.txt").write_text("nosuch-package-clusterctl-test==1.0\n")
    said: list[str] = []
    with pytest.raises(JobError) as e:
        layers.resolve(jobs.from_command(["python", "train.py"], tmp_path), PY, environment(), log=said.append)
    assert said[0] == SAID, said
    assert e.value.field == "requirements" and "nosuch-package-clusterctl-test" in str(e.value), str(e.value)
    assert "`--requirements none`" in (e.value.fix or ""), e.value.fix
