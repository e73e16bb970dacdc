"""Job specs: what to run, on which nodes, with which settings (docs/jobs.md).

A spec is data (jobs/<name>.yaml, or `launch -- COMMAND`), read here with `--set` overrides on top of the
schema's defaults (cluster.runs.schema) and validated (cluster.runs.jobcheck); rendering it into per-node launch
files is cluster.runs.render, running it is a scheduler's (cluster.schedulers). Every error names the file,
line, field and fix.
"""
from __future__ import annotations

import argparse
import copy
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from cluster import yamlfile
from cluster.errors import UsageError
from cluster.bounds import FileRefused, read_regular
from cluster.inventory.loader import parse_override
from cluster.runs import jobcheck
from cluster.runs.schema import (BUILT_IN_KEYS, COMM_KEYS, COMPONENTS, DEFAULTS, FREE_MAPS, JOBS_DIR, LAUNCHERS,
                                  RETIRED, JobError, program_parser)


@dataclass(frozen=True)
class JobSpec:
    path: Path
    settings: dict[str, Any]  # every key of DEFAULTS, resolved and validated

    def __getitem__(self, key: str) -> Any:
        return self.settings[key]

    @property
    def name(self) -> str:
        return str(self.settings["name"])

    @property
    def framework(self) -> str:
        return str(self.settings["framework"])

    @property
    def entry(self) -> str:
        return str(self.settings["entry"])

    @property
    def node_settings(self) -> dict[str, Any]:
        """The settings each node's job.json holds: a user's program's without the built-in programs' knobs."""
        return {k: v for k, v in self.settings.items() if not (self.own and k in BUILT_IN_KEYS)}

    @property
    def own(self) -> bool:
        """A user's own program (code shipped from the head), not one of the built-in training programs."""
        return self.settings["code"] is not None

    @property
    def launcher(self) -> str:
        return str(self.settings["launcher"])

    def program_args(self, data_file: str, out_dir: str) -> list[str]:
        """The training program's command line (wlcommon.add_args), one list item per word."""
        s, o = self.settings, self.settings["optimizer"]
        args = ["--data", data_file, "--out", out_dir, "--epochs", s["epochs"], "--batch", s["batch"],
                "--lr", o["lr"], "--momentum", o["momentum"], "--weight-decay", o["weight_decay"],
                "--warmup-epochs", o["warmup_epochs"], "--schedule", o["schedule"], "--seed", s["seed"],
                "--threads", s["threads"], "--loader-workers", s["loader_workers"], "--amp", s["amp"], "--log-every", s["log_every"],
                "--max-steps", s["max_steps"]]
        if o["lr_scaling"] != DEFAULTS["optimizer"]["lr_scaling"]:
            args += ["--lr-scaling", o["lr_scaling"]]
        for key in ("model", "bn_recompute", "target_acc", "max_epochs", *COMM_KEYS):  # only those changed: DEFAULTS are the programs' own
            if key == "powersgd_wire" and s["grad_compression"] != "powersgd":
                continue  # another scheme's settings mean nothing to this run
            if s[key] != DEFAULTS[key]:
                args += ["--" + key.replace("_", "-"), s[key]]
        if s["shares"]:
            args += ["--shares", ",".join(f"{node}={n}" for node, n in s["shares"].items())]
        if s["continues"] is not None:
            args += ["--continues", s["continues"]]
        return [a if isinstance(a, str) else str(a) for a in args]  # a str subclass (render.Raw) stays what it is

    def carried_over(self) -> list[str]:
        """What `launch --continue` copies from the continued run's folder into the new one on each node:
        the built-in programs' checkpoint, or the folders a user's program declared as its `outputs`."""
        if self.own:
            return [str(o) for o in self.settings["outputs"] or []]
        return [COMPONENTS[self.framework].checkpoint]

    def program_files(self) -> list[str]:
        """A built-in job's files of cluster/programs: its entry point and the modules it imports."""
        return [self.entry, *COMPONENTS[self.framework].modules]


def find(name_or_path: str) -> Path:
    """A job by name (jobs/<name>.yaml) or by path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return JOBS_DIR / f"{name_or_path}.yaml"


def available() -> list[str]:
    return sorted(p.stem for p in JOBS_DIR.glob("*.yaml"))


def load(name_or_path: str, overrides: Iterable[str] = ()) -> JobSpec:
    path = find(name_or_path)
    file = str(path)
    fix = f"name a job ({', '.join(available())}) or the path of a spec file"
    try:
        data = yamlfile.load(read_regular(path, fix, noun="a job spec").decode())
    except FileRefused as e:  # a FIFO would block, /dev/zero exhaust the memory
        raise JobError(file, None, "job", f"cannot read the job spec: it {e.problem}",
                       f"{fix} (a regular file)") from None
    except OSError as e:
        raise JobError(file, None, "job", f"cannot read the job spec: {e.strerror}", fix) from None
    except UnicodeDecodeError as e:
        raise JobError(file, None, "job", f"not UTF-8 text (byte {e.start}: {e.reason})",
                       "save the spec as UTF-8") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise JobError(file, mark.line + 1 if mark else None, "job", f"YAML error: {e.problem or e.context}",
                       "check the indentation and quoting") from None
    except Exception as e:  # noqa: BLE001 - yaml errors carry their own position
        raise JobError(file, None, "job", f"YAML error: {e}", "check the indentation and quoting") from None
    if not isinstance(data, dict):
        raise JobError(file, None, "job", "a job spec is a mapping of settings", "see docs/jobs.md")
    settings = copy.deepcopy(DEFAULTS)
    lines: dict[str, int | None] = {}  # field -> line in the file, -1: from --set
    _merge(settings, data, "", file, lines)
    for key in ("code", "data"):  # a spec's relative paths are its folder's, wherever it is launched from
        if isinstance(settings[key], str) and settings[key] and not Path(settings[key]).expanduser().is_absolute():
            settings[key] = str((path.parent / settings[key]).resolve())
    _override(settings, overrides, file, lines)
    return resolve(path, settings, lines)


def _override(settings: dict[str, Any], overrides: Iterable[str], file: str, lines: dict[str, int | None],
              mark: int = -1) -> None:
    """--set KEY=VALUE, each in turn; `lines` marks each key as given on the command line: -1 by --set, -2 by
    launch's option of the same name or its command."""
    for text in overrides:
        if not text.partition("=")[0].strip() or "=" not in text:
            raise JobError("command line (--set)", None, "--set", f"expected KEY=VALUE, got {text!r}",
                           "e.g. --set epochs=2 --set optimizer.lr=0.02")
        key, value = parse_override(text)
        _set(settings, key, value, file, lines)
        lines[key] = mark


def with_defaults(settings: dict[str, Any] | None) -> dict[str, Any]:
    """A recorded run's settings with every key added since it ran at its default and every retired key left
    out, so that an older run compares equal to the same job run today."""
    s = copy.deepcopy({**DEFAULTS, **{k: v for k, v in (settings or {}).items() if k not in RETIRED}})
    for key, default in DEFAULTS.items():  # a group's keys too (optimizer.lr_scaling came after runs without it)
        if isinstance(default, dict) and key not in FREE_MAPS and isinstance(s[key], dict):
            s[key] = {**copy.deepcopy(default), **s[key]}
    return s


def from_run(spec_file: str, settings: dict[str, Any], overrides: Iterable[str] = ()) -> JobSpec:
    """A run's resolved settings (its record) with --set overrides, validated again: the job that
    `launch --continue RUN` starts, as RUN ran it (the plan's shares and scheme included)."""
    path = Path(spec_file)
    s = with_defaults(settings)
    lines: dict[str, int | None] = {}
    _override(s, overrides, str(path), lines)
    return resolve(path, s, lines)


def resolve(path: Path, settings: dict[str, Any], lines: dict[str, int | None]) -> JobSpec:
    """Fill what follows from the settings given (a user program's folder and family, a built-in's program and
    launcher), then validate; `lines`: field -> its line in `path` (-1: the command line)."""
    file = str(path)
    if any(settings[k] is not None for k in ("program", "module", "command")) and settings["code"] is None:
        settings["code"] = str(path.parent.resolve())  # the spec's own folder, as torchx and SkyPilot do
    if settings["code"] is not None:
        settings["launcher"] = settings["launcher"] or "torchrun"
        if isinstance(settings["launcher"], str) and settings["launcher"] in LAUNCHERS:
            settings["framework"] = settings["framework"] or LAUNCHERS[settings["launcher"]]
    elif isinstance(settings["framework"], str) and settings["framework"] in COMPONENTS:
        component = COMPONENTS[settings["framework"]]
        settings["entry"] = settings["entry"] or component.entry
        settings["launcher"] = settings["launcher"] or component.launcher
        if settings["large_outputs"] is None:
            settings["large_outputs"] = list(component.large_outputs)
    if settings["large_outputs"] is None:
        settings["large_outputs"] = []
    checks = jobcheck.validate(settings, file, lines)
    spec = JobSpec(path, settings)
    if not spec.own:
        _check_program_line(checks, spec)
    return spec


COMMAND_LINE = "(command line)"  # the spec path of `clusterctl launch -- COMMAND`


def from_command(argv: list[str], code: Path, launcher: str = "torchrun", name: str | None = None,
                 overrides: Iterable[str] = (), options: Iterable[str] = ()) -> JobSpec:
    """The ad-hoc job of `clusterctl launch [OPTIONS] -- python train.py ...`: `code` shipped, `python SCRIPT
    ARGS` runs SCRIPT, `python -m MOD ARGS` runs MOD, anything else is a command (torchrun's --no-python)."""
    settings = copy.deepcopy(DEFAULTS)
    settings["code"], settings["launcher"] = str(code.resolve()), launcher
    settings["name"] = name or _name_for(code)
    words = list(argv)
    if words and words[0].endswith(".py") and "/" not in words[0]:  # no node has `train.py` on its PATH
        raise UsageError(f"{words[0]} is a Python file, not a command: the nodes would look for a program "
                         f"named {words[0]}", f"clusterctl launch -- python {shlex.join(words)}")
    if words and Path(words[0]).name.startswith("python") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            settings["module"], settings["args"] = words[2], words[3:]
        elif not words[1].startswith("-"):
            settings["program"], settings["args"] = words[1], words[2:]
        else:
            settings["command"] = words
    else:
        settings["command"] = words
    lines: dict[str, int | None] = {}
    _override(settings, options, "command line", lines, mark=-2)  # launch's own options: --outputs, --data, ...
    _override(settings, overrides, "command line", lines)
    if settings["requirements"] == "none":  # `--requirements none`: none, the folder's requirements.txt neither
        settings["requirements"] = None
    elif "requirements" not in lines and (code / "requirements.txt").is_file():  # where pip users keep them
        settings["requirements"] = "requirements.txt"
    return resolve(code / COMMAND_LINE, settings, {**{k: -2 for k in settings}, **lines})


def program_words(words: list[str]) -> bool:
    """Whether the words a user gave as launch's JOB start a program's command (`python train.py`,
    `train.py`, `torchrun ...`): they forgot the `--` that separates a command from launch's options."""
    first = words[0] if words else ""
    return first.endswith(".py") or bool(re.fullmatch(r"python[0-9.]*|torchrun|-m", Path(first).name))


def _name_for(code: Path) -> str:
    """A job name from the folder's name, made of the characters a run id allows."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", code.resolve().name).strip("-.") or "job"
    return name[:64] if name[0].isalnum() else "job-" + name[:60]


def _merge(into: dict[str, Any], data: dict[str, Any], prefix: str, file: str, lines: dict[str, int | None]) -> None:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        line = yamlfile.line_of(data, key)
        if dotted in RETIRED:
            raise JobError(file, line, dotted, "a retired setting", RETIRED[dotted])
        if key not in into:
            raise JobError(file, line, dotted, "unknown setting",
                           f"allowed here: {', '.join(into)} (docs/jobs.md)")
        lines[dotted] = line
        if isinstance(into[key], dict) and key not in FREE_MAPS:
            if not isinstance(value, dict):
                raise JobError(file, line, dotted, f"expected a mapping, got {value!r}",
                               f"e.g. {key}: {{{next(iter(into[key]))}: ...}}")
            _merge(into[key], value, dotted + ".", file, lines)
        else:
            into[key] = dict(value) if isinstance(value, dict) else value


def _set(settings: dict[str, Any], key: str, value: Any, file: str,
         lines: dict[str, int | None] | None = None) -> None:
    """--set a.b=value; env.NAME=value adds a variable; a.b={c: 1} sets a group of sub-settings, checked
    like a spec file's (a group given a plain value is refused: it would be misread later)."""
    if key in RETIRED:
        raise JobError("command line (--set)", None, key, "a retired setting", RETIRED[key])
    parts = key.split(".")
    node = settings
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node.get(part), dict):
            raise JobError("command line", None, key, f"'{'.'.join(parts[:i + 1])}' has no sub-settings",
                           f"settable keys: {', '.join(_keys(DEFAULTS))} (spec: {file})")
        node = node[part]
    if parts[-1] not in node and parts[0] not in FREE_MAPS:
        raise JobError("command line", None, key, "unknown setting",
                       f"settable keys: {', '.join(_keys(DEFAULTS))} (spec: {file})")
    default: Any = DEFAULTS  # whether the key names a group is the schema's business, not the value's so far
    for part in parts:
        default = default.get(part) if isinstance(default, dict) else None
    current = node.get(parts[-1])
    if isinstance(default, dict) and isinstance(current, dict) and parts[0] not in FREE_MAPS:  # e.g. dataset
        subs = ", ".join(f"{key}.{k}" for k in current)
        if not isinstance(value, dict):
            raise JobError("command line (--set)", None, key, f"is a group of settings, got {value!r}",
                           f"set one of them, e.g. --set {key}.{next(iter(current))}=..., or all at once: "
                           f"--set '{key}={{{next(iter(current))}: ...}}' (settings: {subs})")
        given: dict[str, int | None] = {}
        _merge(current, value, key + ".", "command line (--set)", given)
        if lines is not None:
            lines.update({k: -1 for k in given})  # errors found later name the command line, not the file
        return
    node[parts[-1]] = value


def _keys(d: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and k not in FREE_MAPS:
            out += _keys(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}" + (".NAME" if k in ("env", "env_from") else ".NODE" if k == "shares" else ""))
    return out


def _check_program_line(checks: jobcheck.Checks, spec: JobSpec) -> None:
    """A built-in job's command line, read by the program's own parser on the head: a value the program
    would refuse on every node stops here, before anything starts (the checks above name most first)."""
    args = spec.program_args("data.npz", "out")
    try:
        program_parser().parse_args(args)
    except (argparse.ArgumentError, SystemExit) as e:  # exit_on_error=False still exits on unknown arguments
        checks.fail("job", f"the training program refuses its command line: {e}",
                    f"fix the setting it names (docs/jobs.md); the command line was: {' '.join(args)}")

