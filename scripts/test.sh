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
exec .venv/bin/python -m pytest -ra --durations=40 "$@"
