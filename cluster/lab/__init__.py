"""The simulated lab: PCs as network namespaces with their own sshd, links, shaping and state on disk.

Takes in: a node count and options (bandwidth, uplink, CPU quotas); needs root and netns.
Gives out: a running lab, its inventory and known_hosts (the same files a real lab would have).
Must never import: any stage but the base; only the CLI, the tests and the benchmarks import it.
"""
