"""Values of a playbook rendered for one node with jinja2: StrictUndefined, shell fields quoted on output.

In shell fields every `{{ value }}` is shell-quoted (`{{ x | raw }}` for trusted fragments);
errors name the playbook, the step and its line.
"""
from __future__ import annotations

import shlex
from typing import Any

import jinja2

from cluster import paths
from cluster.provision.model import Playbook, PlaybookError, Step

TEMPLATES_DIR = paths.TEMPLATES_DIR


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
        rendered: str = self._render(value, step, what, quote=True)  # a string renders to a string
        return rendered

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
