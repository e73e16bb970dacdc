"""Peer-relayed distribution: files sent once by the head, passed on node to node, verified at each hop.

Takes in: hosts (a fan-out group), the files with their sha256, each node's destination.
Gives out: per-node delivery results and progress; used by provision (wheels) and runs (datasets).
Must never import: provision, runs, study, lab or cli.
"""
