"""A job spec -> its sbatch script (pure: no I/O, golden-tested, printed by `launch JOB --on NAME --dry-run`).

The SAME spec an SSH launch renders (cluster.runs.render), for the same three launchers, with the program's
command line built by the same function (render.program_words), so a run on Slurm trains exactly what a run
on the room's PCs trains. Two templates:

    templates/slurm_batch.sh.j2  the batch script: #SBATCH lines (resources.Resources), the cluster's
                                 env_setup, then `srun -K` starting one task per node
    templates/slurm_task.sh.j2   what each task runs: where it stands (SLURM_PROCID, the allocation's nodes
                                 and their NodeAddr), the launcher's variables (torchrun's c10d rendezvous
                                 at the first node, TF_CONFIG, the plain launcher's CLUSTER_*), its files

The batch step writes the task script into the job's folder from a quoted here-document (nothing in it is
expanded there) whose end word carries the script's digest, so no line of the script can end it early.
Every value reaches the shell through SCRIPT_ENV, which shell-quotes each `{{ value }}`; the values on
#SBATCH lines are plain words, checked before (cluster.inventory.clusters, cluster.slurm.resources).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from cluster import __version__
from cluster.errors import ClusterError
from cluster.inventory.model import SlurmCluster
from cluster.provision.playbook import SCRIPT_ENV
from cluster.runs.jobs import JobSpec
from cluster.runs.render import data_path, program_words
from cluster.slurm import layout
from cluster.slurm.resources import Resources

BATCH_TEMPLATE = "slurm_batch.sh.j2"
TASK_TEMPLATE = "slurm_task.sh.j2"


class RenderError(ClusterError):
    """The task script holds its here-document's end word (a digest collision: never expected, never run)."""


def sbatch_options(run_id: str, workdir: str, res: Resources) -> list[str]:
    """Every #SBATCH option of the job, in the order the script shows them."""
    rdir = layout.run_dir(workdir, run_id)
    return [f"--job-name={run_id}", *res.sbatch_options(), f"--chdir={rdir}",
            f"--output={rdir}/{layout.BATCH_LOG}", f"--error={rdir}/{layout.BATCH_LOG}", "--open-mode=append",
            "--requeue" if res.requeue else "--no-requeue"]


def task_script(spec: JobSpec, cluster: SlurmCluster, res: Resources, run_id: str, data_file: str) -> str:
    """What srun runs on each node (templates/slurm_task.sh.j2): the program's words are an SSH launch's."""
    python, target = program_words(spec, layout.dataset(cluster.workdir, data_file))
    return SCRIPT_ENV.get_template(TASK_TEMPLATE).render(
        job=spec.name, run_id=run_id, run_dir=layout.run_dir(cluster.workdir, run_id), launcher=spec.launcher,
        nproc=res.nproc_per_node, port=spec["port"] or None, max_restarts=spec["max_restarts"], own=spec.own,
        data=data_path(spec), env=sorted((k, str(v)) for k, v in spec["env"].items()),
        secrets=bool(spec["env_from"]), python_path=cluster.python, python=python, target=target)


def batch_script(spec: JobSpec, cluster: SlurmCluster, res: Resources, run_id: str, data_file: str) -> str:
    """The sbatch script (templates/slurm_batch.sh.j2), the task script inside it."""
    task = task_script(spec, cluster, res, run_id, data_file)
    delimiter = f"CLUSTERCTL_TASK_{hashlib.sha256(task.encode()).hexdigest()[:16]}"
    if delimiter in task.splitlines():
        raise RenderError(f"the task script holds its here-document's end word {delimiter}")
    rdir = layout.run_dir(cluster.workdir, run_id)
    return SCRIPT_ENV.get_template(BATCH_TEMPLATE).render(
        job=spec.name, run_id=run_id, cluster=cluster.name, version=__version__,
        options=sbatch_options(run_id, cluster.workdir, res), run_dir=rdir, env_setup=cluster.env_setup,
        task_file=f"{rdir}/{layout.TASK_SCRIPT}", task_script=task, delimiter=delimiter,
        cpus_per_task=res.cpus_per_task, gpus_per_node=res.gpus_per_node)


def settings(spec: JobSpec, cluster: SlurmCluster, res: Resources, run_id: str, data_file: str) -> str:
    """The run folder's job.json: what ran, where, with which resources (as an SSH node's job.json)."""
    return json.dumps({"run_id": run_id, "cluster": cluster.name, "nodes": res.nodes, "nproc": res.nproc_per_node,
                       "world_size": res.world_size, "data_file": data_file or None, "resources": res.to_dict(),
                       "job": spec.node_settings}, indent=1, sort_keys=True, default=str) + "\n"


def files(spec: JobSpec, cluster: SlurmCluster, res: Resources, run_id: str, data_file: str) -> dict[str, Any]:
    """The files submission writes into the job's folder, by name."""
    return {layout.BATCH_SCRIPT: batch_script(spec, cluster, res, run_id, data_file),
            layout.SETTINGS: settings(spec, cluster, res, run_id, data_file)}
