#!/usr/bin/env bash
# Runs the test suite (unit + integration against a real simulated lab when root).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Types first (a minute, strict, the training programs included: pyproject's [tool.mypy]), then the tests.
.venv/bin/mypy
# pytest exits 5 when it collected no test: that is a failure here, as any non-zero code is.
# The slowest tests are listed at the end, so the suite's budget (60 min in CI) can be kept with data.
# Two workers (pytest-xdist), a whole module to each (--dist loadfile): a module's lab is shared by its tests and
# each lab has its own name, subnet and ports, so two modules' labs run side by side; much of a lab test's time
# is waiting (SSH, a grace, Slurm marking a node down), which the other worker fills. TEST_WORKERS=0: one process.
workers=${TEST_WORKERS:-2}
par=()
[ "$workers" = "0" ] || par=(-n "$workers" --dist loadfile)
exec .venv/bin/python -m pytest -ra --durations=40 "${par[@]}" "$@"
