"""Stage 1, the inventory: an inventory file (own YAML schema or Ansible's) -> validated, layered hosts.

Takes in: inventory files, `--set`/`--host-set` overrides, known_hosts, the current context.
Gives out: `model.Inventory` / `model.Host` (the only host type every later stage uses), host-key checks.
Must never import: any other stage (transport, nodes, relay, provision, runs, study, lab, cli): only the base.
"""
