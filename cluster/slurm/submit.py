"""`clusterctl launch JOB --on NAME`: the request for a Slurm cluster (what `--dry-run` prints).

torchx's shape, as cluster.runs.launch: `prepare` returns the SlurmRequest (the sbatch script, the job's
settings, what is staged where), and submission runs exactly that request. `prepare` contacts nothing: it
reads the inventory's cluster entry and the spec (and, as launch.request_for does, the dataset's name
inputs on the head). The sinfo check needs the cluster's answer, so submission runs it on the login node
before sbatch: `fit.check(facts.SINFO.parse(stdout, rc), request.resources)` (exit 2, or notes to show), then
stages request.staged() and request.files into request.run_dir and runs `sbatch --parsable job.sbatch`.
Submission itself over SSH, and the run commands, come next (issue 27).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster import __version__
from cluster.errors import UsageError
from cluster.inventory.model import Inventory, SlurmCluster
from cluster.runs import datasets, records
from cluster.runs.jobs import JobSpec
from cluster.runs.schema import DEFAULTS, JobError
from cluster.runs.render import rule
from cluster.slurm import layout, render
from cluster.slurm.resources import Resources, SlurmOverrides, resolve



@dataclass
class SlurmRequest:
    """What `launch JOB --on NAME` submits, and exactly what `--dry-run` prints."""

    run_id: str
    job: JobSpec
    cluster: SlurmCluster
    resources: Resources
    data_file: str  # a built-in job's dataset under <workdir>/datasets/; "" for a user's program
    files: dict[str, str] = field(default_factory=dict)  # name under the run folder -> content
    notes: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> str:
        return layout.run_dir(self.cluster.workdir, self.run_id)

    @property
    def script(self) -> str:
        return self.files[layout.BATCH_SCRIPT]

    def staged(self) -> list[dict[str, str]]:
        """What submission puts on the cluster's shared filesystem before sbatch: where, and what it is."""
        spec, rdir = self.job, self.run_dir
        program = (f"your code ({spec['code']})" if spec.own else
                   f"the built-in program: {', '.join(spec.program_files())}")
        out = [{"path": f"{rdir}/program/", "what": program}]
        if spec.own and spec["data"] is not None:
            out.append({"path": f"{rdir}/data", "what": f"the job's data ({spec['data']})"})
        if not spec.own:
            out.append({"path": layout.dataset(self.cluster.workdir, self.data_file),
                        "what": "the dataset, prepared on the head (once per cluster)"})
        out += [{"path": f"{rdir}/{name}", "what": "the batch script" if name == layout.BATCH_SCRIPT else
                 "the run's settings"} for name in self.files]
        out += [{"path": f"{rdir}/{dest}", "what": f"the tasks' resource sampler (cluster/{src.parent.name}/{src.name})"}
                for dest, src in layout.HELPERS.items()]
        if spec["env_from"]:
            out.append({"path": f"{rdir}/{layout.SECRETS}", "what": "the job's secrets (env_from), mode 0600"})
        return out

    def to_dict(self) -> dict[str, Any]:
        """The `launch --on NAME --dry-run --json` document."""
        return {"run_id": self.run_id, "job": self.job.name, "framework": self.job.framework,
                "launcher": self.job.launcher, "cluster": self.cluster.name,
                "login": {"name": self.cluster.login.name, "route": self.cluster.login.route},
                "workdir": self.cluster.workdir, "run_dir": self.run_dir, "resources": self.resources.to_dict(),
                "port": self.job["port"] or None, "data_file": self.data_file or None, "staged": self.staged(),
                "files": dict(self.files), "notes": list(self.notes), "version": __version__}

    def to_text(self, width: int = 80) -> str:
        """The `--dry-run` text: the sbatch script under a rule naming its path, what is staged, a summary."""
        res = self.resources
        lines = [rule(f"{self.cluster.name}: {layout.BATCH_SCRIPT}", width), self.script.rstrip("\n"),
                 f"staged first through the login node {self.cluster.login.route}, on the cluster's shared "
                 f"filesystem (run folder {self.run_dir}):"]
        inside = self.run_dir + "/"
        lines += [f"  {s['path'].removeprefix(inside)}: {s['what']}" for s in self.staged()]
        lines += [f"note: {n}" for n in self.notes]
        port = (f"port {self.job['port']} (the job's `port:`)" if self.job["port"]
                else "port 15000 + the job id's last 4 digits")
        where = f"partition {res.partition}" if res.partition else "the cluster's default partition"
        lines.append(f"dry run: {res.nodes} nodes x {res.nproc_per_node} processes (world size {res.world_size}) "
                     f"on the Slurm cluster {self.cluster.name}, {where}, {port}; nothing was submitted")
        return "\n".join(lines) + "\n"


def cluster_named(inv: Inventory, name: str) -> SlurmCluster:
    """The inventory's cluster `name`; UsageError naming those it declares."""
    if name in inv.clusters:
        return inv.clusters[name]
    declared = ", ".join(sorted(inv.clusters))
    raise UsageError(f"--on {name}: the inventory {inv.path} declares no Slurm cluster {name!r}"
                     + (f" (it declares: {declared})" if declared else " (it has no `slurm:` section)"),
                     f"--on {next(iter(sorted(inv.clusters)))}" if declared else
                     "declare the cluster under `slurm:` in the inventory (docs/slurm.md)")


def refuse_unsupported(spec: JobSpec) -> None:
    """What an SSH launch does that a Slurm job does otherwise (or not yet): refused, never half-done."""
    file = str(spec.path)
    if spec.settings.get("min_nodes", 0) != DEFAULTS.get("min_nodes", 0):
        raise JobError(file, None, "min_nodes", "a Slurm job gets all of its nodes or waits for them",
                       "requeue: true lets Slurm requeue the job when a node fails (docs/slurm.md)")
    if spec.settings.get("silent_grace_s") != DEFAULTS["silent_grace_s"]:
        raise JobError(file, None, "silent_grace_s", "Slurm judges a silent node itself (its SlurmdTimeout)",
                       "leave silent_grace_s out for a Slurm run")
    if spec["shares"]:
        raise JobError(file, None, "shares", "batch shares name the inventory's PCs, not a cluster's nodes",
                       "leave shares out for a Slurm run (every worker takes `batch`)")
    if spec.own and spec["requirements"]:
        raise JobError(file, None, "requirements", "a Slurm cluster's environment is its own: clusterctl "
                       f"installs no requirements layer there ({spec['requirements']})", "install them in the "
                       "environment that the inventory's slurm entry names (python: / env_setup:), and leave "
                       "requirements out (`--requirements none` for a folder's requirements.txt)")


def prepare(inv: Inventory, spec: JobSpec, cluster_name: str, overrides: SlurmOverrides = SlurmOverrides(),
            run_id: str | None = None, data_file: str | None = None) -> SlurmRequest:
    """The request for `spec` on the inventory's cluster `cluster_name`: every value checked (exit 2), the
    sbatch script rendered. `run_id` and `data_file` are given by the golden tests; else a new run id and
    the dataset's file name (as launch.request_for)."""
    cluster = cluster_named(inv, cluster_name)
    refuse_unsupported(spec)
    res = resolve(inv, spec, cluster, overrides)
    run_id = run_id or records.new_run_id(spec.name)
    if not records.RUN_ID_RE.match(run_id):  # it goes on #SBATCH lines and into paths
        raise UsageError(f"{run_id!r} is not a run id", "leave run_id out: prepare makes a new one")
    data = "" if spec.own else data_file or datasets.file_name(spec)
    return SlurmRequest(run_id, spec, cluster, res, data, render.files(spec, cluster, res, run_id, data))
