"""A job spec + the chosen nodes -> every node's launch files (pure: no I/O, golden-tested).

torchrun: one launch.sh per node (c10d rendezvous at the first node's inventory
address). TensorFlow: one launch.sh and one tf_config.json (json.dumps) per
worker, worker 0 the chief. Values reach the shell only through templates whose
every `{{ value }}` is shell-quoted (playbook.SCRIPT_ENV).
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from cluster import __version__
from cluster.inventory import Host
from cluster.jobs import JobError, JobSpec
from cluster.playbook import SCRIPT_ENV

TEMPLATES = {"pytorch": "torchrun.sh.j2", "tensorflow": "tf_worker.sh.j2"}
AGENT = "clusterctl/nodeagent.py"  # under the node's workdir


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
class LaunchPlan:
    run_id: str
    job: JobSpec
    world_size: int
    endpoint: str | None  # torchrun's rendezvous; None for TensorFlow
    data_file: str  # name of the staged dataset under <workdir>/datasets/
    nodes: list[NodeLaunch] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "job": self.job.name, "framework": self.job.framework,
                "world_size": self.world_size, "endpoint": self.endpoint, "data_file": self.data_file,
                "nodes": [n.to_dict() for n in self.nodes]}


def run_dir(host: Host, run_id: str) -> str:
    return f"{host.workdir}/runs/{run_id}"


def agent_command(host: Host, action: str, *args: str) -> str:
    """The node agent run with the node's system Python (stdlib only; the venv may be broken)."""
    words = [host.python, f"{host.workdir}/{AGENT}", action, *args]
    return " ".join(shlex.quote(w) for w in words)


def procs_per_node(spec: JobSpec, target: Target) -> int:
    want = spec["procs_per_node"]
    if spec.framework == "tensorflow":
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
           ports: dict[str, int]) -> LaunchPlan:
    """`ports`: the rendezvous port under the first node's name (torchrun), or one port per worker (TF)."""
    if not targets:
        raise JobError(str(spec.path), None, "nodes", "no node to run on", "check `nodes:` and --limit")
    first = targets[0].host
    missing = [t.host.name for t in targets if spec["shares"] and t.host.name not in spec["shares"]]
    if missing:
        raise JobError(str(spec.path), None, "shares", f"no batch share for {', '.join(missing)}",
                       "give every node of the job a share, or none (even batches)")
    nprocs = [procs_per_node(spec, t) for t in targets]
    endpoint = f"{first.address}:{ports[first.name]}" if spec.framework == "pytorch" else None
    plan = LaunchPlan(run_id, spec, sum(nprocs), endpoint, data_file)
    workers = [f"{t.host.address}:{ports[t.host.name]}" for t in targets] if spec.framework == "tensorflow" else []
    env = sorted((k, str(v)) for k, v in spec["env"].items())
    template = SCRIPT_ENV.get_template(TEMPLATES[spec.framework])
    for rank, (t, nproc) in enumerate(zip(targets, nprocs)):
        h = t.host
        rdir = run_dir(h, run_id)
        args = spec.program_args(f"{h.workdir}/datasets/{data_file}", "out")
        files = {
            "launch.sh": template.render(
                job=spec.name, run_id=run_id, node=h.name, node_rank=rank, nnodes=len(targets), nproc=nproc,
                workdir=h.workdir, run_dir=rdir, env=env, endpoint=endpoint, entry=spec.entry, args=args,
                max_restarts=spec["max_restarts"], version=__version__, secrets=bool(spec["env_from"])),
            "job.json": json.dumps({"run_id": run_id, "node": h.name, "node_rank": rank, "nodes": len(targets),
                                    "nproc": nproc, "world_size": plan.world_size, "endpoint": endpoint,
                                    "job": spec.settings}, indent=1, sort_keys=True) + "\n",
        }
        if spec.framework == "tensorflow":
            files["tf_config.json"] = json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}, indent=1) + "\n"
        plan.nodes.append(NodeLaunch(h.name, rank, nproc, rdir, files, agent_command(h, "start", rdir)))
    return plan
