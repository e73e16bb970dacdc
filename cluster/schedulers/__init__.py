"""The schedulers stage (above runs and slurm, below study): where a run runs, behind one interface (after
torchx's Scheduler); one module per target.

Takes in: a job spec and an inventory (a Submission), or a run record (which names its scheduler).
Gives out: the request a launch would run (dry-run, printable), the run record it starts, the run's state,
logs, stop and collected files, in the same shape whatever the target.
Must never import: study, lab or cli.

    interface.py  the interface every target implements (Scheduler), its launch options (Option), the
                  neutral launch request (Submission)
    api.py        the schedulers by name: the one a run record names (`of`), the one a launch goes to
                  (`for_launch`), the check of a launch's options against their declarations
    ssh.py        the room over SSH: the inventory's PCs, each run's files staged on every PC, its node agents
                  polled (cluster/runs: launch, state, watch, elastic)
    slurm.py      a Slurm cluster of the inventory: the run's files staged on its login node's shared folder,
                  sbatch, Slurm's verdict (cluster/slurm)

The CLI and the study talk to api and the interface only; a third target is one more module here and one
line in api.registry.
"""
