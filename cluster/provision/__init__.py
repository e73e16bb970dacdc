"""Stage 3, provision: facts -> per-node builds (compat) -> playbook steps -> a verified environment.

Takes in: the inventory's hosts, their facts, playbooks and templates, the head's wheelhouse.
Gives out: each node's state file (build + fingerprint) that launch checks, and a provision report.
Must never import: runs, study, lab or cli.
"""
