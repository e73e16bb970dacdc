"""What a node gets for a run, read on the head: the node agent, the program as a code tree (a user's folder or
a built-in component's files), the job's data, its secrets, and where its requirements layer lives."""
from __future__ import annotations

import os
import shlex
from importlib import resources
from pathlib import Path

from cluster.bounds import FileRefused, read_regular
from cluster.runs import code, layers
from cluster.runs.jobs import JobSpec
from cluster.runs.schema import JobError

DATA_LIMIT_BYTES = 64 * 2**30  # a data set is sent once per node and linked into each run: larger than code


# The node agent and the modules it imports beside itself (cluster/agent, stdlib only), put in each node's
# <workdir>/clusterctl/ (render.AGENT) by every launch; codecache.py goes with a user's code (runs/code.py).
AGENT_FILES = ("nodeagent.py", "runfiles.py", "runprocs.py", "usage.py")


def agent_files() -> dict[str, bytes]:
    """{file name: content} of what the node agent needs beside it."""
    return {name: resources.files("cluster.agent").joinpath(name).read_bytes() for name in AGENT_FILES}


def program_tree(spec: JobSpec) -> code.CodeTree:
    """What a node runs, as a code tree: a user's `code` folder, or a built-in program (its entry point and
    the modules it imports, out of cluster/programs). Both are shipped the same way (runs/code.py)."""
    if spec.own:
        return code.scan(Path(str(spec["code"])).expanduser())
    return code.named(Path(str(resources.files("cluster.programs"))), spec.program_files())


def secret_values(spec: JobSpec) -> dict[str, str]:
    """`env_from`: each secret read on the head, from a file or the head's environment, at launch time."""
    out = {}
    for name, src in sorted(spec["env_from"].items()):
        field_ = f"env_from.{name}"
        if "file" in src:
            path = Path(str(src["file"])).expanduser()
            fix = "point `file:` at a readable text file on the head"
            try:
                out[name] = read_regular(path, fix, noun="a secret").decode().rstrip("\n")
            except FileRefused as e:  # a FIFO would block the launch, /dev/zero exhaust the memory
                raise JobError(str(spec.path), None, field_, f"cannot read {path}: it {e.problem}", fix) from None
            except (OSError, UnicodeDecodeError) as e:
                raise JobError(str(spec.path), None, field_, f"cannot read {path}: {getattr(e, 'strerror', e)}",
                               fix) from None
        else:
            if src["env"] not in os.environ:
                raise JobError(str(spec.path), None, field_, f"the head's environment has no {src['env']}",
                               f"export {src['env']}=... before `clusterctl launch`")
            out[name] = os.environ[src["env"]]
    return out


def secrets_file(values: dict[str, str]) -> str:
    """The node's secrets.env (mode 0600), sourced by launch.sh: every value shell-quoted."""
    lines = ["# Secrets of this run (env_from), readable by its owner only. Never copied back by collect."]
    for k, v in values.items():
        lines += [f"{k}={shlex.quote(v)}", f"export {k}"]
    return "\n".join(lines) + "\n"


def data_tree(spec: JobSpec) -> code.CodeTree:
    return code.data(Path(str(spec["data"])), DATA_LIMIT_BYTES)


def layer_dir(layer: layers.Layer | None) -> str | None:
    return f"clusterctl/layers/{layer.digest}" if layer else None  # under each node's workdir (Layer.dir)
