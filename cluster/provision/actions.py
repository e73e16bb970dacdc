"""The actions a step can take (command, file, template, wheels, pip), each idempotent where it can be.

An action returns (status, detail); it raises ClusterError for a failure of the step, and
PlaybookError (via the renderer) for a playbook that cannot be rendered.
"""
from __future__ import annotations

import hashlib
import shlex
from pathlib import Path
from typing import Callable

from cluster.provision import wheelhouse
from cluster.errors import ClusterError
from cluster.provision.model import CHANGED, UNCHANGED, WOULD_CHANGE, Step
from cluster.provision.render import Renderer
from cluster.nodes.replies import error_tail
from cluster.transport import Transport


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


ActionFn = Callable[[Transport, Renderer, Step, bool], tuple[str, str]]
ACTIONS: dict[str, ActionFn] = {}


def action(name: str) -> Callable[[ActionFn], ActionFn]:
    def deco(fn: ActionFn) -> ActionFn:
        ACTIONS[name] = fn
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


def file_spec(r: Renderer, step: Step) -> tuple[str, int]:
    spec = r.text(step, step.spec, step.action)
    if not isinstance(spec, dict) or "dest" not in spec:
        raise r.error(step, f"{step.action}: needs `dest:`")
    return str(spec["dest"]), int(str(spec.get("mode", "644")), 8)


@action("file")
def _file(t: Transport, r: Renderer, step: Step, dry: bool) -> tuple[str, str]:
    dest, mode = file_spec(r, step)
    content = str(r.text(step, step.spec.get("content", ""), "file.content"))
    return _put_if_changed(t, content.encode(), dest, mode, dry), dest


@action("template")
def _template(t: Transport, r: Renderer, step: Step, dry: bool) -> tuple[str, str]:
    dest, mode = file_spec(r, step)
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
    dest, _ = file_spec(r, step)
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
