"""Code that runs ON every node for clusterctl itself: the node agent (start, status, stop, restart, the
run folder's listing for collect), its code cache, the peer relay's node half, the usage sampler and the
environment check. Standard library only (Python 3.8+), no clusterctl imports: each file is uploaded alone.

Takes in: one-line commands and JSON on stdin from the head (cluster/runs, cluster/relay, cluster/provision).
Gives out: one-line JSON replies, run folders with their records (pid.json, exit.json, node.log), usage samples.
Must never import: anything of the head's library, not even cluster.errors (it is shipped to the node alone).
"""
