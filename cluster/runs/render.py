"""A job spec + the chosen nodes -> the launch request: every node's files and start command (pure: no I/O,
golden-tested, printed by `launch --dry-run`).

torchrun: one launch.sh per node (c10d rendezvous at the first node's inventory
address). TensorFlow: one launch.sh and one tf_config.json (json.dumps) per
worker, worker 0 the chief. Values reach the shell only through templates whose
every `{{ value }}` is shell-quoted (playbook.SCRIPT_ENV).
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster import __version__
from cluster.errors import UsageError
from cluster.inventory.model import Host
from cluster.runs.jobs import JobSpec
from cluster.runs.schema import JobError
from cluster.provision.playbook import SCRIPT_ENV
from cluster.provision.render import Raw

NODE_PYTHON = Raw('"$CLUSTER_PYTHON"')  # the venv's interpreter, as cluster.env names it on each node
TEMPLATES = {"torchrun": "torchrun.sh.j2", "tensorflow": "tf_worker.sh.j2", "plain": "plain.sh.j2"}
AGENT = "clusterctl/nodeagent.py"  # under the node's workdir
DEVICE_RE = re.compile(r"(\d{1,3}|GPU-[0-9a-fA-F-]{8,64}|MIG-[0-9A-Za-z/-]{8,80})\Z")  # nvidia-smi's index or UUID


@dataclass(frozen=True)
class Target:
    """A node as launch sees it: the inventory host and what its verified environment has."""

    host: Host
    gpus: int = 0
    backend: str = "gloo"


@dataclass
class NodeLaunch:
    node: str
    node_rank: int
    nproc: int
    run_dir: str
    files: dict[str, str]  # file name under run_dir -> content
    start_command: str

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "node_rank": self.node_rank, "nproc": self.nproc, "run_dir": self.run_dir,
                "files": sorted(self.files), "start_command": self.start_command}


@dataclass
class LaunchRequest:
    """What `launch` starts, and exactly what `launch --dry-run` prints (torchx's dry-run info): the nodes in
    rank order, each node's rendered files and start command. `launch.execute` runs this object."""

    run_id: str
    job: JobSpec
    world_size: int
    endpoint: str | None  # torchrun's rendezvous; None for TensorFlow
    data_file: str  # name of the staged dataset under <workdir>/datasets/
    nodes: list[NodeLaunch] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)  # the hosts, in the order of `nodes`
    # the job sets no `port:`: the files show the framework's default, the run gets a port free at its start
    port_picked_at_start: bool = False
    inventory: dict[str, Any] = field(default_factory=dict)  # the hosts' snapshot the run record keeps
    code: Any = None  # a user's program: the runs.code.CodeTree launch.prepare scanned (shipped by execute)
    data: Any = None  # its `data`: the runs.code.CodeTree launch.prepare scanned (shipped by execute)
    layer: Any = None  # its requirements: the runs.layers.Layer launch.prepare resolved (installed by execute)
    left_out: dict[str, str] = field(default_factory=dict)  # the job's nodes it starts without (min_nodes), why
    scheduler: str = "ssh"  # the record's scheduler: "room" when the room's Slurm gave it these PCs
    target: dict[str, Any] | None = None  # that scheduler's part of the record (the Slurm job holding the PCs)

    def to_dict(self) -> dict[str, Any]:
        """The `launch --dry-run --json` document."""
        doc = {"run_id": self.run_id, "job": self.job.name, "framework": self.job.framework,
               "world_size": self.world_size, "endpoint": self.endpoint, "data_file": self.data_file,
               "nodes": [n.to_dict() for n in self.nodes], "files": {n.node: n.files for n in self.nodes}}
        if self.left_out:
            doc["left_out"] = dict(self.left_out)
        if self.code is not None:
            doc["code"] = {"root": str(self.code.root), "files": len(self.code.files), "bytes": self.code.total,
                           "digest": self.code.digest}
        return doc

    def to_text(self, width: int = 80) -> str:
        """The `launch --dry-run` text: each file under a rule naming its path, each node's start command,
        a summary line. Plain text (no markup): printed as is."""
        lines: list[str] = []
        for n in self.nodes:
            for name, content in n.files.items():
                lines += [rule(f"{n.node}: {n.run_dir}/{name}", width), content.rstrip("\n")]
            lines.append(f"{n.node} starts with: {n.start_command}")
        port = ("the port is picked when the run starts unless the job sets `port:`" if self.port_picked_at_start
                else "the job's `port:` is used")
        if self.code is not None:
            lines.append(f"code: {self.code.root} ({len(self.code.files)} files, {self.code.total} bytes), shipped to "
                         "every node as the run's program/ folder (only what a node's cache lacks is sent)")
        if self.layer is not None:
            lines.append(f"requirements: {' '.join(self.layer.lock.split())}, installed offline on every node in "
                         f"<workdir>/clusterctl/layers/{self.layer.digest} (first on PYTHONPATH)")
        for node, why in self.left_out.items():
            lines.append(f"left out: {node} ({why}); the job's min_nodes lets it start without")
        if self.job["continues"] is not None:
            lines.append(f"continues run {self.job['continues']}: {', '.join(self.job.carried_over())} copied from "
                         "its folder on each node that ran it, before the start")
        lines.append(f"dry run: {len(self.nodes)} nodes, world size {self.world_size}; nothing was changed ({port})")
        return "\n".join(lines) + "\n"


def rule(title: str, width: int = 80) -> str:
    """`──── title ────` across `width` columns, centred as rich's Rule draws it on a terminal."""
    title = title.replace("\n", " ")
    if len(title) > width - 4:
        title = title[: max(0, width - 5)] + "…"
    side = (width - len(title)) // 2
    return ("─" * max(0, side - 1) + " " + title + " " + "─" * width)[:width]


def visible_devices(host: Host) -> list[str] | None:
    """The node's `cuda_visible_devices` (an inventory var: "0,2" or [0, 2]; indices or UUIDs as nvidia-smi
    prints them): the only GPUs its processes see, one process each. None: every GPU the node has."""
    value = host.vars.get("cuda_visible_devices")
    if value is None:
        return None
    words = [str(w).strip() for w in (value if isinstance(value, list) else str(value).split(","))]
    if not words or not all(DEVICE_RE.match(w) for w in words) or len(set(words)) != len(words) \
            or isinstance(value, bool):
        raise UsageError(f"{host.name}: inventory var cuda_visible_devices: expected GPU indices or UUIDs, each "
                         f"once, got {value!r}", "e.g. cuda_visible_devices: \"0,2\" (nvidia-smi -L lists them), "
                         "or leave it out to use every GPU of the node")
    return words


def in_workdir(host: Host, rel: str) -> str | Raw:
    """`<workdir>/<rel>` as a launch script names it: the path itself when the workdir is absolute, else
    "$CLUSTER_WORKDIR"/<rel> (the script resolves a relative workdir in the login directory first, as every
    command over SSH does, and keeps it in CLUSTER_WORKDIR: the script and the program move elsewhere)."""
    if host.workdir.startswith("/"):
        return f"{host.workdir}/{rel}"
    return Raw(f'"$CLUSTER_WORKDIR"/{shlex.quote(rel)}')


def run_dir(host: Host, run_id: str) -> str:
    return f"{host.workdir}/runs/{run_id}"


def agent_command(host: Host, action: str, *args: str) -> str:
    """The node agent run with the node's system Python (stdlib only; the venv may be broken)."""
    words = [host.python, f"{host.workdir}/{AGENT}", action, *args]
    return " ".join(shlex.quote(w) for w in words)


def program_words(spec: JobSpec, data_file: str) -> tuple[bool, list[str]]:
    """(run with the node's Python?, the words that follow): a built-in program with the arguments its
    settings give, or a user's script, module or command with its `args`. Under torchrun, a module is
    `-m MOD` and a command `--no-python CMD` (torchrun's own options)."""
    s = spec.settings
    if not spec.own:
        return True, [f"program/{spec.entry}", *spec.program_args(data_file, "out")]
    args = [str(a) for a in s["args"]]
    if s["program"] is not None:
        return True, [str(s["program"]), *args]
    if s["module"] is not None:
        return True, ["-m", str(s["module"]), *args]
    command: list[str] = [str(w) for w in s["command"]]
    if Path(command[0]).name.startswith("python"):  # `python -u train.py`: the node's provisioned Python
        command[0] = NODE_PYTHON
    return False, (["--no-python"] if spec.launcher == "torchrun" else []) + command + args


def data_path(spec: JobSpec) -> str | None:
    """Where the job's `data` is in each run folder: data/ for a folder, data/<its name> for a file."""
    if not spec.own or spec["data"] is None:
        return None
    p = Path(str(spec["data"])).expanduser()
    return "data" if p.is_dir() else f"data/{shlex.quote(p.name)}"


def procs_per_node(spec: JobSpec, target: Target) -> int:
    want = spec["procs_per_node"]
    if spec.launcher in ("tensorflow", "plain"):
        if want not in ("auto", 1):
            raise JobError(str(spec.path), None, "procs_per_node",
                           f"TensorFlow runs one worker per node (MWMS uses all of its GPUs), got {want}",
                           "leave procs_per_node at 1 for tensorflow jobs")
        return 1
    if want == "auto":
        return max(1, target.gpus)
    if target.gpus and want > target.gpus:
        raise JobError(str(spec.path), None, "procs_per_node",
                       f"{target.host.name} has {target.gpus} GPU(s), cannot run {want} processes on them",
                       "use procs_per_node: auto (one per GPU)")
    return int(want)


def render(spec: JobSpec, targets: list[Target], run_id: str, data_file: str,
           ports: dict[str, int], layer: str | None = None, period: int = 1) -> LaunchRequest:
    """`ports`: the rendezvous port under the first node's name (torchrun), or one port per worker (TF).
    `layer`: the folder (under each node's workdir) of the job's own requirements, if it has any.
    `period`: the run's membership period (cluster/runs/elastic.py): after the first, the survivors' files say
    so (CLUSTER_PERIOD in the environment, `period` in job.json)."""
    if not targets:
        raise JobError(str(spec.path), None, "nodes", "no node to run on", "check `nodes:` and --limit")
    first = targets[0].host
    missing = [t.host.name for t in targets if spec["shares"] and t.host.name not in spec["shares"]]
    if missing:
        raise JobError(str(spec.path), None, "shares", f"no batch share for {', '.join(missing)}",
                       "give every node of the job a share, or none (even batches)")
    nprocs = [procs_per_node(spec, t) for t in targets]
    endpoint = f"{first.address}:{ports[first.name]}" if spec.launcher != "tensorflow" else None
    request = LaunchRequest(run_id, spec, sum(nprocs), endpoint, data_file, targets=list(targets))
    workers = [f"{t.host.address}:{ports[t.host.name]}" for t in targets] if spec.launcher == "tensorflow" else []
    env = sorted((k, str(v)) for k, v in spec["env"].items())
    template = SCRIPT_ENV.get_template(TEMPLATES[spec.launcher])
    addrs = ",".join(t.host.address for t in targets)
    for rank, (t, nproc) in enumerate(zip(targets, nprocs)):
        h = t.host
        rdir = run_dir(h, run_id)
        python, target = program_words(spec, in_workdir(h, f"datasets/{data_file}"))
        files = {
            "launch.sh": template.render(
                job=spec.name, run_id=run_id, node=h.name, node_rank=rank, nnodes=len(targets), nproc=nproc,
                workdir=h.workdir, run_dir=in_workdir(h, f"runs/{run_id}"), env=env, endpoint=endpoint,
                python=python, target=target, workdir_relative=not h.workdir.startswith("/"),
                own=spec.own, addrs=addrs, master_addr=first.address, master_port=ports[first.name],
                layer=in_workdir(h, layer) if layer else None, data=data_path(spec),
                devices=",".join(visible_devices(h) or []) or None,
                max_restarts=spec["max_restarts"], version=__version__, secrets=bool(spec["env_from"]), period=period),
            "job.json": json.dumps({"run_id": run_id, "node": h.name, "node_rank": rank, "nodes": len(targets),
                                    "nproc": nproc, "world_size": request.world_size, "endpoint": endpoint,
                                    "job": spec.node_settings, **({"period": period} if period > 1 else {})},
                                   indent=1, sort_keys=True) + "\n",
        }
        if spec.launcher == "tensorflow":
            files["tf_config.json"] = json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}, indent=1) + "\n"
        request.nodes.append(NodeLaunch(h.name, rank, nproc, rdir, files, agent_command(h, "start", rdir)))
    return request
