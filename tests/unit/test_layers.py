"""The stages import only downwards (docs/architecture.md, "Layers"), and no module imports itself in a circle.

Every import counts: module level, inside functions, and under TYPE_CHECKING (a type-only import is a
dependency too: it breaks the day it is needed at run time).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

# The stages from the bottom up; a stage may import the ones below it. The same table is in
# docs/architecture.md. Three stand apart: `lab` (the simulated lab: the base only, and only the CLI imports
# it), `agent` and `programs` (code that runs on the nodes: nothing of the head's library, not even the base;
# the head may import them, as files it ships and for their defaults).
ORDER = ("base", "inventory", "transport", "nodes", "relay", "provision", "room", "runs", "slurm", "schedulers", "planner",
         "study", "cli")
NODE_SIDE = ("agent", "programs")  # code that runs on the nodes: nothing of the head's library, not even the base
BASE = frozenset({"errors", "paths", "yamlfile", "bounds"})
ALLOWED: dict[str, frozenset[str]] = {s: frozenset(ORDER[:i]) for i, s in enumerate(ORDER)}
ALLOWED = {**ALLOWED, "lab": frozenset({"base"}), "agent": frozenset(), "programs": frozenset(),
           **{s: ALLOWED[s] | set(NODE_SIDE) for s in ("runs", "slurm", "schedulers", "planner", "study")},
           "cli": ALLOWED["cli"] | {"lab", *NODE_SIDE}}


def stage_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in BASE or parts[1] == "__init__":
        return "base"
    return "cli" if parts[1] == "__main__" else parts[1]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, path: Path) -> set[str]:
    """The cluster modules `path` imports, wherever the import statement stands."""
    def exists(mod: str) -> bool:
        p = root.joinpath(*mod.split("."))
        return p.with_suffix(".py").exists() or (p / "__init__.py").exists()

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import (write the full cluster.* path)")
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                 if isinstance(node, ast.ImportFrom) and node.module else [])
        found |= {n for n in names if n.split(".")[0] == "cluster" and exists(n)}
    return found


def graph(root: Path) -> dict[str, set[str]]:
    return {module_name(root, p): imports(root, p) for p in sorted((root / "cluster").rglob("*.py"))}


def violations(g: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(g.items()):
        s = stage_of(mod)
        for d in sorted(deps):
            t = stage_of(d)
            if t != s and t not in ALLOWED[s]:
                out.append(f"{mod} ({s}) imports {d} ({t})")
            if s in NODE_SIDE and t != s:
                out.append(f"{mod} ({s}) imports {d}")
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle between modules (a package's __init__ counts as a module)."""
    found, state, stack = [], {}, []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(g.get(u, ())):
            if v == u:
                continue
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif not state.get(v):
                visit(v)
        stack.pop()
        state[u] = 2

    for u in sorted(g):
        if not state.get(u):
            visit(u)
    return found


# What the CLI may import of the stages that run jobs: a run's record, its job, and the summaries it prints;
# everything a run does on its target goes through the scheduler interface (cluster/schedulers/api.py), so a
# target's own modules (launch, state, watch, elastic, logstream; cluster/slurm) are never the CLI's.
CLI_MAY_IMPORT_OF_RUNS = frozenset({"cluster.runs", "cluster.runs.records", "cluster.runs.jobs", "cluster.runs.collect",
                                    "cluster.runs.carryover", "cluster.schedulers", "cluster.schedulers.api",
                                    "cluster.schedulers.interface"})


def test_the_cli_reaches_a_run_only_through_its_scheduler() -> None:
    g = graph(ROOT)
    found = sorted((m, d) for m, deps in g.items() if stage_of(m) == "cli" for d in deps
                   if stage_of(d) in ("runs", "slurm", "schedulers") and d not in CLI_MAY_IMPORT_OF_RUNS)
    assert found == [], f"the CLI imports a scheduler's own module: {found}"


def test_every_module_belongs_to_a_known_stage() -> None:
    unknown = sorted({stage_of(m) for m in graph(ROOT)} - set(ALLOWED))
    assert not unknown, f"add these to ALLOWED (and to docs/architecture.md): {unknown}"


def test_the_stages_import_only_downwards() -> None:
    assert violations(graph(ROOT)) == []


def test_no_import_circle() -> None:
    assert cycles(graph(ROOT)) == []


def test_only_the_base_stays_at_the_top() -> None:
    top = sorted(p.stem for p in (ROOT / "cluster").glob("*.py"))
    assert top == sorted({"__init__", "__main__", *BASE})


def test_every_stage_says_what_it_takes_gives_and_must_not_import() -> None:
    for pkg in (ROOT / "cluster").iterdir():
        init = pkg / "__init__.py"
        if init.exists():
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            if pkg.name in ("cli", "transport"):
                assert doc, f"{init}: no docstring"
                continue
            for words in ("Takes in:", "Gives out:", "Must never import:"):
                assert words in doc, f"{init}: its docstring lacks {words!r}"


@pytest.mark.parametrize("upward, circle", [(True, False), (False, True)])
def test_the_checks_find_an_upward_import_and_a_circle(tmp_path: Path, upward: bool, circle: bool) -> None:
    """The checker on a tree of its own, so that it is known to fail when it should."""
    for rel in ("cluster/__init__.py", "cluster/errors.py", "cluster/nodes/__init__.py", "cluster/runs/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "cluster/nodes/facts.py").write_text(
        "def f():\n    from cluster.runs import launch\n" if upward else "from cluster.nodes import health\n")
    (tmp_path / "cluster/nodes/health.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cluster.nodes import facts\n" if circle else "")
    (tmp_path / "cluster/runs/launch.py").write_text(
        "from cluster import errors\n" + ("" if upward else "from cluster.nodes import facts\n"))
    g = graph(tmp_path)
    assert bool(violations(g)) is upward
    assert bool(cycles(g)) is circle


def test_no_module_of_the_package_is_over_450_lines() -> None:
    """One module per concept: a module that outgrows 450 lines holds two and is split (CONTRIBUTING.md)."""
    from cluster import paths

    long = {str(p.relative_to(paths.PACKAGE_DIR)): n for p in sorted(paths.PACKAGE_DIR.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
