"""A playbook as data: its steps, read and checked from YAML (schema: docs/playbooks.md).

Errors name the file, the line and the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster import paths, yamlfile
from cluster.bounds import FileRefused, read_regular
from cluster.errors import ClusterError, UsageError

ACTIONS = ("command", "file", "template", "wheels", "pip")
STEP_KEYS = ("name", "when", "creates", "unless", *ACTIONS)
PLAYBOOKS_DIR = paths.PLAYBOOKS_DIR

UNCHANGED, CHANGED, SKIPPED, FAILED, WOULD_CHANGE = "unchanged", "changed", "skipped", "failed", "would change"


class PlaybookError(ClusterError):
    """A playbook that cannot be read or rendered: names file, line and step."""

    exit_code = UsageError.exit_code


@dataclass
class Step:
    name: str
    action: str
    spec: Any
    when: str | None
    creates: str | None
    unless: str | None
    line: int


@dataclass
class Playbook:
    path: Path
    name: str
    vars: dict[str, Any]
    steps: list[Step]


def load(path: str | Path) -> Playbook:
    p = Path(path)
    if not p.exists() and not p.suffix:
        p = PLAYBOOKS_DIR / f"{path}.yaml"
    try:
        data = yamlfile.load(read_regular(p, "give the playbook's YAML file (a regular file)",
                                          noun="a playbook").decode())
    except FileRefused as e:  # a FIFO would block, /dev/zero exhaust the memory
        raise PlaybookError(f"{p}: cannot read playbook: it {e.problem}", e.fix) from None
    except OSError as e:
        raise PlaybookError(f"{p}: cannot read playbook: {e.strerror}", "check the path") from None
    except Exception as e:  # noqa: BLE001 - yaml errors carry their own position
        raise PlaybookError(f"{p}: YAML error: {e}", "check indentation") from None
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise PlaybookError(f"{p}: a playbook is a mapping with a `steps:` list", "see docs/playbooks.md")
    for key in data:
        if key not in ("name", "description", "vars", "steps"):
            raise PlaybookError(f"{p}:{yamlfile.line_of(data, key)}: unknown key '{key}'",
                                "allowed: name, description, vars, steps")
    steps = []
    for i, raw in enumerate(data["steps"]):
        line = yamlfile.line_of(raw) or yamlfile.line_of(data, "steps") or 0
        where = f"{p}:{line}: step {i + 1}"
        if not isinstance(raw, dict) or not raw.get("name"):
            raise PlaybookError(f"{where}: every step needs a `name:`", "e.g. - name: create the venv")
        unknown = [k for k in raw if k not in STEP_KEYS]
        if unknown:
            raise PlaybookError(f"{where} '{raw['name']}': unknown key '{unknown[0]}'",
                                f"allowed: {', '.join(STEP_KEYS)}")
        actions = [k for k in ACTIONS if k in raw]
        if len(actions) != 1:
            raise PlaybookError(f"{where} '{raw['name']}': needs exactly one action, found "
                                f"{', '.join(actions) or 'none'}", f"one of: {', '.join(ACTIONS)}")
        steps.append(Step(str(raw["name"]), actions[0], raw[actions[0]], raw.get("when"), raw.get("creates"),
                          raw.get("unless"), line))
    return Playbook(p, str(data.get("name") or p.stem), dict(data.get("vars") or {}), steps)
