"""The room as a Slurm cluster (`provision --slurm`): Debian's munge and Slurm on the inventory's own PCs.

Takes in: the inventory's `slurm.<room>` declaration (a controller PC and a group of compute PCs), their facts.
Gives out: slurm.conf, gres.conf and cgroup.conf from those facts, the Debian packages (apt, or a bundle the
head carries), one munge key, the daemons enabled and verified (sinfo, srun), and their undoing.
Must never import: runs, slurm, schedulers, study, lab or cli.
"""
