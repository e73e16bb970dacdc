"""A built wheel of clusterctl works without the clone: `pip install` of it in a fresh venv, then the CLI run
from a folder outside the clone finds its job specs, playbooks, templates and inventories inside the installed package.

The wheel is built offline from a copy of the working tree (setuptools is in the project's venv); the fresh
venv sees the project's installed dependencies through a .pth file (no download), but not the clone: the
tests check that `cluster` is imported from the fresh venv's site-packages.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from cluster import paths
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # builds the wheel and a venv: left out of the quick tier

# what the clone holds that the wheel must carry: its data folders (under cluster/_data/) and the node-side programs
DATA = paths.DATA_FOLDERS
_EVERYWHERE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
_AT_TOP = {".venv", ".git", "build", "dist", ".mypy_cache", ".hypothesis", ".pytest_cache", "runs", ".clusterctl"}


def _ignore(folder: str, names: list[str]) -> set[str]:
    """What the copy of the clone leaves out: caches anywhere, the clone's own venv, git and outputs at its top."""
    return set(_EVERYWHERE(folder, names)) | (_AT_TOP & set(names) if Path(folder) == ROOT else set())


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without pip's configuration (no local index, find-links or constraints) or a path
    that leads back into the clone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env.update(extra)
    return env


def repo_files(folder: str) -> list[str]:
    base = ROOT / folder
    return sorted(str(p.relative_to(base)) for p in base.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc"))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the source copy it was built from): built from a copy so the clone gets no build/ folder."""
    work = tmp_path_factory.mktemp("wheelbuild")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=_ignore)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-w", str(work / "dist"), str(src)], capture_output=True, text=True, env=_clean_env(),
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheels = list((work / "dist").glob("clusterctl-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], src


def test_the_wheel_holds_every_playbook_template_inventory_and_workload(built: tuple[Path, Path]) -> None:
    names = set(zipfile.ZipFile(built[0]).namelist())
    for folder in DATA:
        files = repo_files(folder)
        assert files, folder
        missing = [f for f in files if f"cluster/_data/{folder}/{f}" not in names]
        assert not missing, f"{folder}/ files left out of the wheel: {missing}"
    node_side = [f"cluster/{d}/{f}" for d in ("agent", "programs") for f in repo_files(f"cluster/{d}")]
    assert "cluster/programs/train_torch.py" in node_side and "cluster/agent/nodeagent.py" in node_side
    assert not [f for f in node_side if f not in names]
    modules = [f"cluster/{f}" for f in repo_files("cluster") if f.endswith(".py")]
    assert not [m for m in modules if m not in names], "modules left out of the wheel"
    assert not [n for n in names if n.startswith(("jobs/", "playbooks/", "templates/", "inventory/", "tests/"))]


def test_the_sdist_carries_the_data_folders(built: tuple[Path, Path], tmp_path: Path) -> None:
    """`python -m build` makes the wheel from the sdist: the folders must be in it (MANIFEST.in)."""
    src = built[1]
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "print(b.build_sdist(sys.argv[1]))", str(tmp_path)], cwd=src, capture_output=True,
                       text=True, env=_clean_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    sdist = tmp_path / r.stdout.strip().splitlines()[-1]
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    for folder in DATA:
        assert not [f for f in repo_files(folder) if f"{folder}/{f}" not in names], folder
    assert "setup.py" in names and "MANIFEST.in" in names


@pytest.fixture(scope="module")
def venv(built: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel pip-installed in it; dependencies from the project's venv (a .pth file)."""
    env_dir = tmp_path_factory.mktemp("freshvenv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    py = env_dir / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                        "--disable-pip-version-check", str(built[0])], capture_output=True, text=True,
                       env=_clean_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, env=_clean_env()).stdout.strip())
    # the project's dependencies (paramiko, rich, jinja2, ...): their folder is added to sys.path, but its .pth
    # files (the clone's editable finder among them) are not run: only a site dir's own .pth files are
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_clusterctl_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return env_dir


def run_installed(venv: Path, cwd: Path, *args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    home = home or cwd / "home"
    env = _clean_env(HOME=str(home), CLUSTERCTL_HOME=str(home / ".clusterctl"),
                     PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", COLUMNS="200")
    return subprocess.run([str(venv / "bin" / "clusterctl"), *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=180)


def test_cluster_is_imported_from_the_fresh_venv_not_the_clone(venv: Path, tmp_path: Path) -> None:
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        "import json, cluster, cluster.paths as p; print(json.dumps([cluster.__file__, "
                        "str(p.PLAYBOOKS_DIR), str(p.TEMPLATES_DIR), str(p.LOCAL_INVENTORY), str(p.JOBS_DIR)]))"],
                       cwd=tmp_path, capture_output=True, text=True, env=_clean_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    where = [Path(p) for p in json.loads(r.stdout)]
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, env=_clean_env()).stdout.strip())
    for p in where:
        assert site.resolve() in p.resolve().parents, f"{p} is not in the fresh venv ({site})"
        assert ROOT not in p.resolve().parents
    assert where[1] == site / "cluster" / "_data" / "playbooks" and where[3].is_file()
    assert where[4] == site / "cluster" / "_data" / "jobs" and (where[4] / "resnet50-ddp.yaml").is_file()


def test_help_from_outside_the_clone(venv: Path, tmp_path: Path) -> None:
    r = run_installed(venv, tmp_path, "--help")
    assert r.returncode == 0 and "usage: clusterctl" in r.stdout and "wheelhouse" in r.stdout
    r = run_installed(venv, tmp_path, "wheelhouse", "import", "--help")
    assert r.returncode == 0 and "sha256" in r.stdout


def local_nodes(tmp_path: Path) -> tuple[Path, Path]:
    """inventory/local.yaml copied out of the clone, its two nodes (workdirs under HOME) given a verified
    environment as provision records it, so that `launch --dry-run` renders."""
    inv = tmp_path / "local.yaml"
    shutil.copy(ROOT / "inventory" / "local.yaml", inv)
    home = tmp_path / "home"
    for n in (1, 2):
        wd = home / ".clusterctl" / "local" / f"node{n}"
        (wd / "clusterctl").mkdir(parents=True)
        (wd / "clusterctl" / "state.json").write_text(json.dumps(
            {"fingerprint": {"torch": "2.14.1", "python": "3.11.7"}, "build": {"backend": "gloo", "gpu": None}}))
        (wd / "cluster.env").write_text("CLUSTER_PYTHON=python3\nexport CLUSTER_PYTHON\n")
    return inv, home


def test_launch_dry_run_renders_from_the_installed_package(venv: Path, tmp_path: Path) -> None:
    """The job spec (jobs/), the launch templates (templates/) and the training program (cluster/programs) all
    come from the installed wheel."""
    inv, home = local_nodes(tmp_path)
    r = run_installed(venv, tmp_path, "launch", "resnet50-ddp", "--dry-run", "-i", str(inv), home=home)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "launch.sh" in r.stdout and "torchrun" in r.stdout and "local2" in r.stdout
    r = run_installed(venv, tmp_path, "launch", "resnet50-ddp", "--dry-run", "--json", "-i", str(inv), home=home)
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(ROOT) not in r.stdout + r.stderr


def test_provision_dry_run_and_the_embedded_inventory_from_the_installed_package(venv: Path, tmp_path: Path) -> None:
    """provision renders the playbook and its templates; with no inventory and no context, commands use the
    local.yaml shipped in the package."""
    inv, home = local_nodes(tmp_path)
    r = run_installed(venv, tmp_path, "provision", str(inv), "--dry-run", "--json", home=home)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    steps = {s["name"] for n in json.loads(r.stdout)["nodes"] for s in n["steps"]}
    assert steps, "no playbook steps rendered"
    r = run_installed(venv, tmp_path, "exec", "--json", "--", "true", home=home)
    assert r.returncode == 0 and "embedded default" in r.stderr, r.stderr
    assert str(ROOT) not in r.stderr and "_data/inventory/local.yaml" in r.stderr
