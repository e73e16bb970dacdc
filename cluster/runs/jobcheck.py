"""The checks of a resolved job spec, by group: each failure names the file and line (or --set), the field
and the fix."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, NoReturn


from cluster import yamlfile
from cluster.runs.records import RUN_ID_RE
from cluster.runs.schema import (CHOICES, COMPONENTS, DATASETS, DEFAULTS, ENV_NAME_CHARS, FRAMEWORKS, JOB_NAME_RE,
                                  LAUNCHERS, NUMBERS, PROGRAMS_DIR, RETIRED_VALUES, JobError)


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


class Checks:
    """The checks of a resolved spec, by group; each failure names the file and line (or --set) and the field."""

    def __init__(self, file: str, lines: dict[str, int | None]) -> None:
        self.file, self.lines = file, lines

    def fail(self, field: str, message: str, fix: str, at: str | None = None) -> NoReturn:
        """`at`: the setting whose line to name, where `field` is inside it (args[0])."""
        line = self.lines.get(at or field)
        where = {-1: "command line (--set)", -2: "command line"}.get(line or 0, self.file)
        raise JobError(where, None if line is not None and line < 0 else line, field, message, fix)

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
        allowed = CHOICES[knob]
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


def _check_scheduler(checks: Checks, s: dict[str, Any]) -> None:
    """What a batch scheduler reads of the spec (Slurm, docs/slurm.md): `requeue`, a plain true or false."""
    if not isinstance(s["requeue"], bool):
        checks.fail("requeue", f"expected true or false, got {s['requeue']!r}",
                    "requeue: true (Slurm requeues the job when a node fails) or false (it ends NODE_FAIL)")


def validate(s: dict[str, Any], file: str, lines: dict[str, int | None]) -> Checks:
    """Every group's checks in turn; the first failure raises JobError. Returns the checks, for the caller's own."""
    checks = Checks(file, lines)
    for key, value in s.items():  # a NUL byte reaches no argv, environment or file name intact
        found = yamlfile.nul_in(value, key)
        if found is not None:
            checks.fail(found, yamlfile.NUL_MESSAGE, "remove it", at=found if found in lines else key)
    for group in (checks.program, checks.data_and_model, checks.training, checks.communication, checks.placement,
                  checks.environment):
        group(s)
    _check_scheduler(checks, s)
    _check_continues(checks, s)
    return checks


def _check_continues(checks: Checks, s: dict[str, Any]) -> None:
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

