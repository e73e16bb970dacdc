"""Stage 4, runs: job specs -> rendered launch files -> started, watched, stopped runs -> collected results.

Takes in: a job spec, provisioned nodes (their state files), datasets.
Gives out: run records on the head (runs/<id>/run.json), node logs, collected run folders.
Must never import: study, lab or cli.
"""
