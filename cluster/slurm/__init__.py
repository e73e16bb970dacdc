"""The slurm stage (above runs, below study): the same jobs on a Slurm cluster (docs/slurm.md).

Takes in: a job spec (cluster.runs.jobs), the inventory's Slurm cluster (`slurm:`, read by
cluster.inventory.clusters into model.SlurmCluster), the command line's resources, a cluster's sinfo output.
Gives out: the SlurmRequest `launch JOB --on NAME --dry-run` prints: the sbatch script (templates/slurm_*.j2),
the run's settings, what is staged where on the cluster's shared filesystem; refusals of what a partition
cannot give; a submitted run's record (`target: slurm`) and Slurm's verdict on it.
Must never import: study, lab or cli.

    layout.py    where a run's files go on the cluster's shared filesystem (what submission stages where)
    resources.py what a job asks Slurm for: nodes, tasks, GPUs, CPUs, time, memory, partition (CLI > inventory)
    render.py    the sbatch script of a job spec (pure; templates/slurm_batch.sh.j2 and slurm_task.sh.j2)
    facts.py     what the cluster says about itself (`sinfo`), as command + parser
    fit.py       the refusal of a request the partition cannot give
    submit.py    prepare(): inventory + spec + cluster + overrides -> the SlurmRequest `--dry-run` prints
    sampler.py   runs on the compute nodes (standard library only): a task's resource samples
    run.py       submission over SSH on the login node; status, logs, stop (scancel), collect of a Slurm run
"""
