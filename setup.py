"""The one build step pyproject.toml cannot say: the clone's top-level data folders go into the wheel.

jobs/ (the built-in job specs), playbooks/ (the provision playbook), templates/ (what steps and launches render) and
inventory/ (the examples, local.yaml the embedded default) live at the top of the repository, where
people edit them and the docs link them. A wheel built from the clone or from its sdist (MANIFEST.in
grafts them) carries each as package data, cluster/_data/<folder>/, which cluster.paths finds in an
installed clusterctl; an editable install and the tests read the clone's folders themselves.
"""
from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DATA_FOLDERS = ("jobs", "playbooks", "templates", "inventory")  # cluster/paths.py DATA_FOLDERS: the same four
ROOT = Path(__file__).resolve().parent


def data_files() -> list[tuple[Path, Path]]:
    """(source in the clone, path inside the package) for every file of the data folders."""
    out = []
    for name in DATA_FOLDERS:
        for src in sorted((ROOT / name).rglob("*")):
            if src.is_file() and "__pycache__" not in src.parts and not src.name.endswith((".pyc", "~")):
                out.append((src, Path("_data", name, src.relative_to(ROOT / name))))
    return out


class BuildPyWithData(build_py):
    """build_py, then the data folders copied under cluster/_data/ in the build tree (what the wheel packs).
    An editable install skips them: it runs from the clone, which has them at the top."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for src, rel in data_files():
            dest = Path(self.build_lib, "cluster", rel)
            self.mkpath(str(dest.parent))
            self.copy_file(str(src), str(dest))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:  # type: ignore[override]
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs += [str(Path(self.build_lib, "cluster", rel)) for _, rel in data_files()]
        return outputs


setup(cmdclass={"build_py": BuildPyWithData})
