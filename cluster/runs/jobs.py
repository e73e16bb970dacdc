"""Job specs: what to train, on which nodes, with which settings (schema: docs/jobs.md).

A spec is data (jobs/<name>.yaml), resolved with `--set` overrides and
validated here; rendering it into per-node launch files is cluster.runs.render, and
running it is cluster.runs.launch. Every error names the file, line, field and fix.
"""
from __future__ import annotations

import argparse
import copy
import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NoReturn

import yaml

from cluster import paths, yamlfile
from cluster.bounds import FileRefused, Range, read_regular
from cluster.errors import UsageError
from cluster.programs import wlcommon
from cluster.inventory.loader import parse_override
from cluster.runs.records import RUN_ID_RE

JOBS_DIR = paths.JOBS_DIR
PROGRAMS_DIR = paths.PACKAGE_DIR / "programs"


@dataclass(frozen=True)
class Component:
    """A built-in program as a preset: it fills in what any job says of its program (the entry point and the
    modules it imports, its launcher, what `--continue` carries over, which outputs are large), so a built-in
    job and `launch -- python train.py` go through the same path from then on."""

    entry: str
    launcher: str
    checkpoint: str  # under the run folder: what `launch --continue` copies from the continued run
    large_outputs: tuple[str, ...]  # name patterns that `collect` leaves on the nodes unless asked
    # what the entry point imports of cluster/programs, shipped beside it
    modules: tuple[str, ...] = ("wlcommon.py", "wldata.py", "wlmetrics.py", "torchcomm.py", "tfcomm.py")


# `framework:` names the component; `checkpoint*` (not only the file): a save in progress is named after it too
COMPONENTS = {"pytorch": Component("train_torch.py", "torchrun", "out/checkpoint.pt",
                                   ("checkpoint*", ".checkpoint-worker*")),
              "tensorflow": Component("train_tf.py", "tensorflow", "out/checkpoint",
                                      ("checkpoint*", ".checkpoint-worker*"))}
FRAMEWORKS = {name: c.entry for name, c in COMPONENTS.items()}
LAUNCHERS = {"torchrun": "pytorch", "tensorflow": "tensorflow", "plain": "plain"}  # launcher -> its family
DATASETS = ("digits", "digits-aug", "cifar10", "imagefolder", "synthetic")
# A job's name starts its run ids (runs.RUN_ID_RE), which are folder names on the head and the nodes: ASCII only
# (str.isalnum accepts 'é', whose run id is then refused), \Z not $ (which accepts a trailing newline).
JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
ENV_NAME_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")



def program_parser() -> argparse.ArgumentParser:
    """The built-in training programs' own argument parser (programs/wlcommon.add_args): their knobs, each
    knob's default and its choices are declared there once; the head reads them from it, and checks a built-in
    job's command line with it before anything starts (`_Checks.program`)."""
    ap = argparse.ArgumentParser(prog="the built-in training program", add_help=False, exit_on_error=False)
    wlcommon.add_args(ap)
    return ap


_KNOBS = vars(program_parser().parse_args([]))  # dest -> the programs' default
_CHOICES = {a.dest: tuple(a.choices) for a in program_parser()._actions if a.choices is not None}

# Every key a spec may hold, with its default; a spec file gives some, --set overrides any. A built-in
# program's knob takes its default from the program's parser (_KNOBS).
DEFAULTS: dict[str, Any] = {
    "name": None,
    "description": "",
    "framework": None,  # the built-in programs' family (pytorch | tensorflow); a user program says `launcher`
    "entry": None,  # a built-in program of cluster/programs; default: the framework's
    # A user's own program (docs/jobs.md "Your own program"): its folder, what to run in it, how to start it.
    "code": None,  # a folder on the head, shipped to every node; default: the spec file's folder
    "program": None,  # a script inside `code` ...
    "module": None,  # ... or a module run as `python -m` from `code`
    "command": None,  # ... or any command (a list), run under torchrun's --no-python
    "args": [],  # the program's arguments, each shell-quoted
    "launcher": None,  # torchrun | tensorflow | plain (one process per node); built-ins: from `framework`
    "requirements": None,  # a list, or a requirements file inside `code`: installed offline as a layer
    "data": None,  # a file or folder on the head, in every run's data/ ($CLUSTER_DATA), sent once per node
    "outputs": None,  # what collect brings of the program's folder: these paths; default everything it wrote
    # file or folder name patterns (fnmatch) that collect leaves on the nodes unless asked (--with-checkpoints);
    # default: a built-in program's checkpoints, nothing of a user's program
    "large_outputs": None,
    "dataset": {"name": _KNOBS["dataset"], "path": None, "size": _KNOBS["size"]},
    "model": _KNOBS["model"],  # a torchvision.models name (PyTorch jobs); TensorFlow jobs train ResNet50
    "bn_recompute": _KNOBS["bn_recompute"],
    "epochs": _KNOBS["epochs"],
    "target_acc": _KNOBS["target_acc"],
    "max_epochs": _KNOBS["max_epochs"],
    "batch": _KNOBS["batch"],
    "optimizer": {k: _KNOBS[k] for k in ("lr", "momentum", "weight_decay", "warmup_epochs", "schedule", "lr_scaling")},
    "seed": _KNOBS["seed"],
    "nodes": "all",
    "min_nodes": 0,  # start with at least this many of them when some do not answer; 0: all of them
    "silent_grace_s": 30,  # a node of a running run silent this long fails it (or, with min_nodes, is left out)
    "procs_per_node": "auto",
    **{k: _KNOBS[k] for k in ("threads", "loader_workers", "amp")},
    "max_restarts": 0,
    **{k: _KNOBS[k] for k in ("max_steps", "log_every")},
    # communication (docs/jobs.md "Communication"): what goes on the wire and how long a peer is waited for
    **{k: _KNOBS[k] for k in ("grad_compression", "powersgd_rank", "powersgd_start_step", "powersgd_wire",
                              "accumulate", "bucket_mb", "tf_implementation", "tf_bytes_per_pack",
                              "collective_timeout_s")},
    "port": 0,
    "shares": {},  # node -> its batch (uneven split, `clusterctl plan`); empty: `batch` on every worker
    "env": {},
    "env_from": {},  # NAME -> {file: PATH on the head} | {env: VARIABLE of the head}: secrets, never written in clear
    # Slurm (docs/slurm.md): a job whose node fails is requeued by Slurm and starts over (its output appended);
    # false: it ends NODE_FAIL. Slurm's own requeue is what min_nodes is on SSH launches; they ignore it.
    "requeue": False,
    # a finished run this one continues from (`launch --continue RUN`): its checkpoints are copied into the
    # new run folders, and the built-in programs resume from them with this run's epochs (docs/jobs.md)
    "continues": None,
}
COMM_KEYS = ("grad_compression", "powersgd_rank", "powersgd_start_step", "powersgd_wire", "accumulate", "bucket_mb",
             "tf_implementation", "tf_bytes_per_pack", "collective_timeout_s")
COMPRESSIONS = _CHOICES["grad_compression"]
# Retired settings and values (docs/jobs.md "Retired settings"): a spec or --set that names one is refused
# (exit 2) with what replaces it. A run recorded with one reads as today's job without it (with_defaults).
LOCAL_SGD_GONE = ("grad_compression: localsgd is retired (it never beat one node on a measured room): use "
                  "grad_compression: powersgd, which `clusterctl plan` weighs on both wires (docs/jobs.md "
                  "\"Retired settings\")")
RETIRED: dict[str, str] = {
    "localsgd_period": f"remove it; {LOCAL_SGD_GONE}",
    "localsgd_start_step": f"remove it (PowerSGD's start is powersgd_start_step); {LOCAL_SGD_GONE}",
}
RETIRED_VALUES: dict[str, dict[Any, str]] = {"grad_compression": {"localsgd": LOCAL_SGD_GONE}}
POWERSGD_WIRES = _CHOICES["powersgd_wire"]
LR_SCALINGS = _CHOICES["lr_scaling"]
# what only changes the bytes on the wire and how long a peer is waited for: a one-node run is the same
# run whatever they say (accumulate is not among them: it changes the optimizer's steps)
WIRE_KEYS = tuple(k for k in COMM_KEYS if k != "accumulate")
FREE_MAPS = ("env", "shares", "env_from")  # mappings whose keys the user chooses
# What each number setting accepts (cluster.bounds: of its kind, finite, within bounds; docs/jobs.md gives the
# same bounds beside each key). Generous, yet a slip (batch: 10^22, lr: 1e3, momentum: .nan) stops here, not
# as a crash or a silently useless run on the nodes.
NUMBERS: dict[str, Range] = {
    "dataset.size": Range(8, 1024, integer=True),  # image side in pixels
    "epochs": Range(1, 10000, integer=True),
    "target_acc": Range(0, 1),
    "max_epochs": Range(0, 10000, integer=True),
    "batch": Range(1, 65536, integer=True),  # per worker
    "optimizer.lr": Range(0, 10, low_open=True),
    "optimizer.momentum": Range(0, 1, high_open=True),  # 1: the velocity never decays, the steps grow without end
    "optimizer.weight_decay": Range(0, 1),
    "optimizer.warmup_epochs": Range(0, 10000),
    "seed": Range(0, 2**32 - 1, integer=True),  # numpy's global seed (keras.utils.set_random_seed) is 32-bit
    "threads": Range(0, 1024, integer=True),
    "loader_workers": Range(-1, 64, integer=True),
    "max_restarts": Range(0, 100, integer=True),
    "max_steps": Range(0, 10**9, integer=True),
    "log_every": Range(1, 10**6, integer=True),
    "port": Range(0, 65535, integer=True),
    "min_nodes": Range(0, 4096, integer=True),
    "silent_grace_s": Range(5, 3600),
    "procs_per_node": Range(1, 64, integer=True),  # or auto
    "powersgd_rank": Range(1, 1024, integer=True),
    "powersgd_start_step": Range(0, 10**9, integer=True),
    "accumulate": Range(1, 1024, integer=True),
    "bucket_mb": Range(0, 4096),
    "tf_bytes_per_pack": Range(0, 2**30, integer=True),
    "collective_timeout_s": Range(0, 86400),  # 0: the framework's default; else >= 10 (checked apart)
    "shares": Range(1, 65536, integer=True),  # a node's batch, as `batch`
    "bn_recompute": Range(0, 10**6, integer=True),
}


class JobError(UsageError):
    """A spec that cannot be used: names the file (and line) and the dotted field."""

    def __init__(self, file: str, line: int | None, field: str, message: str, fix: str) -> None:
        where = f"{file}:{line}" if line else file
        super().__init__(f"{where}: {field}: {message}", fix)
        self.file, self.line, self.field = file, line, field


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
    _override(settings, overrides, file, lines)
    return resolve(path, settings, lines)


def _override(settings: dict[str, Any], overrides: Iterable[str], file: str, lines: dict[str, int | None]) -> None:
    """--set KEY=VALUE, each in turn; `lines` marks each key as given on the command line (-1)."""
    for text in overrides:
        if not text.partition("=")[0].strip() or "=" not in text:
            raise JobError("command line (--set)", None, "--set", f"expected KEY=VALUE, got {text!r}",
                           "e.g. --set epochs=2 --set optimizer.lr=0.02")
        key, value = parse_override(text)
        _set(settings, key, value, file, lines)
        lines[key] = -1


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
    _validate(settings, file, lines)
    return JobSpec(path, settings)


def from_command(argv: list[str], code: Path, launcher: str = "torchrun", name: str | None = None,
                 overrides: Iterable[str] = ()) -> JobSpec:
    """The ad-hoc job of `clusterctl launch [OPTIONS] -- python train.py ...`: `code` shipped, `python SCRIPT
    ARGS` runs SCRIPT, `python -m MOD ARGS` runs MOD, anything else is a command (torchrun's --no-python)."""
    settings = copy.deepcopy(DEFAULTS)
    settings["code"], settings["launcher"] = str(code.resolve()), launcher
    settings["name"] = name or _name_for(code)
    words = list(argv)
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
    _override(settings, overrides, "command line", lines)
    return resolve(code / "(command line)", settings, {k: -1 for k in (*settings, *lines)})


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


def _relative_inside(path: object) -> bool:
    """A relative POSIX path with no empty, '.' or '..' part (what the node agent accepts as an output)."""
    return isinstance(path, str) and bool(path) and not path.startswith("/") and "\0" not in path and all(
        part not in ("", ".", "..") for part in path.rstrip("/").split("/"))


def _loops(path: str) -> bool:
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def _head_path_exists(path: Any) -> bool:
    """A non-empty path that exists on the head (`~user` of an unknown user or a NUL byte: it does not)."""
    if not isinstance(path, str) or not path:
        return False
    try:
        return Path(path).expanduser().exists()
    except (RuntimeError, ValueError, OSError):
        return False


class _Checks:
    """The checks of a resolved spec, by group; each failure names the file and line (or --set) and the field."""

    def __init__(self, file: str, lines: dict[str, int | None]) -> None:
        self.file, self.lines = file, lines

    def fail(self, field: str, message: str, fix: str, at: str | None = None) -> NoReturn:
        """`at`: the setting whose line to name, where `field` is inside it (args[0])."""
        line = self.lines.get(at or field)
        raise JobError("command line (--set)" if line == -1 else self.file, None if line == -1 else line,
                       field, message, fix)

    def number(self, field: str, value: Any) -> None:
        """The one check of a number setting (cluster.bounds, NUMBERS): its kind, finite, its bounds."""
        rng = NUMBERS[field]
        problem = rng.problem(value)
        if problem is not None:
            default: Any = DEFAULTS
            for part in field.split("."):
                default = default[part]
            self.fail(field, f"expected {problem}, got {value!r}",
                      f"e.g. --set {field}={default} (the default; {field} is {rng}, docs/jobs.md)")

    def choice(self, field: str, value: Any, knob: str, fix: str) -> None:
        """A setting whose values the built-in programs' parser lists (its `choices`)."""
        allowed = _CHOICES[knob]
        if value not in allowed:
            self.fail(field, f"expected {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}", fix)

    def program(self, s: dict[str, Any]) -> None:
        """Name, framework and the program that trains."""
        if not isinstance(s["name"], str) or not JOB_NAME_RE.match(s["name"]):
            self.fail("name", "expected a name of ASCII letters, digits, '-', '_' or '.', starting with a letter or "
                      f"a digit, at most 128 characters (it starts the run ids, folder names), got {s['name']!r}",
                      "e.g. name: resnet50-ddp")
        large = s["large_outputs"]
        if not (isinstance(large, list) and all(isinstance(x, str) and x.strip() and "/" not in x
                                                and x not in (".", "..") for x in large)):
            self.fail("large_outputs", f"expected a list of file or folder names (patterns such as "
                      f"checkpoint*), got {large!r}", "large_outputs: [checkpoint*, '*.ckpt'] (names, no '/'); "
                      "[]: collect brings everything")
        if s["code"] is not None:
            self.own_program(s)
            return
        if not isinstance(s["framework"], str) or s["framework"] not in FRAMEWORKS:
            self.fail("framework", f"expected one of {', '.join(FRAMEWORKS)}, got {s['framework']!r}",
                      "framework: pytorch (DDP via torchrun) or tensorflow (MultiWorkerMirroredStrategy); "
                      "for your own program give `program:` (and `launcher:`) instead, docs/jobs.md")
        if s["launcher"] != COMPONENTS[s["framework"]].launcher:
            self.fail("launcher", f"the built-in {s['framework']} program starts with its own launcher, got "
                      f"{s['launcher']!r}", "leave launcher out (it goes with `program:` for your own code)")
        entry = s["entry"]
        if not isinstance(entry, str) or "/" in entry or not (PROGRAMS_DIR / entry).is_file():
            self.fail("entry", f"no program {entry!r} in cluster/programs/",
                      f"leave it out to use {FRAMEWORKS.get(s['framework'], 'the framework default')}")

    def own_program(self, s: dict[str, Any]) -> None:
        """A user's program: its folder on the head, exactly one of program/module/command inside it, the
        launcher, the arguments. The folder's files themselves are checked when they are shipped (runs/code.py)."""
        code = Path(str(s["code"])).expanduser()
        if not isinstance(s["code"], str) or not code.is_dir():
            self.fail("code", f"no folder {s['code']!r} on the head", "code: the folder of your training program "
                      "(default: the spec file's folder)")
        if not isinstance(s["launcher"], str) or s["launcher"] not in LAUNCHERS:
            self.fail("launcher", f"expected one of {', '.join(LAUNCHERS)}, got {s['launcher']!r}",
                      "launcher: torchrun (PyTorch), tensorflow (TF_CONFIG per worker) or plain (one process per node)")
        if s["framework"] != LAUNCHERS[s["launcher"]]:
            self.fail("framework", f"a {s['launcher']} program is {LAUNCHERS[s['launcher']]}, got {s['framework']!r}",
                      "leave framework out for your own program (the launcher says it)")
        given = [k for k in ("program", "module", "command") if s[k] is not None]
        if len(given) != 1:
            self.fail("program", f"expected exactly one of program, module or command, got {given or 'none'}",
                      "program: train.py (a script in `code`), module: pkg.train, or command: [./run.sh, --fast]")
        if s["program"] is not None:
            prog = s["program"]
            inside = isinstance(prog, str) and prog and not Path(prog).is_absolute() and ".." not in Path(prog).parts
            if not inside:
                self.fail("program", f"expected a script path inside `code` ({code}), got {prog!r}",
                          "program: train.py (relative to `code`; put the script in that folder)")
            if not (code / prog).is_file():
                self.fail("program", f"no file {prog!r} in {code}", f"program: the path of your script inside {code}")
        if s["module"] is not None and not (isinstance(s["module"], str) and s["module"].isascii() and all(
                part.isidentifier() for part in s["module"].split("."))):
            self.fail("module", f"expected a dotted module name, got {s['module']!r}", "module: mypkg.train")
        if s["command"] is not None and not (isinstance(s["command"], list) and s["command"] and all(
                isinstance(w, (str, int, float)) and not isinstance(w, bool) for w in s["command"])):
            self.fail("command", f"expected a list of words, got {s['command']!r}", "command: [./train.sh, --fast]")
        if not isinstance(s["args"], list) or not all(
                isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in s["args"]):
            self.fail("args", f"expected a list of words (strings or numbers), got {s['args']!r}",
                      "args: [--lr, 0.1, --epochs, 3]")
        req = s["requirements"]
        if req is not None and not (isinstance(req, list) and all(isinstance(r, str) and r.strip() for r in req)):
            if not isinstance(req, str) or Path(req).is_absolute() or ".." in Path(req).parts \
                    or not (code / req).is_file():
                self.fail("requirements", f"expected a list of requirements or a requirements file inside "
                          f"`code` ({code}), got {req!r}", "requirements: [tabulate==0.9.0] or requirements: "
                          "requirements.txt")
        if s["data"] is not None and not _head_path_exists(s["data"]):
            loop = isinstance(s["data"], str) and os.path.islink(s["data"]) and _loops(s["data"])
            self.fail("data", f"{s['data']} is a symbolic link that leads back to itself (a loop)" if loop else
                      f"no file or folder {s['data']!r} on the head", "data: the path of your data set on "
                      "this PC (it is sent to every node once: the lab has no internet)")
        out = s["outputs"]
        if out is not None and not (isinstance(out, list) and out and all(_relative_inside(o) for o in out)):
            self.fail("outputs", f"expected a list of folders or files inside the program's working directory, "
                      f"got {out!r}", "outputs: [checkpoints, results/metrics.csv] (relative paths, no '..'); "
                      "leave it out to collect everything the program wrote")
        if s["launcher"] == "tensorflow" and s["procs_per_node"] not in ("auto", 1):
            self.fail("procs_per_node", "a tensorflow program runs one worker per node", "procs_per_node: 1")

    def data_and_model(self, s: dict[str, Any]) -> None:
        """The dataset (its path must exist on the head) and the model."""
        ds = s["dataset"]
        if ds["path"] is not None and not isinstance(ds["path"], str):
            self.fail("dataset.path", f"expected the path of a file or folder on the head, got {ds['path']!r}",
                      "--set dataset.path=/data/cifar-10-python.tar.gz")
        if ds["name"] not in DATASETS:
            self.fail("dataset.name", f"expected one of {', '.join(DATASETS)}, got {ds['name']!r}",
                      "dataset: {name: digits} needs no download")
        if (ds["name"] in ("cifar10", "imagefolder") or ds["path"]) and not _head_path_exists(ds["path"]):
            # any path given must exist: the dataset's file name hashes what it points to, even for digits
            self.fail("dataset.path", f"{ds['name']} needs an existing path on the head, got {ds['path']!r}"
                      if ds["name"] in ("cifar10", "imagefolder") else f"no such file or folder on the head: {ds['path']!r}",
                      "--set dataset.path=/data/cifar-10-python.tar.gz (the head prepares it and stages it)")
        if not isinstance(s["model"], str) or not (s["model"].isascii() and s["model"].isidentifier()):
            self.fail("model", f"expected a torchvision model name, got {s['model']!r}", "e.g. model: resnet18")
        if s["model"] != "resnet50" and s["framework"] != "pytorch":
            self.fail("model", f"{s['framework']} jobs train resnet50 (train_tf.py), got {s['model']!r}", "leave model out")
        self.number("bn_recompute", s["bn_recompute"])
        self.number("dataset.size", ds["size"])

    def training(self, s: dict[str, Any]) -> None:
        """Epochs, batch, optimizer and the run's counters."""
        for field in ("epochs", "target_acc", "max_epochs", "batch"):
            self.number(field, s[field])
        if s["max_epochs"] and not s["target_acc"]:
            self.fail("max_epochs", f"{s['max_epochs']} epochs at most, but no target_acc to train until",
                      "set target_acc too (e.g. target_acc: 0.98, max_epochs: 12), or leave max_epochs out")
        if s["max_epochs"] and s["max_epochs"] < s["epochs"]:
            self.fail("max_epochs", f"{s['max_epochs']} is below epochs ({s['epochs']}): the run trains its epochs "
                      "first", f"max_epochs: {3 * s['epochs']} (or 0: no epochs past `epochs`)")
        o = s["optimizer"]
        for key in ("lr", "momentum", "weight_decay", "warmup_epochs"):
            self.number(f"optimizer.{key}", o[key])
        self.choice("optimizer.schedule", o["schedule"], "schedule", "schedule: cosine")
        self.choice("optimizer.lr_scaling", o["lr_scaling"], "lr_scaling", "lr_scaling: linear")
        for field in ("seed", "threads", "max_restarts", "max_steps", "port", "log_every", "loader_workers"):
            self.number(field, s[field])

    def communication(self, s: dict[str, Any]) -> None:
        """The communication settings (docs/jobs.md "Communication")."""
        for field, gone in RETIRED_VALUES.items():
            if isinstance(s[field], str) and s[field] in gone:
                self.fail(field, f"{s[field]!r} is retired", gone[s[field]])
        self.choice("grad_compression", s["grad_compression"], "grad_compression",
                    "grad_compression: fp16 halves the bytes; powersgd sends a low-rank approximation")
        self.number("powersgd_rank", s["powersgd_rank"])
        self.number("powersgd_start_step", s["powersgd_start_step"])
        self.choice("powersgd_wire", s["powersgd_wire"], "powersgd_wire",
                    "powersgd_wire: bfloat16 halves PowerSGD's bytes (its products stay float32); float32 is torch's "
                    "own hook")
        self.number("accumulate", s["accumulate"])
        self.number("bucket_mb", s["bucket_mb"])
        self.choice("tf_implementation", s["tf_implementation"], "tf_implementation",
                    "tf_implementation: ring on CPU-only nodes (nccl needs a GPU on every node)")
        self.number("tf_bytes_per_pack", s["tf_bytes_per_pack"])
        self.number("collective_timeout_s", s["collective_timeout_s"])
        if 0 < s["collective_timeout_s"] < 10:
            self.fail("collective_timeout_s", f"{s['collective_timeout_s']} s is shorter than a slow step's all-reduce",
                      "collective_timeout_s: 120 (longer than the slowest all-reduce bench measured; 0: framework default)")

    def placement(self, s: dict[str, Any]) -> None:
        """Port, processes per node, mixed precision, the nodes and their batch shares."""
        ppn = s["procs_per_node"]
        if ppn != "auto" and not NUMBERS["procs_per_node"].accepts(ppn):
            self.fail("procs_per_node", f"expected auto or {NUMBERS['procs_per_node']}, got {ppn!r}",
                      "auto: one process per GPU, one on a CPU-only node")
        self.choice("amp", s["amp"], "amp", "auto: only on GPUs with tensor cores")
        self.number("min_nodes", s["min_nodes"])
        self.number("silent_grace_s", s["silent_grace_s"])
        nodes = s["nodes"]
        if not (isinstance(nodes, str) and nodes) and not (
                isinstance(nodes, list) and nodes and all(isinstance(n, str) and n for n in nodes)):
            self.fail("nodes", f"expected all, a group name or a list of host names, got {nodes!r}",
                      "nodes: all | nodes: gpu | nodes: [pc1, pc2]")
        if not isinstance(s["shares"], dict):
            self.fail("shares", f"expected a mapping NODE: batch, got {s['shares']!r}", "shares: {pc1: 48, pc2: 16}")
        for k, v in s["shares"].items():
            if not NUMBERS["shares"].accepts(v) or "," in str(k) or "=" in str(k):
                self.fail(f"shares.{k}", f"expected {NUMBERS['shares']} for a node name without ',' or '=', "
                          f"got {v!r}", "shares: {pc1: 48, pc2: 16} (`clusterctl plan` computes them)")

    def environment(self, s: dict[str, Any]) -> None:
        """env (plain values) and env_from (secrets read on the head at launch)."""
        if not isinstance(s["env"], dict):
            self.fail("env", f"expected a mapping NAME: value, got {s['env']!r}", "env: {OMP_PROC_BIND: close}")
        for k, v in s["env"].items():
            if not isinstance(k, str) or not k or k[0].isdigit() or set(k) - ENV_NAME_CHARS:
                self.fail(f"env.{k}", "not a valid environment variable name", "letters, digits and _, not starting "
                          "with a digit")
            if isinstance(v, (dict, list)) or v is None:
                self.fail(f"env.{k}", f"expected a plain value, got {v!r}", f"env: {{{k}: '1'}}")
        if not isinstance(s["env_from"], dict):
            self.fail("env_from", f"expected a mapping NAME: {{file: PATH}} or NAME: {{env: VARIABLE}}, got {s['env_from']!r}",
                      "env_from: {HF_TOKEN: {file: ~/.secrets/hf_token}}")
        for k, v in s["env_from"].items():
            if not isinstance(k, str) or not k or k[0].isdigit() or set(k) - ENV_NAME_CHARS:
                self.fail(f"env_from.{k}", "not a valid environment variable name", "letters, digits and _, not starting "
                          "with a digit")
            if k in s["env"]:
                self.fail(f"env_from.{k}", "also given in env", f"keep {k} in one of env (plain) or env_from (secret)")
            if not (isinstance(v, dict) and len(v) == 1 and isinstance(next(iter(v.values())), str)
                    and next(iter(v)) in ("file", "env") and next(iter(v.values()))):
                self.fail(f"env_from.{k}", f"expected {{file: PATH}} or {{env: VARIABLE}}, got {v!r}",
                          f"env_from: {{{k}: {{file: ~/.secrets/{k.lower()}}}}} (a file on the head) or "
                          f"{{{k}: {{env: {k}}}}} (the head's environment when you launch)")


def _check_scheduler(checks: _Checks, s: dict[str, Any]) -> None:
    """What a batch scheduler reads of the spec (Slurm, docs/slurm.md): `requeue`, a plain true or false."""
    if not isinstance(s["requeue"], bool):
        checks.fail("requeue", f"expected true or false, got {s['requeue']!r}",
                    "requeue: true (Slurm requeues the job when a node fails) or false (it ends NODE_FAIL)")


def _validate(s: dict[str, Any], file: str, lines: dict[str, int | None]) -> None:
    checks = _Checks(file, lines)
    for key, value in s.items():  # a NUL byte reaches no argv, environment or file name intact
        found = yamlfile.nul_in(value, key)
        if found is not None:
            checks.fail(found, yamlfile.NUL_MESSAGE, "remove it", at=found if found in lines else key)
    for group in (checks.program, checks.data_and_model, checks.training, checks.communication, checks.placement,
                  checks.environment):
        group(s)
    _check_scheduler(checks, s)
    _check_continues(checks, s)
    if s["code"] is None:
        _check_program_line(checks, s)


def _check_program_line(checks: _Checks, s: dict[str, Any]) -> None:
    """A built-in job's command line, read by the program's own parser on the head: a value the program
    would refuse on every node stops here, before anything starts (the checks above name most first)."""
    args = JobSpec(Path(checks.file), s).program_args("data.npz", "out")
    try:
        program_parser().parse_args(args)
    except (argparse.ArgumentError, SystemExit) as e:  # exit_on_error=False still exits on unknown arguments
        checks.fail("job", f"the training program refuses its command line: {e}",
                    f"fix the setting it names (docs/jobs.md); the command line was: {' '.join(args)}")


def _check_continues(checks: _Checks, s: dict[str, Any]) -> None:
    """`continues`: a run id; a user's program must say what it resumes from (its `outputs`)."""
    c = s["continues"]
    if c is None:
        return
    if not isinstance(c, str) or not RUN_ID_RE.match(c):
        checks.fail("continues", f"expected a run id, got {c!r}", "clusterctl launch --continue RUN (`clusterctl "
                    "status` lists the runs)")
    if s["code"] is not None and not s["outputs"]:
        checks.fail("outputs", "a program of your own continues from what it wrote: the run folders it resumes "
                    "from must be named", "outputs: [checkpoints] (copied from the continued run on each node)")
