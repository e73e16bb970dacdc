"""Playbooks: ordered, idempotent steps run on a node (schema: docs/playbooks.md).

A step has a name, one action (command, file, template, push, pip), an optional
`when` (a jinja expression on vars/facts/build) and guards (`creates`, `unless`)
that make a step already done report `unchanged`. Values come from jinja2 with
StrictUndefined; in shell fields every `{{ value }}` is shell-quoted on output.
The steps as data are in cluster.provision.model, rendering in cluster.provision.render, the actions in
cluster.provision.actions; this module runs them, or renders them without running (`render_steps`).
"""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.errors import ClusterError, TransportError
from cluster.provision.actions import ACTIONS as _ACTIONS
from cluster.provision.actions import file_spec, remote_sha256, sha256
from cluster.provision.model import (
    ACTIONS,
    CHANGED,
    FAILED,
    PLAYBOOKS_DIR,
    SKIPPED,
    STEP_KEYS,
    UNCHANGED,
    WOULD_CHANGE,
    Playbook,
    PlaybookError,
    Step,
    load,
)
from cluster.provision.render import SCRIPT_ENV, SHELL_ENV, TEMPLATES_DIR, TEXT_ENV, Raw, Renderer
from cluster.transport import Transport

__all__ = ["ACTIONS", "CHANGED", "FAILED", "PLAYBOOKS_DIR", "SCRIPT_ENV", "SHELL_ENV", "SKIPPED", "STEP_KEYS",
           "TEMPLATES_DIR", "TEXT_ENV", "UNCHANGED", "WOULD_CHANGE", "Playbook", "PlaybookError", "PlaybookRun",
           "Raw", "RenderedStep", "Renderer", "Step", "StepResult", "load", "remote_sha256", "render_steps", "run",
           "run_step", "sha256"]


@dataclass
class StepResult:
    name: str
    status: str
    duration: float
    detail: str = ""
    unreachable: bool = False  # failed because the connection to the node was lost, not by the step itself

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "duration": round(self.duration, 3), "detail": self.detail,
                "unreachable": self.unreachable}


@dataclass
class PlaybookRun:
    host: str
    steps: list[StepResult] = field(default_factory=list)

    @property
    def failed(self) -> StepResult | None:
        return next((s for s in self.steps if s.status == FAILED), None)

    @property
    def changed(self) -> int:
        return sum(s.status in (CHANGED, WOULD_CHANGE) for s in self.steps)


def run_step(t: Transport, r: Renderer, step: Step, dry: bool) -> StepResult:
    start = time.monotonic()
    try:
        if not r.condition(step):
            return StepResult(step.name, SKIPPED, time.monotonic() - start, f"when: {step.when}")
        if step.creates is not None:
            path = r.text(step, step.creates, "creates")
            if t.run(f"test -e {shlex.quote(path)}", timeout=60).exit_code == 0:
                return StepResult(step.name, UNCHANGED, time.monotonic() - start, f"{path} exists")
        if step.unless is not None:
            check = r.shell(step, step.unless, "unless")
            if t.run(check, timeout=300).exit_code == 0:
                return StepResult(step.name, UNCHANGED, time.monotonic() - start, "check passed")
        status, detail = _ACTIONS[step.action](t, r, step, dry)
        return StepResult(step.name, status, time.monotonic() - start, detail)
    except PlaybookError:
        raise
    except TransportError as e:  # the node went away mid-step: the caller counts it unreachable
        return StepResult(step.name, FAILED, time.monotonic() - start, str(e), unreachable=True)
    except ClusterError as e:
        return StepResult(step.name, FAILED, time.monotonic() - start, str(e))


def run(t: Transport, pb: Playbook, context: dict[str, Any], dry: bool = False,
        on_step: Callable[[str, StepResult], None] | None = None) -> PlaybookRun:
    """All steps in order on one node; stops at the first failed step (later ones depend on it)."""
    r = Renderer(pb, context)
    out = PlaybookRun(t.host.name)
    for step in pb.steps:
        res = run_step(t, r, step, dry)
        out.steps.append(res)
        if on_step:
            on_step(t.host.name, res)
        if res.status == FAILED:
            break
    return out


# --------------------------------------------------------------------------- shown, not run


@dataclass
class RenderedStep:
    """One step as it would run on one node, rendered without contacting it (`provision --dry-run`, goldens).
    Guards (`creates`, `unless`) are shown, not checked: whether a step is already done needs the node."""

    name: str
    action: str
    runs: bool  # False: its `when` is false on this node
    when: str | None = None
    creates: str | None = None
    unless: str | None = None
    command: str | None = None  # command: the exact shell line
    dest: str | None = None  # file, template, wheels
    mode: str | None = None  # file, template: octal
    source: str | None = None  # template: its file in templates/; file: the content as written in the playbook
    content: str | None = None  # template: the rendered text
    spec: dict[str, Any] | None = None  # pip: venv, wheelhouse, index

    def to_text(self) -> str:
        """A few stable lines per step (the golden file's format)."""
        lines = [f"- {self.name} [{self.action}]" + ("" if self.runs else f" skipped (when: {self.when})")]
        if not self.runs:
            return lines[0]
        fields = [(k, getattr(self, k)) for k in ("when", "creates", "unless", "command", "dest", "mode", "source")]
        for key, value in fields + list((self.spec or {}).items()):
            if value is not None:
                lines.append(f"    {key}: {value if value != '' else repr(value)}")
        return "\n".join(lines)


def render_steps(pb: Playbook, context: dict[str, Any]) -> list[RenderedStep]:
    """Every step of `pb` for the node `context` describes, rendered as `run` would, nothing run."""
    r = Renderer(pb, context)
    out = []
    for step in pb.steps:
        if not r.condition(step):
            out.append(RenderedStep(step.name, step.action, False, when=str(step.when)))
            continue
        rs = RenderedStep(step.name, step.action, True, when=None if step.when is None else str(step.when),
                          creates=None if step.creates is None else str(r.text(step, step.creates, "creates")),
                          unless=None if step.unless is None else r.shell(step, step.unless, "unless"))
        _render_action(r, step, rs)
        out.append(rs)
    return out


def _render_action(r: Renderer, step: Step, rs: RenderedStep) -> None:
    if step.action == "command":
        rs.command = r.shell(step, step.spec, "command")
    elif step.action in ("file", "template", "wheels"):
        dest, mode = file_spec(r, step)
        rs.dest = dest
        if step.action != "wheels":
            rs.mode = f"{mode:o}"
        if step.action == "template":
            rs.source = str(step.spec.get("src"))
            rs.content = r.template(step, rs.source)
        elif step.action == "file":
            rs.source = str(step.spec.get("content", ""))
    else:
        spec = r.text(step, step.spec, step.action)
        rs.spec = dict(spec) if isinstance(spec, dict) else {"value": spec}
