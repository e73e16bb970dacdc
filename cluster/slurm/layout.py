"""Where a Slurm run's files are on the cluster's shared filesystem: what submission stages, what tasks write.

Every path is under the cluster's `workdir` (inventory `slurm.NAME.workdir`), which the login node and every
compute node mount at the same path. Nothing is copied per node: a node reads what was staged once.

    <workdir>/datasets/<file>.npz            a built-in job's dataset, staged once per cluster (as on SSH
                                             nodes: <workdir>/datasets/), shared by every run that uses it
    <workdir>/runs/<run_id>/                 the job's folder (mode 0700; sbatch --chdir), made by submission
        job.sbatch                           the batch script `launch --on NAME --dry-run` prints
        job.json                             the run's settings (the job spec, resolved, and its resources)
        program/                             the program: a built-in one's files, or the user's `code`
        data/                                a user program's `data` (file or folder), when it has one
        secrets.env                          env_from's values (0600), when the job has any
        clusterctl/usage.py                  the node agent's resource sampler (cluster/agent/usage.py) ...
        clusterctl/slurm_sampler.py          ... and its loop for a task (cluster/slurm/sampler.py)
        batch.log                            the batch step's output (sbatch --output/--error, appended)
        task.sh                              what each task runs, written by the batch step (srun starts it)
        task-<N>/                            task N's folder (SLURM_PROCID; one task per node), like an SSH
                                             node's run folder:
            node.log                         the task's output, appended across requeues
            task.json                        where it ran: node name, address, job id, restart count
            exit.json                        {"code": N, "ended": T} once its program ended (absent: killed)
            out/                             the built-in programs' --out (metrics-rank*.jsonl, checkpoints),
                                             usage.jsonl (the samples) and user-metrics.jsonl ($CLUSTER_METRICS)
            logs/                            torchrun's per-worker logs (--log-dir, --tee)
            program -> ../program            so the program's relative paths are the same as on SSH nodes

A user program runs in the shared program/ folder (as a program on a cluster does): what it writes there is
the run's, not a task's. Submission (next) stages everything above the task folders, then runs sbatch.
"""
from __future__ import annotations

from pathlib import Path

from cluster import paths

BATCH_SCRIPT = "job.sbatch"
SETTINGS = "job.json"
TASK_SCRIPT = "task.sh"
BATCH_LOG = "batch.log"
SECRETS = "secrets.env"
SAMPLER = "clusterctl/slurm_sampler.py"
USAGE = "clusterctl/usage.py"
# What submission puts into the run folder besides the program and the data: path under it -> file on the head.
HELPERS: dict[str, Path] = {USAGE: paths.PACKAGE_DIR / "agent" / "usage.py",
                            SAMPLER: paths.PACKAGE_DIR / "slurm" / "sampler.py"}


def run_dir(workdir: str, run_id: str) -> str:
    return f"{workdir}/runs/{run_id}"


def dataset(workdir: str, data_file: str) -> str:
    return f"{workdir}/datasets/{data_file}"


def task_dir(workdir: str, run_id: str, task: int) -> str:
    """Task N's folder (as the task script names it from SLURM_PROCID): where collect finds its files."""
    return f"{run_dir(workdir, run_id)}/task-{task}"
