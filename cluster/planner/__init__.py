"""The planner: each node's measured speed and the network's (bench), a model of what a node set and a
communication scheme would give (commmodel, placement), and the placement plan `plan JOB` recommends and
`launch JOB --plan` applies (plans: the only thing clusterctl calls a plan).

Takes in: an inventory, job specs, bench files.
Gives out: bench files, the placement plan (nodes, per-node batch shares, scheme), its predicted figures.
Must never import: study, lab or cli.
"""
