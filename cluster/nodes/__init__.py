"""Stage 2, the nodes: many hosts at once (fan-out), and what they are (facts, check, health, GPU tables).

Takes in: hosts from the inventory, a transport per node.
Gives out: per-host results as data (`fanout.GroupResult`), parsed facts, check reports, agent replies.
Must never import: relay, provision, runs, study, lab or cli (it is below all of them).
"""
