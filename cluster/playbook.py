"""Playbooks: ordered, idempotent steps run on a node (schema: docs/playbooks.md).

A step has a name, one action (command, file, template, push, pip), an optional
`when` (a jinja expression on vars/facts/build) and guards (`creates`, `unless`)
that make a step already done report `unchanged`. Values come from jinja2 with
StrictUndefined; in shell fields every `{{ value }}` is shell-quoted on output.
"""
from __future__ import annotations

import hashlib
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jinja2

from cluster import paths, wheelhouse, yamlfile
from cluster.errors import ClusterError, TransportError, UsageError
from cluster.replies import error_tail
from cluster.transport import Transport

ACTIONS = ("command", "file", "template", "wheels", "pip")
STEP_KEYS = ("name", "when", "creates", "unless", *ACTIONS)
TEMPLATES_DIR = paths.PROJECT_ROOT / "templates"
PLAYBOOKS_DIR = paths.PROJECT_ROOT / "playbooks"

UNCHANGED, CHANGED, SKIPPED, FAILED, WOULD_CHANGE = "unchanged", "changed", "skipped", "failed", "would change"


class PlaybookError(ClusterError):
    """A playbook that cannot be read or rendered: names file, line and step."""

    exit_code = UsageError.exit_code


class Raw(str):
    """A value that goes into a shell field as it is (`{{ x | raw }}`): for trusted fragments only."""


def _shell_finalize(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    return shlex.quote(str(value))


def _env(quote: bool, trim: bool = False) -> jinja2.Environment:
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
        trim_blocks=trim, lstrip_blocks=trim,
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        finalize=_shell_finalize if quote else None,
    )
    env.filters["raw"] = Raw
    env.filters["q"] = shlex.quote
    return env


SHELL_ENV, TEXT_ENV = _env(True), _env(False)
SCRIPT_ENV = _env(True, trim=True)  # whole shell scripts (launch files): block tags leave no blank lines


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
        data = yamlfile.load(p.read_text())
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


class Renderer:
    """Renders a playbook's values for one node; errors name playbook, step and line."""

    def __init__(self, pb: Playbook, context: dict[str, Any]) -> None:
        self.pb = pb
        self.ctx = dict(context)
        # playbook vars may refer to each other and to the context, in order
        merged_vars = dict(self.ctx.get("vars", {}))
        for k, v in pb.vars.items():
            if k not in merged_vars:  # inventory vars win over playbook defaults
                merged_vars[k] = self._render(v, None, f"vars.{k}", quote=False, extra=merged_vars)
        self.ctx["vars"] = merged_vars
        self.ctx.update({k: v for k, v in merged_vars.items() if k not in self.ctx})

    def _render(self, value: Any, step: Step | None, what: str, quote: bool,
                extra: dict[str, Any] | None = None) -> Any:
        if isinstance(value, dict):
            return {k: self._render(v, step, f"{what}.{k}", quote, extra) for k, v in value.items()}
        if isinstance(value, list):
            return [self._render(v, step, what, quote, extra) for v in value]
        if not isinstance(value, str):
            return value
        ctx = {**self.ctx, **(extra or {})}
        try:
            return (SHELL_ENV if quote else TEXT_ENV).from_string(value).render(ctx)
        except jinja2.TemplateError as e:
            raise self.error(step, f"{what}: {e.message if hasattr(e, 'message') else e}") from None

    def error(self, step: Step | None, msg: str) -> PlaybookError:
        where = f"{self.pb.path}:{step.line}: step '{step.name}'" if step else f"{self.pb.path}"
        return PlaybookError(f"{where}: {msg}", "check the value's name against docs/playbooks.md "
                             "(vars, host, facts, build)")

    def shell(self, step: Step, value: str, what: str) -> str:
        return self._render(value, step, what, quote=True)

    def text(self, step: Step, value: Any, what: str) -> Any:
        return self._render(value, step, what, quote=False)

    def condition(self, step: Step) -> bool:
        if step.when is None:
            return True
        if isinstance(step.when, bool):
            return step.when
        try:
            return bool(TEXT_ENV.compile_expression(str(step.when), undefined_to_none=False)(self.ctx))
        except jinja2.TemplateError as e:
            raise self.error(step, f"when: {e}") from None

    def template(self, step: Step, src: str) -> str:
        try:
            return TEXT_ENV.get_template(src).render(self.ctx)
        except jinja2.TemplateNotFound:
            raise self.error(step, f"template {src} not found in {TEMPLATES_DIR}") from None
        except jinja2.TemplateError as e:
            line = getattr(e, "lineno", None)
            raise self.error(step, f"template {src}{f':{line}' if line else ''}: {e}") from None


# --------------------------------------------------------------------------- actions


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def remote_sha256(t: Transport, path: str) -> str | None:
    r = t.run(f"sha256sum -- {shlex.quote(path)} 2>/dev/null || true", timeout=120)
    return r.stdout.split()[0] if r.stdout.strip() else None


def _put_if_changed(t: Transport, data: bytes, dest: str, mode: int, dry: bool) -> str:
    if remote_sha256(t, dest) == sha256(data):
        return UNCHANGED
    if dry:
        return WOULD_CHANGE
    t.run(f"mkdir -p -- {shlex.quote(str(Path(dest).parent))}", timeout=60)
    t.put_bytes(data, dest, mode)
    if remote_sha256(t, dest) != sha256(data):
        raise ClusterError(f"{dest}: content on the node does not match what was sent", "check the node's disk")
    return CHANGED


ActionFn = Callable[[Transport, "Renderer", Step, bool], tuple[str, str]]
_ACTIONS: dict[str, ActionFn] = {}


def action(name: str) -> Callable[[ActionFn], ActionFn]:
    def deco(fn: ActionFn) -> ActionFn:
        _ACTIONS[name] = fn
        return fn
    return deco


@action("command")
def _command(t: Transport, r: Renderer, step: Step, dry: bool) -> tuple[str, str]:
    cmd = r.shell(step, step.spec, "command")
    if dry:
        return WOULD_CHANGE, cmd
    res = t.run(cmd)
    if res.exit_code != 0:
        raise ClusterError(f"exit {res.exit_code}: {error_tail(res.stderr or res.stdout, 600)}")
    return CHANGED, cmd


def _file_spec(r: Renderer, step: Step) -> tuple[str, int]:
    spec = r.text(step, step.spec, step.action)
    if not isinstance(spec, dict) or "dest" not in spec:
        raise r.error(step, f"{step.action}: needs `dest:`")
    return str(spec["dest"]), int(str(spec.get("mode", "644")), 8)


@action("file")
def _file(t: Transport, r: Renderer, step: Step, dry: bool) -> tuple[str, str]:
    dest, mode = _file_spec(r, step)
    content = str(r.text(step, step.spec.get("content", ""), "file.content"))
    return _put_if_changed(t, content.encode(), dest, mode, dry), dest


@action("template")
def _template(t: Transport, r: Renderer, step: Step, dry: bool) -> tuple[str, str]:
    dest, mode = _file_spec(r, step)
    content = r.template(step, str(step.spec.get("src")))
    return _put_if_changed(t, content.encode(), dest, mode, dry), dest


def _wheelhouse(r: Renderer, step: Step, dry: bool) -> wheelhouse.Wheelhouse | None:
    wh = r.ctx.get("wheelhouse")
    if wh is None and dry:
        return None  # a dry run does not download: the wheelhouse is not built yet
    if not isinstance(wh, wheelhouse.Wheelhouse):
        raise r.error(step, f"{step.action}: this run has no wheelhouse (provision builds one per requirement set)")
    return wh


@action("wheels")
def _wheels(t: Transport, r: Renderer, step: Step, dry: bool) -> tuple[str, str]:
    dest, _ = _file_spec(r, step)
    wh = _wheelhouse(r, step, dry)
    if wh is None:
        return WOULD_CHANGE, "the head would download the wheelhouse first"
    changed, detail = wheelhouse.push(t, wh, dest, dry, r.ctx.get("on_bytes"))
    return (WOULD_CHANGE if dry else CHANGED) if changed else UNCHANGED, detail


@action("pip")
def _pip(t: Transport, r: Renderer, step: Step, dry: bool) -> tuple[str, str]:
    spec = r.text(step, step.spec, "pip")
    if not isinstance(spec, dict) or "venv" not in spec or "wheelhouse" not in spec:
        raise r.error(step, "pip: needs `venv:` and `wheelhouse:`")
    wh = _wheelhouse(r, step, dry)
    if wh is None:
        return WOULD_CHANGE, "would install the planned builds"
    py = shlex.quote(f"{spec['venv']}/bin/python")
    freeze = t.run(f"{py} -m pip freeze --all --disable-pip-version-check 2>/dev/null", timeout=300)
    todo = wheelhouse.unsatisfied(wh.lock_text, freeze.stdout) if freeze.exit_code == 0 else ["(no venv)"]
    if not todo:
        return UNCHANGED, f"{len(wh.files)} pinned packages installed"
    if dry:
        return WOULD_CHANGE, f"would install {len(todo)} packages"
    lock = f"{spec['wheelhouse']}/requirements.lock"
    t.put_bytes(wh.lock_text.encode(), lock)
    src = (f"--index-url {shlex.quote(spec['index'])}" if spec.get("index")
           else f"--no-index --find-links {shlex.quote(spec['wheelhouse'])}")
    res = t.run(f"{py} -m pip install --disable-pip-version-check -q {src} -r {shlex.quote(lock)}", timeout=3600)
    if res.exit_code != 0:
        raise ClusterError(f"pip install failed: {error_tail(res.stderr or res.stdout, 800)}",
                           "see the message; a broken venv is rebuilt by the venv step on the next run")
    return CHANGED, f"installed {len(todo)} packages"


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
        dest, mode = _file_spec(r, step)
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
