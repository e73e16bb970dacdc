#!/usr/bin/env bash
# Runs the test suite (unit + integration against a real simulated lab when root).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
# `--quick` first: the quick tier (CONTRIBUTING.md), ruff check then every test marked neither lab nor slow, on the
# .venv as it is: no setup, no mypy, no root, no lab, no training run; a few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=${TEST_WORKERS:-2}
if [ "${1:-}" = "--quick" ]; then
  shift
  [ -x .venv/bin/ruff ] || { echo "test.sh --quick: no .venv/bin/ruff: run 'bash scripts/setup.sh' once" >&2; exit 2; }
  .venv/bin/ruff check --quiet .
  par=()
  [ "$workers" = "0" ] || par=(-n "$workers")  # test by test (--dist load): these modules share no lab
  exec .venv/bin/python -m pytest -q --durations=10 -m "not lab and not slow" "${par[@]}" "$@"
fi
bash scripts/setup.sh
# Types and lint first (a minute, strict, the training programs included: pyproject's [tool.mypy] and
# [tool.ruff]), then the tests.
.venv/bin/mypy
.venv/bin/ruff check --quiet .
# pytest exits 5 when it collected no test: that is a failure here, as any non-zero code is.
# The slowest tests are listed at the end, so the suite's budget (60 min in CI) can be kept with data.
# Two workers (pytest-xdist), a whole module to each (--dist loadfile): a module's lab is shared by its tests and
# each lab has its own name, subnet and ports, so two modules' labs run side by side; much of a lab test's time
# is waiting (SSH, a grace, Slurm marking a node down), which the other worker fills. TEST_WORKERS=0: one process.
par=()
[ "$workers" = "0" ] || par=(-n "$workers" --dist loadfile)
exec .venv/bin/python -m pytest -ra --durations=40 "${par[@]}" "$@"
