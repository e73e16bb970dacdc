"""Code that runs ON the nodes. Standard library + the frameworks only: no clusterctl imports.

Takes in: the files launch renders (launch.sh, job.json, TF_CONFIG) and its command-line arguments.
Gives out: training runs, metrics JSONL, exit records and one-line JSON replies (the node agent).
Must never import: anything of the head's library, not even cluster.errors (it is shipped to the node alone).
"""
