"""The job schema: every setting a spec may hold with its default and its bounds, the built-in programs as
components, and the retired settings (docs/jobs.md is checked against it). The built-in programs' knobs come
from their own argument parser, so they are declared once."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any


from cluster import paths
from cluster.bounds import Range
from cluster.errors import UsageError
from cluster.programs import wlcommon

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
    modules: tuple[str, ...] = ("wlcommon.py", "wldata.py", "wlmetrics.py", "torchcomm.py", "tfcomm.py",
                                "tfworker.py")


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
    job's command line with it before anything starts (cluster.runs.jobs)."""
    ap = argparse.ArgumentParser(prog="the built-in training program", add_help=False, exit_on_error=False)
    wlcommon.add_args(ap)
    return ap


KNOBS = vars(program_parser().parse_args([]))  # dest -> the programs' default
CHOICES = {a.dest: tuple(a.choices) for a in program_parser()._actions if a.choices is not None}

# Every key a spec may hold, with its default; a spec file gives some, --set overrides any. A built-in
# program's knob takes its default from the program's parser (KNOBS).
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
    "dataset": {"name": KNOBS["dataset"], "path": None, "size": KNOBS["size"]},
    "model": KNOBS["model"],  # a torchvision.models name (PyTorch jobs); TensorFlow jobs train ResNet50
    "bn_recompute": KNOBS["bn_recompute"],
    "epochs": KNOBS["epochs"],
    "target_acc": KNOBS["target_acc"],
    "max_epochs": KNOBS["max_epochs"],
    "batch": KNOBS["batch"],
    "optimizer": {k: KNOBS[k] for k in ("lr", "momentum", "weight_decay", "warmup_epochs", "schedule", "lr_scaling")},
    "seed": KNOBS["seed"],
    "nodes": "all",
    "min_nodes": 0,  # start with at least this many of them when some do not answer; 0: all of them
    "silent_grace_s": 30,  # a node of a running run silent this long fails it (or, with min_nodes, is left out)
    "procs_per_node": "auto",
    **{k: KNOBS[k] for k in ("threads", "loader_workers", "amp")},
    "max_restarts": 0,
    **{k: KNOBS[k] for k in ("max_steps", "log_every")},
    # communication (docs/jobs.md "Communication"): what goes on the wire and how long a peer is waited for
    **{k: KNOBS[k] for k in ("grad_compression", "powersgd_rank", "powersgd_start_step", "powersgd_wire",
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
COMPRESSIONS = CHOICES["grad_compression"]
# What only the built-in programs read (their parser's knobs, their family and entry, the batch shares): a
# user's program's job.json, which its dry run shows, leaves them out
BUILT_IN_KEYS = frozenset({"framework", "entry", "dataset", "model", "bn_recompute", "epochs", "target_acc",
                           "max_epochs", "batch", "optimizer", "seed", "threads", "loader_workers", "amp", "max_steps",
                           "log_every", "shares", *COMM_KEYS})
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
POWERSGD_WIRES = CHOICES["powersgd_wire"]
LR_SCALINGS = CHOICES["lr_scaling"]
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
